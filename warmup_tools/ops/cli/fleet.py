"""``fleet``, ``router`` and ``join``: replicas behind the smg router (docs/fleet.md); flags from
:class:`FleetSettings` (``WARMUP_FLEET_<FIELD>`` variables, ``--fleet-config``)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from warmup_tools.common.flags import add_options, add_settings, options_from_args, settings_from_args
from warmup_tools.fleet.settings import FleetSettings
from warmup_tools.ops.cli.options import JoinOptions
from warmup_tools.ops.cli.serving import stop_on_signals

if TYPE_CHECKING:
    from warmup_tools.fleet.router import ServedModel

#: What the router reads of the fleet's settings (``router``; the replicas' are the ``fleet``'s own).
ROUTER_FIELDS = ("worker_protocol", "policy", "cache_threshold", "balance_abs_threshold", "balance_rel_threshold",
                 "warmup_slice_s", "host", "port", "prometheus_port", "secrets_dir", "control_key_file",
                 "health_check_interval_s", "router_shutdown_grace_s", "model_repository", "assets_dir")
#: What ``join`` reads of them (with worker_protocol grpc, the repository's KV block size: model_repository and
#: assets_dir as the replicas have them).
JOIN_FIELDS = ("worker_protocol", "secrets_dir", "control_key_file", "membership_interval_s", "health_check_interval_s",
               "model_repository", "assets_dir")
#: smg's own metrics port: a router alone on its host takes it when the fleet's ``prometheus_port`` is 0
#: (any free port, which only a fleet that starts the router itself can find out).
SMG_PROMETHEUS_PORT = 29000


def add_commands(sub: Any) -> None:
    fleet = sub.add_parser("fleet", help="N replicas (tritonserver, sidecar and OpenAI front each) behind the smg "
                                         "router, each joining once warm, until interrupted (docs/fleet.md)")
    add_settings(fleet, FleetSettings)
    fleet.set_defaults(func=_cmd_fleet)

    router = sub.add_parser("router", help="run the smg router of a fleet (what compose and Kubernetes run): the "
                                           "fleet's policy, thresholds and health checks, its worker API behind the "
                                           "deployment's router_control.key (trust mode's, or --control-key-file)")
    add_settings(router, FleetSettings, only=ROUTER_FIELDS)
    router.set_defaults(func=_cmd_router)

    join = sub.add_parser("join", help="keep a running replica's membership in a running smg router until SIGTERM: "
                                       "one worker per model it serves once its /health says warm, added and "
                                       "removed as adapters go live and retire, added again after a router "
                                       "restart, all removed at SIGTERM (compose and each Kubernetes pod run it)")
    add_options(join, JoinOptions)
    add_settings(join, FleetSettings, only=JOIN_FIELDS, aliases={"membership_interval_s": "--interval-s"})
    join.set_defaults(func=_cmd_join)


def fleet_settings(args: argparse.Namespace) -> FleetSettings:
    """The fleet's settings: defaults, ``--fleet-config``, ``WARMUP_FLEET_<FIELD>`` variables, then flags."""
    return settings_from_args(FleetSettings, args)


def served_model(settings: FleetSettings) -> ServedModel | None:
    """With ``worker_protocol`` grpc, the LM folder and KV block size of the repository the replicas serve (its
    ``lora_adapter`` config, ``WARMUP_ASSETS_DIR``: ``assets_dir`` when set), which smg tokenizes and hashes by;
    None over HTTP."""
    if not settings.grpc:
        return None
    from warmup_tools.fleet.router import ServedModel
    from warmup_tools.planning.target import PlanTarget
    from warmup_tools.server.config import ServeConfig

    environ = dict(os.environ)
    if settings.assets_dir is not None:
        environ["WARMUP_ASSETS_DIR"] = str(Path(settings.assets_dir).resolve())
    target = PlanTarget.from_repository(Path(settings.model_repository or ServeConfig().model_repository), environ)
    return ServedModel(Path(target.tokenizer_dir).resolve(), target.block_size)


def _cmd_fleet(args: argparse.Namespace) -> int:
    from warmup_tools.fleet.fleet import Fleet

    settings = fleet_settings(args)
    stop = stop_on_signals()
    with Fleet(settings, served_model(settings)) as fleet:
        print(f"router ({settings.routed_policy}) on {fleet.router.url}/v1, metrics {fleet.router.metrics_url}; "
              "replicas: "
              + ", ".join(f"{name} {r.url}" for name, r in fleet.replicas.items())
              + f"; work folder {fleet.work_dir}; Ctrl-C stops (each replica drains first)", flush=True)
        while not stop.wait(1.0):
            for name, replica in fleet.replicas.items():
                if replica.process.exited():
                    print(f"replica {name} exited; its output:\n{replica.process.log_tail()}", file=sys.stderr)
                    return 1
            if fleet.router.process.exited():
                print(f"the router exited:\n{fleet.router.process.log_tail()}", file=sys.stderr)
                return 1
    return 0


def _cmd_router(args: argparse.Namespace) -> int:
    from warmup_tools.fleet.router import control_key, smg_argv

    settings = fleet_settings(args)
    port = settings.port or FleetSettings().port
    control_key(settings)  # a missing or empty key file fails here, with its name, before smg starts
    argv = smg_argv(settings, port=port, prometheus_port=settings.prometheus_port or SMG_PROMETHEUS_PORT,
                    served=served_model(settings))
    print(f"smg {settings.routed_policy} router ({settings.worker_protocol} workers) on {settings.host}:{port}, "
          "worker API "
          + ("behind the control-plane key" if settings.router_key_file else "open (no control-plane key)"),
          flush=True)
    os.execv(argv[0], argv)  # NOTE: smg takes this process's place: signals reach it, its exit is ours


def _cmd_join(args: argparse.Namespace) -> int:
    from warmup_tools.common.deployment import DeploymentSecrets
    from warmup_tools.fleet.membership import Membership
    from warmup_tools.fleet.replica import wait_warm
    from warmup_tools.fleet.router import RouterClient, control_key

    settings = fleet_settings(args)
    opts = options_from_args(JoinOptions, args)
    interval = settings.membership_interval_s
    replica_key = None
    if settings.secrets_dir is not None:
        secrets = DeploymentSecrets(settings.secrets_dir)
        replica_key = secrets.read_key(secrets.probe_key)
    router = RouterClient(opts.router, settings.health_check_interval_s, control_key=control_key(settings))
    membership = Membership(opts.replica, router, interval, replica_key=replica_key,
                            protocol=settings.worker_protocol, worker_host=opts.worker_host,
                            kv_block_size=served.block_size if (served := served_model(settings)) else None)
    if opts.once:
        wait_warm(opts.replica, opts.timeout_s)
        membership.sync()
        workers = membership.workers
        print(f"{opts.replica} joined {opts.router}: {len(workers)} worker(s), models {', '.join(workers)}")
        return 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: membership.stop())  # run() leaves the router, then returns
    print(f"keeping {opts.replica} in {opts.router} (a look every {interval:g} s) until SIGTERM", flush=True)
    membership.run()
    print(f"{opts.replica} left {opts.router}", flush=True)
    return 0
