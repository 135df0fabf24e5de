"""The sidecar assembled: probes and repository client for one tritonserver, the monitor, the endpoints."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Mapping

from warmup_tools.common.errors import ConfigError, ServerError
from warmup_tools.common.names import replica_name as checked_replica_name
from warmup_tools.server.process import RepositoryKey, TritonServer
from warmup_tools.sidecar.canary.controller import CanaryController
from warmup_tools.sidecar.config import SidecarConfig
from warmup_tools.sidecar.coverage import CoverageReader
from warmup_tools.sidecar.endpoints import SidecarHttpServer
from warmup_tools.sidecar.monitor import Monitor
from warmup_tools.sidecar.plan_id import discover_plan_id
from warmup_tools.sidecar.probes import PROBED_MODELS, TritonProbes
from warmup_tools.sidecar.prune import StaleWriterPruner
from warmup_tools.sidecar.replan import Replanner
from warmup_tools.sidecar.repository import RepositoryClient
from warmup_tools.sidecar.stub_death import StubDeathFacts
from warmup_tools.sidecar.stubs import StubScanner

LOGGER = logging.getLogger(__name__)


class Sidecar:
    """Readiness and recovery for the tritonserver at ``http_url`` / ``grpc_url``.

    ``key`` is the per-run model-repository key the server was started with (without it, reloads get
    403 from a server that restricts the API, and the sidecar reports the failed reload)::

        with Sidecar(SidecarConfig(port=0), server.http_url, server.grpc_url, server.repository_key) as sidecar:
            ...  # GET sidecar.url + "/ready"
    """

    def __init__(self, config: SidecarConfig, http_url: str, grpc_url: str, key: RepositoryKey | None,
                 model_repository: Path | None = None, control_dir: Path | None = None,
                 server_pid: int | None = None, server: TritonServer | None = None, replica_name: str = "",
                 snapshot_dir: Path | None = None) -> None:
        """``control_dir``: the folder lora_adapter's instances report their warm coverage to (its
        ``control_dir`` parameter); with it, and ``coverage_threshold`` above 0, ``/ready`` checks coverage.
        ``server``: the tritonserver beside the sidecar (what ``warmup_tools sidecar`` runs): its stubs are
        watched in ``/proc``, one that exits or stops is reloaded at once, or the server is restarted
        (``on_stub_death``: see :mod:`warmup_tools.sidecar.stub_death`). ``server_pid`` instead: the stubs
        of the server with that process id are watched, and never restarted. ``replica_name``: this replica's
        name in the shared folders (default the host name). ``snapshot_dir``: lora_adapter's KV snapshot folder;
        what replicas gone for ``stale_writer_prune_s`` left there, in ``fleet_log_dir`` and in ``control_dir`` is
        removed (:mod:`warmup_tools.sidecar.prune`)."""
        unknown = sorted(set(config.models) - set(PROBED_MODELS))
        if unknown:
            raise ConfigError(f"no probe for model(s) {', '.join(unknown)}; known: {', '.join(PROBED_MODELS)}")
        host = checked_replica_name(replica_name)
        self.config = config
        self._probes = TritonProbes(grpc_url, config.probe_timeout_s, **_probe_credentials(os.environ, key))
        self._repository = RepositoryClient(http_url, key, config.recovery_timeout_s)
        coverage = (CoverageReader(Path(control_dir), config.coverage_threshold, config.coverage_stale_s, time.time,
                                   host=host)
                    if control_dir is not None and config.coverage_threshold > 0 else None)
        self._server = server
        self._facts = (StubDeathFacts(http_url, server.metrics_url, timeout_s=min(1.0, config.probe_timeout_s))
                       if server is not None else None)
        watched = (lambda: server.pid) if server is not None else server_pid
        self.monitor = Monitor(config, self._probes.probe, self._probes.server_ready, self._repository,
                               plan_id=discover_plan_id(model_repository) if model_repository else None,
                               coverage=coverage,
                               stub_faults=StubScanner(watched, config.models) if watched else None,
                               restart_server=self._restart_server if server is not None else None,
                               stub_death=self._facts,
                               progress=self._facts.output_tokens if self._facts is not None else None)
        self.replanner: Replanner | None = None
        self.canary: CanaryController | None = None
        log_dir = replica_log_dir(config, host)
        if control_dir is not None and log_dir is not None:
            # NOTE: a plan on trial is judged whoever started it (the re-plan below, or `plan canary`).
            self.canary = replica_canary(config, Path(control_dir), host)
            self.monitor.sections["canary"] = self.canary.status
        if config.replan_interval_s > 0:
            if control_dir is None or model_repository is None or self.canary is None or log_dir is None:
                raise ConfigError("the rolling re-plan needs the control folder and the model repository")
            from warmup_tools.planning.live import RollingPlanner

            canary = self.canary
            # NOTE: a fleet serves one plan.json: it is planned from every replica's logs, by one sidecar.
            planner = RollingPlanner(model_repository, control_dir, config.fleet_log_dir or log_dir,
                                     since_s=config.replan_since_h * 3600, history=canary.history,
                                     propose=lambda plan: canary.propose(plan, "sidecar re-plan") is not None,
                                     defer=lambda: "" if (first := canary.proposer()) == host else first)
            canary.on_promote = planner.write_stanzas_of
            self.replanner = Replanner(planner.run_once, config.replan_interval_s)
            self.monitor.sections["replan"] = self.replanner.status
        #: Removes what replicas that are gone left in the shared folders (:mod:`warmup_tools.sidecar.prune`).
        self.pruner: StaleWriterPruner | None = None
        if config.stale_writer_prune_s > 0 and (snapshot_dir, config.fleet_log_dir, control_dir) != (None,) * 3:
            self.pruner = StaleWriterPruner(host, config.stale_writer_prune_s, _PRUNE_EVERY_S,
                                            snapshot_dir=snapshot_dir, log_dir=config.fleet_log_dir,
                                            control_dir=control_dir)
        self._http = SidecarHttpServer(self.monitor, config.host, config.port, workers=config.http_workers,
                                       timeout_s=config.http_timeout_s)

    @property
    def url(self) -> str:
        return self._http.url

    def start(self) -> None:
        self._http.start()
        self.monitor.start()
        if self.replanner is not None:
            self.replanner.start()
        if self.canary is not None and self.config.canary_judge:
            self.canary.start(self.config.probe_interval_s)
        if self.pruner is not None:
            self.pruner.start()

    def unload_for_exit(self, model: str = "lora_adapter", timeout_s: float = 60.0) -> bool:
        """After a drain, before tritonserver stops: stop watching (a repair would load it again), then unload
        ``model`` so that its instances finalize while the server still runs (lora_adapter's write their KV
        snapshots), and the replica can say whether they did. NOTE: a model with a client stream still open
        on it is not unloaded (tritonserver 2.51 waits for it): the front closes its streams when their answer
        is complete. Whether the model was unloaded within ``timeout_s``."""
        if self.replanner is not None:
            self.replanner.stop()
        if self.canary is not None:
            self.canary.stop()
        self.monitor.stop()
        try:
            return self._repository.unload(model, timeout_s)
        except ServerError as exc:
            LOGGER.warning("unloading %s before the exit failed: %s", model, exc)
            return False

    def stop(self) -> None:
        if self.pruner is not None:
            self.pruner.stop()
        if self.replanner is not None:
            self.replanner.stop()
        if self.canary is not None:
            self.canary.stop()
        self.monitor.stop()
        self._http.stop()
        self._probes.close()
        self._repository.close()
        if self._facts is not None:
            self._facts.close()

    def _restart_server(self) -> None:
        """Restart tritonserver on the same ports and wait until it is ready (the monitor's restart)."""
        assert self._server is not None  # only handed to the monitor with a server
        self._server.restart(grace_s=self.config.restart_grace_s)
        self._server.wait_ready(timeout=self.config.recovery_timeout_s)

    def __enter__(self) -> "Sidecar":
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


#: How often a sidecar looks for what writers that are gone left in the shared folders.
_PRUNE_EVERY_S = 3600.0


def replica_canary(config: SidecarConfig, control_dir: Path, host: str,
                   clock: Callable[[], float] = time.time) -> CanaryController:
    """The canary controller of replica ``host``'s sidecar: its request logs (:func:`replica_log_dir`, which must
    be set), the fleet's when in one, the plan history's settings (``WARMUP_PLAN_HISTORY_KEEP``)."""
    from warmup_tools.common.settings import load_settings
    from warmup_tools.control.plan_history import PlanHistorySettings

    log_dir = replica_log_dir(config, host)
    if log_dir is None:
        raise ConfigError("the canary reads the request logs: set replan_log_dir or fleet_log_dir")
    return CanaryController(Path(control_dir), log_dir, config, host=host, history=load_settings(PlanHistorySettings),
                            stale_s=config.coverage_stale_s, clock=clock, fleet_log_dir=config.fleet_log_dir)


def replica_log_dir(config: SidecarConfig, replica: str) -> Path | None:
    """This replica's request logs (lora_adapter's ``request_log_dir``): ``replan_log_dir``, else in a fleet the
    subfolder of ``fleet_log_dir`` named after the replica; ConfigError when both are set and disagree."""
    if config.fleet_log_dir is None:
        return config.replan_log_dir
    mine = Path(config.fleet_log_dir) / replica
    if config.replan_log_dir is not None and Path(config.replan_log_dir) != mine:
        raise ConfigError(f"replan_log_dir {config.replan_log_dir} is not this replica's folder of fleet_log_dir "
                          f"({mine})")
    return mine


def _probe_credentials(environ: Mapping[str, str], key: RepositoryKey | None = None,
                       clock: Callable[[], float] = time.time) -> dict[str, Any]:
    """What proves the probe tenant, and a maker of fresh tokens for the later steps (tokens expire).

    Trust mode: the probe tenant's key (``WARMUP_PROBE_TENANT_KEY`` or the file
    ``WARMUP_PROBE_TENANT_KEY_FILE`` names, made with ``warmup_tools tenant-key
    warmup-sidecar-probe``) and tokens signed with the deployment secret the models read
    (``WARMUP_DEPLOYMENT_SECRET_FILE``). Open mode: the per-start probe secret of ``key``, which the
    server it belongs to hands its models (``WARMUP_PROBE_SECRET``); none without a key."""
    from warmup_tools.common.records import PROBE_TENANT
    from warmup_tools.triton.trust import probe_secret_token, probe_token, read_secret

    secret_file = environ.get("WARMUP_DEPLOYMENT_SECRET_FILE")
    if not secret_file:
        if key is None:
            return {}
        probe_secret = key.probe_secret()
        return {"tenant_key": probe_secret, "tenant_token": lambda: probe_secret_token(probe_secret, now=clock())}
    tenant_key = environ.get("WARMUP_PROBE_TENANT_KEY") or None
    if tenant_key is None and environ.get("WARMUP_PROBE_TENANT_KEY_FILE"):
        # NOTE: a file (a mounted Secret, the compose secrets volume) keeps the key out of the environment.
        try:
            tenant_key = Path(environ["WARMUP_PROBE_TENANT_KEY_FILE"]).read_text(encoding="utf-8").strip() or None
        except OSError as exc:
            raise ConfigError(f"WARMUP_PROBE_TENANT_KEY_FILE is not readable ({exc.strerror})") from None
    if tenant_key is None:
        return {}  # NOTE: the probes are refused, and /ready says so
    secret = read_secret(Path(secret_file))
    return {"tenant_key": tenant_key,
            "tenant_token": lambda: probe_token(secret, PROBE_TENANT, tenant_key, now=clock())}
