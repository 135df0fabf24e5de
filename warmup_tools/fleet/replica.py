"""One replica: ``python -m warmup_tools sidecar`` (tritonserver, the sidecar and the OpenAI front) in a child
process on free ports, sharing the fleet's control, snapshot and request log folders under a name of its own."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from warmup_tools.common.deployment import DeploymentSecrets
from warmup_tools.common.errors import ServerError
from warmup_tools.fleet.process import Child
from warmup_tools.fleet.settings import FleetSettings
from warmup_tools.server.client import metric_sum, scrape_metrics
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.server.process import free_port, free_port_block


class Replica:
    """A replica of the fleet; :meth:`wait_warm` returns once its front's ``/health`` says 200 (the sidecar's
    ``/ready``: every model healthy and the planned hot set resident), :meth:`stop` drains it (SIGTERM)."""

    def __init__(self, name: str, settings: FleetSettings, work_dir: Path, control_dir: Path,
                 snapshot_dir: Path | None, *, warm_gate: bool = True, request_log_dir: Path | None = None) -> None:
        """``snapshot_dir`` None: no KV snapshots (neither restored nor written); ``warm_gate`` False: /health
        says 200 once tritonserver is READY, without waiting for the planned hot set (coverage threshold 0);
        ``request_log_dir``: the fleet's shared log folder (the replica logs into ``<it>/<name>/``)."""
        self.name = name
        self.settings = settings
        self.snapshot_dir = snapshot_dir
        host = settings.host
        http, grpc, metrics, sidecar, front = (free_port(host) for _ in range(5))
        self.url = f"http://{host if host not in ('0.0.0.0', '::') else '127.0.0.1'}:{front}"
        self.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
        self.sidecar_url = f"http://127.0.0.1:{sidecar}"
        argv = [sys.executable, "-m", "warmup_tools", "sidecar", "--replica-name", name,
                "--control-dir", str(control_dir),
                # NOTE: tritonserver on the loopback whatever the fleet's host: its front and sidecar are its clients.
                "--host", "127.0.0.1", "--http-port", str(http), "--grpc-port", str(grpc),
                "--metrics-port", str(metrics),
                "--sidecar-port", str(sidecar), "--front-host", host, "--front-port", str(front),
                "--log-file", str(work_dir / f"{name}.tritonserver.log"),
                "--ready-timeout-s", str(settings.warm_timeout_s)]
        if snapshot_dir is not None:
            argv += ["--snapshot-dir", str(snapshot_dir)]
        if request_log_dir is not None:
            argv += ["--fleet-log-dir", str(request_log_dir)]
        if not warm_gate:
            argv += ["--coverage-threshold", "0"]
        if settings.sidecar_config is not None:
            argv += ["--sidecar-config", str(settings.sidecar_config)]
        if settings.model_repository is not None:
            argv += ["--model-repository", str(settings.model_repository)]
        if settings.assets_dir is not None:
            argv += ["--assets-dir", str(settings.assets_dir)]
        env = dict(os.environ)
        # NOTE: the replica runs this package's code wherever it was imported from (a worktree, a checkout).
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
        env["WARMUP_LM_THREADS"] = str(settings.lm_threads)
        env["WARMUP_FRONT_DRAIN_GRACE_S"] = str(settings.drain_grace_s)
        env["WARMUP_FRONT_DRAIN_TIMEOUT_S"] = str(settings.stop_timeout_s)
        #: worker_protocol grpc: the first of the front's smg engine listener ports (the base model's; each live
        #: adapter's on the next ones), None over HTTP.
        self.grpc_worker_port: int | None = None
        if settings.grpc:
            self.grpc_worker_port = free_port_block(host, settings.grpc_ports_per_replica)
            env["WARMUP_FRONT_GRPC_WORKER_PORT"] = str(self.grpc_worker_port)
            env["WARMUP_FRONT_GRPC_WORKER_HOST"] = host
            # NOTE: the front listens on no port beyond the block (an adapter beyond it gets no listener).
            env["WARMUP_FRONT_GRPC_WORKER_MODELS"] = str(settings.grpc_ports_per_replica)
        #: Trust mode: the probe tenant's key, which reads the front's /v1/models and /metrics (None: open mode).
        self.key: str | None = None
        if settings.secrets_dir is not None:
            secrets = DeploymentSecrets(settings.secrets_dir)
            # NOTE: no Redis runs beside a local fleet: the secrets' Redis URL is for compose's redis service.
            env.update(secrets.replica_environment(redis=False))
            self.key = secrets.read_key(secrets.probe_key)
        self.process = Child(name, argv, env, work_dir / f"{name}.log", cwd=REPO_ROOT)

    def start(self) -> None:
        self.process.start()

    def health(self) -> int:
        """The status of the front's ``/health`` (0: not answering)."""
        return http_status(f"{self.url}/health")

    def models(self) -> list[str]:
        return served_models(self.url, self.key)

    def requests_taken(self) -> int:
        """Generation requests the replica's front took so far (its ``warmup_front_requests_total``)."""
        return int(metric_sum(self._front_metrics(), "warmup_front_requests_total"))

    def in_flight(self) -> int:
        """Generation requests in flight through the replica's front now (0 when it does not answer)."""
        try:
            samples = self._front_metrics()
        except (OSError, ValueError):
            return 0
        return int(metric_sum(samples, "warmup_front_requests_in_flight"))

    def _front_metrics(self) -> dict[tuple[str, frozenset], float]:
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else None
        return scrape_metrics(f"{self.url}/metrics", prefix="warmup_front_requests", headers=headers)

    def wait_warm(self, timeout_s: float | None = None) -> None:
        try:
            wait_warm(self.url, timeout_s or self.settings.warm_timeout_s, gone=self.process.exited)
        except ServerError as exc:
            raise ServerError(f"replica {self.name}: {exc}; its output:\n{self.process.log_tail()}") from None

    def stop(self) -> bool:
        """SIGTERM: it drains (its /health fails, the requests in flight finish), tritonserver stops and its
        lora_adapter instances write their KV snapshots. Whether it exited by itself in ``stop_timeout_s``."""
        return self.process.stop(signal.SIGTERM, self.settings.stop_timeout_s + 60)

    def snapshots(self) -> dict[str, float]:
        """This replica's snapshot manifests in the shared folder: file name -> modification time."""
        if self.snapshot_dir is None or not self.snapshot_dir.is_dir():
            return {}
        # NOTE: a snapshot is named <instance>@<replica> made filename-safe (warmup_tools.kv.snapshot.snapshot_name:
        # the "@" becomes "_").
        return {p.name: p.stat().st_mtime for p in self.snapshot_dir.glob(f"*_{self.name}.manifest.json")}


def served_models(front_url: str, key: str | None = None) -> list[str]:
    """The models a front serves now (``GET /v1/models``): the base model and each live adapter. ``key``: a tenant
    key (a front in trust mode answers 401 without one)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(f"{front_url}/v1/models", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        return [str(m["id"]) for m in json.load(response)["data"]]


def wait_warm(front_url: str, timeout_s: float, gone: Callable[[], bool] = lambda: False) -> None:
    """Until the front's ``/health`` says 200; ServerError when ``gone()`` or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while http_status(f"{front_url}/health") != 200:
        if gone():
            raise ServerError("it exited before it was warm")
        if time.monotonic() > deadline:
            raise ServerError(f"{front_url} was not warm within {timeout_s:g} s")
        time.sleep(0.5)


def http_status(url: str, timeout_s: float = 5.0) -> int:
    """The HTTP status of ``GET url`` (0 when nothing answers)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return 0
