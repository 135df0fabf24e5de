"""The canary: a plan on trial against the plan the other instances serve, judged from the request logs.

One package, split by role:

- :mod:`~warmup_tools.sidecar.canary.trial`: starting and ending a trial (``canary.json`` and the plan history);
- :mod:`~warmup_tools.sidecar.canary.log_tail`: reading the instances' request logs;
- :mod:`~warmup_tools.sidecar.canary.judge`: the statistics and the verdicts, tenant by tenant;
- :mod:`~warmup_tools.sidecar.canary.controller`: the thread that runs trials and acts on verdicts.

A plan on trial is served by one lora_adapter instance of this replica, or, in a fleet, by every instance of one
replica; the others serve ``plan.json``. On one instance, the controller reads each instance's request log
(``requests-<instance>.jsonl`` under the replica's ``request_log_dir``) from the moment the canary instance reports
the plan applied. On a whole replica (``canary.json`` names a replica and no instance; judged by that replica's
sidecar), every replica logs into ``fleet_log_dir/<replica_name>/``; the canary side is this replica's logs, the
rest the logs of the replicas on the control folder's status board when the plan was applied, each side with its
baseline (its requests of the ``canary_window_s`` before the trial, read once).

A verdict ends the trial through the history (promoted: made the plan of every instance; rolled back); it is one
log line, and ``/status`` (``canary``: no plan id, no tenant name) and ``/metrics`` show it.

Why a plan is tried before it is applied, and why the verdict is reached as it is: docs/planner.md, "Canary: a plan
on trial".
"""
