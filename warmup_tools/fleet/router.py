"""The ``smg`` router (Shepherd Model Gateway, pinned in pyproject.toml) in front of the replicas' OpenAI fronts.

It starts with no worker: a replica's membership (membership.py) adds it through smg's worker API
(``POST /workers``) once that replica's ``/health`` says warm, and removes it (``DELETE /workers/{id}``: no new
request goes to it) before the replica is sent SIGTERM. smg's own health checks probe the same ``/health``
meanwhile, so a replica that stops being warm leaves rotation too.

smg serves its worker API on the same port as ``/v1/*``. With a control-plane key (FleetSettings'
``router_key_file``: in trust mode the deployment's ``router_control.key``,
:class:`~warmup_tools.common.deployment.DeploymentSecrets`; without it ``control_key_file``, as the gRPC variants
give it; ``warmup_tools fleet`` over gRPC makes one per run) it answers 401 to a worker API call without
``Authorization: Bearer <key>``, and ``/v1/*`` is unchanged. :func:`smg_argv` is the one definition of the router's
command line: ``warmup_tools fleet`` runs it, and so does ``warmup_tools router``, which compose and Kubernetes
run."""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from warmup_tools.common.deployment import DeploymentSecrets
from warmup_tools.common.errors import ServerError
from warmup_tools.common.limits import MAX_BODY_BYTES
from warmup_tools.fleet.process import Child
from warmup_tools.fleet.settings import FleetSettings
from warmup_tools.fleet.smg_launch import KEY_FILE_FLAG
from warmup_tools.server.process import free_port

#: Deadline of one worker registration or removal (smg runs them as background jobs).
WORKER_JOB_TIMEOUT_S = 120.0
#: The scheme of a gRPC worker's URL (smg's engine protocol); an HTTP worker's is its front's ``http://``.
GRPC_SCHEME = "grpc://"


@dataclasses.dataclass(frozen=True, slots=True)
class ServedModel:
    """What the router needs of the model the replicas serve when it is the OpenAI server (``worker_protocol``
    grpc): the LM's folder (tokenizer, chat template) and the KV block size, both of the repository's
    ``lora_adapter`` config. The caller reads them (``warmup_tools.ops.cli.fleet.served_model``, from
    ``PlanTarget``): the fleet starts processes and reads no model's config."""

    tokenizer_dir: Path
    block_size: int


