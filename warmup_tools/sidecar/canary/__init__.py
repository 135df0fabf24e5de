"""The canary: a plan on trial against the plan the other instances serve, judged from the request logs.

One package, split by role:

- :mod:`~warmup_tools.sidecar.canary.trial`: starting and ending a trial (``canary.json`` and the plan history);
- :mod:`~warmup_tools.sidecar.canary.log_tail`: reading the instances' request logs;
- :mod:`~warmup_tools.sidecar.canary.judge`: the statistics and the verdicts, tenant by tenant;
- :mod:`~warmup_tools.sidecar.canary.controller`: the thread that runs trials and acts on verdicts.

Why a plan is tried before it is applied, and how the verdict is reached: docs/planner.md.

A plan on trial (``canary.json``: :mod:`warmup_tools.sidecar.canary.trial`) is served by one lora_adapter instance of
this replica, or, in a fleet, by every instance of one replica; the others serve ``plan.json``.

**One instance.** From the moment the canary instance reports the plan applied, the controller reads each
instance's request log (``requests-<instance>.jsonl`` under the replica's ``request_log_dir``) and compares the
canary instance's requests with the other instances' (:func:`~warmup_tools.sidecar.canary.judge.judge`).

**A whole replica** (``canary.json`` names a replica and no instance; judged by that replica's sidecar). Every
replica logs into its own subfolder of the fleet's shared log folder (``fleet_log_dir/<replica_name>/``). The
canary side is this replica's logs, the rest the logs of the replicas that reported to the control folder's
status board when the trial's plan was applied (a replica that left is not read; one that joins during the trial
is not either: it has no baseline). Each side's baseline is its requests of the ``canary_window_s`` before the
trial started, read once when the plan is applied; a trial with fewer than ``canary_min_requests`` on either
side is rolled back at once, saying so (:func:`~warmup_tools.sidecar.canary.judge.judge_replica`).

How the verdict is reached, tenant by tenant so that no tenant carries it, is
:mod:`warmup_tools.sidecar.canary.judge`. A verdict ends the trial through the history (promoted: made the plan
of every instance; rolled back); a trial whose canary never applies the plan is rolled back after three windows.
Every verdict is one log line, with the plan and the tenants counted; the last verdicts and the running trial are
in ``/status`` (``canary``: no plan id, no tenant name), and ``/metrics`` counts them.
"""
