"""``serve``, ``sidecar``, ``front`` and ``demo``: tritonserver, with the sidecar and the OpenAI front beside it.

Their flags are the fields of :class:`ServeConfig`, :class:`SidecarConfig` and :class:`FrontSettings`
(:mod:`warmup_tools.common.flags`); the front beside a server is told the server's addresses.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from warmup_tools.common.flags import (
    add_arguments,
    add_options,
    add_settings,
    function_kwargs,
    options_from_args,
    settings_from_args,
)
from warmup_tools.common.names import replica_name
from warmup_tools.front.settings import FrontSettings
from warmup_tools.ops.cli.options import BesideOptions
from warmup_tools.ops.demo import run_demo
from warmup_tools.server.config import ServeConfig
from warmup_tools.sidecar.config import SidecarConfig

#: The front's fields a server beside it gives it (its addresses and repository), so not flags there.
FRONT_BESIDE = ("triton_grpc_url", "triton_metrics_url", "sidecar_url", "model_repository")


def add_commands(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run tritonserver on the model repository, with the OpenAI front beside it, "
                                         "until interrupted")
    add_settings(serve, ServeConfig)
    _front_beside(serve)
    serve.set_defaults(func=_cmd_serve)

    sidecar = sub.add_parser("sidecar", help="run tritonserver with the readiness and recovery sidecar beside it "
                                             "(/ready, /live, /status) until interrupted")
    add_settings(sidecar, ServeConfig)
    add_settings(sidecar, SidecarConfig)
    _front_beside(sidecar)
    sidecar.set_defaults(func=_cmd_sidecar)

    front = sub.add_parser("front", help="run the OpenAI-compatible HTTP front against a running tritonserver "
                                         "(/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics)")
    add_settings(front, FrontSettings)
    front.set_defaults(func=_cmd_front)

    demo = sub.add_parser("demo", help="start the server, stream requests for two adapters, stop")
    add_settings(demo, ServeConfig)
    add_arguments(demo, run_demo)
    demo.set_defaults(func=_cmd_demo)


def _front_beside(parser: argparse.ArgumentParser) -> None:
    add_settings(parser, FrontSettings, exclude=FRONT_BESIDE)
    add_options(parser, BesideOptions)


def serve_config(args: argparse.Namespace) -> ServeConfig:
    return settings_from_args(ServeConfig, args)


def sidecar_config(args: argparse.Namespace) -> SidecarConfig:
    """The sidecar's settings: defaults, ``--sidecar-config``, ``WARMUP_SIDECAR_<FIELD>`` variables, flags."""
    return settings_from_args(SidecarConfig, args)


def front_settings(args: argparse.Namespace, **known: object) -> FrontSettings:
    """The front's settings: defaults, ``--front-config``, ``WARMUP_FRONT_<FIELD>`` variables, what the
    command knows (``known``: the server's addresses), then flags."""
    return settings_from_args(FrontSettings, args, known=known)


def _cmd_serve(args: argparse.Namespace) -> int:
    config = serve_config(args)
    stop = stop_on_signals()
    with _server(config) as server:
        server.wait_ready(timeout=config.ready_timeout_s)
        return _serve_with_front(args, config, server, stop,
                                 f"serving {config.model_repository}: HTTP {server.http_url}, gRPC {server.grpc_url}, "
                                 f"metrics {server.metrics_url} (log {server.log_path})")


def _cmd_sidecar(args: argparse.Namespace) -> int:
    from warmup_tools.sidecar.app import replica_log_dir

    config = serve_config(args)
    settings = sidecar_config(args)
    env = {}
    if settings.fleet_log_dir is not None:
        # NOTE: in a fleet the replica's request_log_dir follows from the shared folder and its name: one source.
        mine = replica_log_dir(settings, replica_name(config.replica_name))
        env["WARMUP_REQUEST_LOG_DIR"] = str(Path(mine).resolve())  # type: ignore[arg-type]
    # NOTE: the lora_adapter instances serve their KV events on unix sockets in a folder only this user may enter,
    # made per start (and removed at exit); the front's gRPC worker listeners relay them to the router.
    events_dir = Path(tempfile.mkdtemp(prefix="wkv-"))
    env["WARMUP_KV_EVENTS_DIR"] = str(events_dir)
    stop = stop_on_signals()
    try:
        return _run_sidecar(args, config, settings, env, stop, events_dir)
    finally:
        shutil.rmtree(events_dir, ignore_errors=True)


def _run_sidecar(args: argparse.Namespace, config: ServeConfig, settings: SidecarConfig, env: dict[str, str],
                 stop: "Stop", events_dir: Path) -> int:
    from warmup_tools.server.process import RepositoryKey
    from warmup_tools.sidecar.app import Sidecar

    # NOTE: the key is generated here and handed to the sidecar object only: clients of the server
    # cannot load or unload models, the sidecar can.
    with _server(config, env, explicit_model_control=True, repository_key=RepositoryKey.generate()) as server:
        # The sidecar answers from the start, so a startupProbe sees 503 with the reason while models load.
        with Sidecar(settings, server.http_url, server.grpc_url, server.repository_key,
                     config.model_repository, control_dir=config.control_dir, server=server,
                     replica_name=config.replica_name, snapshot_dir=config.snapshot_dir) as sidecar:
            # The front answers from the start too: 503 with the sidecar's reason until /ready says 200.
            return _serve_with_front(args, config, server, stop,
                                     f"tritonserver starting on {config.model_repository}: HTTP {server.http_url}, "
                                     f"gRPC {server.grpc_url} (log {server.log_path}); sidecar {sidecar.url}/ready "
                                     "/live /status", sidecar_url=sidecar.url,
                                     after_drain=lambda: _unload_for_exit(sidecar, config.exit_timeout_s),
                                     kv_events_dir=events_dir)


