"""The preload sidecar: one long-running process beside tritonserver that owns readiness and recovery.

- ``config``: :class:`SidecarConfig`, every setting of the sidecar in one validated object.
- ``health``: the state machine (per-model health, readiness, when to repair); pure, no I/O.
- ``probes``: real small inferences through tritonclient, one per composing model and the ensemble.
- ``repository``: Triton's model-repository API (unload, load, index) behind the per-run key.
- ``monitor``: the background thread that probes at an interval and repairs unhealthy models.
- ``coverage``: warm coverage, from the plan statuses lora_adapter instances write to the control folder.
- ``replan``: the rolling re-plan on a schedule (planner over recent logs, applied live, stanzas written).
- ``plan_id``: which warm-up plan the repository's lora_adapter stanzas come from (for ``/status``).
- ``app``: :class:`Sidecar`, all of the above for one tritonserver.
- ``endpoints``: ``/ready``, ``/live`` and ``/status`` for Kubernetes probes and operators.
"""