class RouterClient:
    """A client of a running smg's worker API (``url``: its OpenAI port)."""

    def __init__(self, url: str, health_check_interval_s: int, process: Child | None = None, *,
                 control_key: str | None = None) -> None:
        """``control_key``: the router's control-plane key (None: a router started without one)."""
        self.url = url.rstrip("/")
        self.health_check_interval_s = health_check_interval_s
        self.process = process
        self._control_key = control_key

    # ------------------------------------------------------------------------------------- workers
    def workers(self) -> list[dict[str, Any]]:
        """``GET /workers``: every registered worker (its ``id``, ``url``, ``status``, ``load``)."""
        return list(self._call("GET", "/workers").get("workers", []))

    def add(self, url: str, model: str, timeout_s: float = WORKER_JOB_TIMEOUT_S, *,
            kv_block_size: int | None = None) -> str:
        """Register ``url`` as a worker serving ``model`` and wait until the router routes to it: its worker id.

        NOTE: smg 1.13 routes a model to the workers whose first model card names it, and rewrites an alias to
        the card's id: one replica serving several adapters is one worker per model, each at its own URL
        (the front's ``/m/<model>`` prefix, or its own gRPC listener), so that the model reaches the replica
        unchanged.

        A ``grpc://`` URL is one of the front's smg engine listeners (``kv_block_size``: the replicas' KV block
        size, the same on every replica of a model): smg asks the listener its model (GetModelInfo), its block
        size (GetServerInfo) and subscribes to its KV events."""
        health = {"check_interval_secs": self.health_check_interval_s}
        if url.startswith(GRPC_SCHEME):
            if kv_block_size is None:
                raise ValueError(f"a gRPC worker ({url}) is registered with the replicas' kv_block_size")
            body: dict[str, Any] = {"url": url, "runtime": "vllm", "connection_mode": "grpc",
                                    "kv_block_size": kv_block_size, "health": health}
        else:
            body = {"url": url, "runtime_type": "generic", "health": health, "models": [{"id": model}]}
        answer = self._call("POST", "/workers", body)
        worker_id = str(answer["worker_id"])
        self._wait(lambda: self._status(worker_id) == "ready", timeout_s,
                   f"the router did not make {url} ready")
        return worker_id

    def remove(self, worker_id: str, timeout_s: float = WORKER_JOB_TIMEOUT_S) -> None:
        """Deregister a worker and wait until the router no longer routes to it (draining or gone)."""
        self._call("DELETE", f"/workers/{worker_id}")
        self._wait(lambda: self._status(worker_id) in ("draining", None), timeout_s,
                   f"the router did not take worker {worker_id} out of rotation")

    def _status(self, worker_id: str) -> str | None:
        for worker in self.workers():
            if worker.get("id") == worker_id:
                return str(worker.get("status"))
        return None

    def _wait(self, done: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if (self.process is not None and self.process.exited()) or time.monotonic() > deadline:
                tail = self.process.log_tail() if self.process is not None else ""
                raise ServerError(f"{what} within {timeout_s:g} s\n{tail}")
            time.sleep(0.1)

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data else {}
        if self._control_key is not None:
            headers["Authorization"] = f"Bearer {self._control_key}"
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            raise ServerError(f"smg {method} {path}: {exc.code} {exc.read()[:300]!r}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise ServerError(f"smg {method} {path}: {exc}") from None


class Router(RouterClient):
    """``smg launch`` on the fleet's port with the fleet's policy, and a client of its worker API."""

    def __init__(self, settings: FleetSettings, work_dir: Path, served: ServedModel | None = None) -> None:
        """``served``: the model the replicas serve (needed with ``worker_protocol`` grpc)."""
        self.settings = settings
        host = settings.host
        self.port = settings.port or free_port(host)
        self.prometheus_port = settings.prometheus_port or free_port(host)
        self.url = f"http://{host if host not in ('0.0.0.0', '::') else '127.0.0.1'}:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.prometheus_port}/metrics"
        argv = smg_argv(settings, port=self.port, prometheus_port=self.prometheus_port, served=served)
        super().__init__(self.url, settings.health_check_interval_s,
                         Child("router", argv, {"PATH": str(Path(sys.executable).parent), "HOME": str(work_dir)},
                               work_dir / "router.log"), control_key=control_key(settings))

    def start(self, timeout_s: float = 60.0) -> None:
        self.process.start()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.workers()
                return
            except ServerError:
                if self.process.exited() or time.monotonic() > deadline:
                    self.stop()
                    raise ServerError(f"the smg router did not start on {self.url}:\n"
                                      f"{self.process.log_tail()}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        self.process.stop(signal.SIGTERM, 30.0)


def smg_argv(settings: FleetSettings, *, port: int, prometheus_port: int,
             served: ServedModel | None = None) -> list[str]:
    """The router's command line: smg (through :mod:`~warmup_tools.fleet.smg_launch`) with the fleet's policy,
    thresholds and health checks, no conversation or response store, the front's bound on a request body, and with
    a control-plane key (``router_key_file``: trust mode's ``router_control.key``, or ``control_key_file``) its
    worker API behind that key, which the launcher reads from the file: the key is on no command line (smg 1.13
    takes it on its own command line only). With
    ``worker_protocol`` grpc also ``served``'s LM folder (smg tokenizes) and block size, and for ``cache_aware`` its
    event index."""
    argv = [sys.executable, "-m", "warmup_tools.fleet.smg_launch"]
    if settings.router_key_file is not None:
        argv += [KEY_FILE_FLAG, str(settings.router_key_file)]
    argv += ["--host", settings.host, "--port", str(port),
             "--prometheus-host", settings.host, "--prometheus-port", str(prometheus_port),
             "--policy", settings.routed_policy, "--cache-threshold", str(settings.cache_threshold),
             "--balance-abs-threshold", str(settings.balance_abs_threshold),
             "--balance-rel-threshold", str(settings.balance_rel_threshold),
             "--worker-warmup-secs", str(settings.warmup_slice_s),
             "--health-check-endpoint", "/health",
             "--health-check-interval-secs", str(settings.health_check_interval_s),
             "--health-failure-threshold", "1", "--health-success-threshold", "1",
             # NOTE: the product serves chat and completions, never smg's conversations and responses; its default
             # in-memory store answered anyone and grew with what they stored (bounded by items, not bytes).
             "--history-backend", "none",
             # NOTE: a body the front would refuse (413) is refused here already, before smg buffers it to route.
             "--max-payload-size", str(MAX_BODY_BYTES),
             "--shutdown-grace-period-secs", str(round(settings.router_shutdown_grace_s)), "--log-level", "warn"]
    if settings.grpc:
        if served is None:
            raise ValueError("worker_protocol grpc: the router needs the served model (ServedModel)")
        lm, block_size = served.tokenizer_dir, served.block_size
        # NOTE: on gRPC workers smg is the OpenAI server: it templates and tokenizes from the LM's own folder (no
        # hub: without --model-path smg 1.13 looks the worker's model path up on Hugging Face). Started without
        # worker URLs, smg 1.13 builds the HTTP router alone and answers 404 to a model served by gRPC workers
        # registered later; --enable-igw builds one router per connection mode and model.
        argv += ["--model-path", str(lm), "--block-size", str(block_size)]
        if settings.kv_index is not None:
            argv += ["--kv-index", settings.kv_index]
        argv += ["--enable-igw"]
    return argv


def control_key(settings: FleetSettings) -> str | None:
    """The router's control-plane key, read from ``router_key_file`` (ConfigError naming a missing or empty file);
    None when the router runs without one."""
    path = settings.router_key_file
    if path is None:
        return None
    return DeploymentSecrets(Path(path).parent).read_key(path)