def _cmd_front(args: argparse.Namespace) -> int:
    from warmup_tools.front.server import FrontServer

    stop = stop_on_signals()
    with FrontServer(front_settings(args)) as front:
        print(f"OpenAI front on {front.url}/v1 for tritonserver {front.settings.triton_grpc_url}; Ctrl-C stops",
              flush=True)
        while not stop.wait(1.0):
            if not front.alive():
                print("the OpenAI front stopped", file=sys.stderr)
                return 1
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from warmup_tools.demo.assets import ensure_demo_assets

    config = serve_config(args)
    ensure_demo_assets(config.assets_dir)
    run_demo(config, **function_kwargs(run_demo, args))
    return 0


def _start_front(args: argparse.Namespace, config: ServeConfig, server: Any, sidecar_url: str = "",
                 kv_events_dir: Path | None = None) -> Any:
    """The OpenAI front beside ``server`` (None with --no-front); the caller stops it. ``kv_events_dir``: the folder
    the server's instances serve their KV events in (the sidecar command's), which the front's gRPC worker listeners
    relay."""
    if not options_from_args(BesideOptions, args).front:
        return None
    from warmup_tools.front.server import FrontServer

    known = {"kv_events_dir": kv_events_dir} if kv_events_dir is not None else {}
    settings = front_settings(args, triton_grpc_url=server.grpc_url, triton_metrics_url=server.metrics_url,
                              sidecar_url=sidecar_url, model_repository=config.model_repository, **known)
    front = FrontServer(settings, environ={**os.environ, **config.server_env()})
    front.start()
    return front


def _serve_with_front(args: argparse.Namespace, config: ServeConfig, server: Any, stop: "Stop", banner: str, *,
                      sidecar_url: str = "", after_drain: Any = None, kv_events_dir: Path | None = None) -> int:
    """Start the OpenAI front beside ``server``, print ``banner`` with its address, serve until stopped, stop it.
    Stopped by SIGTERM, the front drains first (docs/fleet.md): /health fails, the requests in flight finish;
    then the caller stops tritonserver, whose lora_adapter instances write their KV snapshots."""
    front = _start_front(args, config, server, sidecar_url=sidecar_url, kv_events_dir=kv_events_dir)
    try:
        print(banner + (f"; OpenAI front {front.url}/v1" if front else "") + "; Ctrl-C stops", flush=True)
        code = _wait_while_alive(server, stop, front)
        if code == 0 and front is not None and stop.signal == signal.SIGTERM:
            print(f"SIGTERM: draining the OpenAI front (/health 503; new requests refused after "
                  f"{front.settings.drain_grace_s:g} s)", flush=True)
            left = front.drain(stop=stop.interrupted)
            print(f"drained: {front.in_flight_at_drain} request(s) were in flight at SIGTERM; "
                  + ("all finished" if not left else f"the drain timed out with {left} still in flight"), flush=True)
            if after_drain is not None:
                after_drain()
        return code
    finally:
        if front is not None:
            front.stop()


class Stop(threading.Event):
    """Set by SIGINT or SIGTERM (Ctrl-C, ``docker stop``, a pod's termination); ``signal`` says which came
    first, ``interrupted`` is set by a SIGINT (it cuts a SIGTERM's drain short)."""

    def __init__(self) -> None:
        super().__init__()
        self.signal: int | None = None
        self.interrupted = threading.Event()

    def handle(self, sig: int, _frame: object = None) -> None:
        if self.signal is None:
            self.signal = sig
        if sig == signal.SIGINT:
            self.interrupted.set()
        self.set()


def stop_on_signals() -> Stop:
    """A :class:`Stop` that SIGINT and SIGTERM set from now on."""
    stop = Stop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop.handle)
    return stop


def _server(config: ServeConfig, env: Mapping[str, str] | None = None, **options: Any) -> Any:
    from warmup_tools.server.process import ServerPorts, TritonServer

    return TritonServer(config.model_repository,
                        ports=ServerPorts(config.http_port, config.grpc_port, config.metrics_port),
                        env={**config.server_env(), **(env or {})}, log_path=config.log_file,
                        log_verbose=config.log_verbose,
                        host=config.host, metrics_host=config.metrics_host,
                        exit_timeout_s=config.exit_timeout_s, **options)


def _wait_while_alive(server: Any, stop: threading.Event, front: Any = None) -> int:
    """Until ``stop``: 0; or 1 with the log tail when tritonserver exits on its own (a restart by the
    sidecar is waited for, not an exit), or when the OpenAI front stopped."""
    while not stop.wait(1.0):
        if front is not None and not front.alive():
            print("the OpenAI front stopped; stopping tritonserver", file=sys.stderr)
            return 1
        if server.exited():
            print(f"tritonserver exited with code {server.returncode}; log tail:\n{server.log_tail()}",
                  file=sys.stderr)
            return 1
    return 0


def _unload_for_exit(sidecar: Any, timeout_s: float) -> None:
    started = time.monotonic()
    done = sidecar.unload_for_exit(timeout_s=timeout_s)
    print(f"lora_adapter unloaded in {time.monotonic() - started:.1f} s (its KV snapshots written)" if done else
          f"lora_adapter was not unloaded within {timeout_s:g} s", flush=True)
