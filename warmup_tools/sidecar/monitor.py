"""The background thread: probe every model at an interval, repair unhealthy ones, publish readiness.

HTTP handlers never probe: they read the last round's state (:meth:`Monitor.readiness`,
:meth:`Monitor.snapshot`), so a burst of Kubernetes probes costs Triton nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, Mapping, Protocol

from warmup_tools.common.errors import WarmupToolsError
from warmup_tools.sidecar.background import BackgroundThread
from warmup_tools.sidecar.config import ENSEMBLE_MODEL, SidecarConfig
from warmup_tools.sidecar.coverage import NOT_CHECKED, CoverageVerdict
from warmup_tools.sidecar.health import HealthTracker, ProbeResult, Readiness, RecoveryResult
from warmup_tools.sidecar.stub_death import RESTART, Decision, decide
from warmup_tools.sidecar.temperature import REPLICA, Reading, TemperatureTracker, Thresholds, replica_reading

if TYPE_CHECKING:
    from warmup_tools.sidecar.stubs import StubFault

LOGGER = logging.getLogger(__name__)


class Repository(Protocol):
    """What the monitor needs from Triton's model-repository API (:class:`RepositoryClient`)."""

    def reload(self, model: str, timeout_s: float | None = None) -> None: ...

    def ensure_loaded(self, model: str, timeout_s: float | None = None) -> bool: ...


class StubDeathFacts(Protocol):
    """What the restart decision reads from the server (:class:`~warmup_tools.sidecar.stub_death.StubDeathFacts`)."""

    def decoupled(self, model: str) -> bool | None: ...

    def in_flight(self, model: str, instance: str) -> int | None: ...


#: The name a restart of tritonserver has in ``last_recovery``.
SERVER = "tritonserver"
#: Whose probe latency is the replica's probe TTFT (a one-token generation), the first one probed.
TTFT_PROBE_MODELS = ("lora_adapter", ENSEMBLE_MODEL)
#: Whose generated tokens prove a model serving, for the models that generate (the ensemble's last step generates).
PROGRESS_OF = {"lora_adapter": "lora_adapter", ENSEMBLE_MODEL: "lora_adapter"}


class Monitor:
    """Owns a :class:`HealthTracker`; :meth:`run_once` is one probe round (tests call it directly)."""

    def __init__(
        self,
        config: SidecarConfig,
        probe: Callable[[str], ProbeResult],
        server_ready: Callable[[], tuple[bool, str]],
        repository: Repository,
        *,
        plan_id: str | None = None,
        coverage: Callable[[frozenset[str]], CoverageVerdict] | None = None,
        stub_faults: Callable[[], dict[str, StubFault]] | None = None,
        restart_server: Callable[[], None] | None = None,
        stub_death: StubDeathFacts | None = None,
        progress: Callable[[], Mapping[str, float] | None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``coverage`` (a :class:`~warmup_tools.sidecar.coverage.CoverageReader`) is asked once per round
        whether the planned hot sets are resident; None: warm coverage is not part of readiness.
        ``stub_faults`` (a :class:`~warmup_tools.sidecar.stubs.StubScanner`) names the models whose stub
        exited or stopped; it is asked every ``stub_check_interval_s`` between rounds, and a fault starts
        a round at once, which reloads the model before any probe.
        ``restart_server`` restarts tritonserver and returns once it is ready (raises a WarmupToolsError when
        it is not); with it and ``on_stub_death`` restart, a dead stub of a decoupled model
        (``stub_death`` tells) restarts the server instead of reloading the model.
        ``progress`` (:meth:`StubDeathFacts.output_tokens`) gives the tokens each model generated so far; read
        once per round, after the probes: a probe that failed while its model's count rose since the last
        round is no failure (:data:`PROGRESS_OF`; a model still producing tokens is never reloaded for it)."""
        self.config = config
        self.plan_id = plan_id
        self._coverage = coverage
        self._verdict = NOT_CHECKED if coverage is None else CoverageVerdict(
            False, "warm coverage not read yet", {"checked": True})
        #: More sections of ``/status`` (name: a function of no arguments giving JSON-ready data).
        self.sections: dict[str, Callable[[], object]] = {}
        #: lora_adapter instances that met the coverage threshold (forgotten when the model is reloaded).
        self._covered: frozenset[str] = frozenset()
        self._probe = probe
        self._stub_faults = stub_faults if config.stub_check_interval_s > 0 else None
        #: Faults seen between rounds, for the next round to act on.
        self._pending_faults: dict[str, StubFault] = {}
        self._restart_server = restart_server
        self._stub_death = stub_death
        self._server_ready = server_ready
        self._progress = progress
        #: The tokens each model had generated at the last round's look.
        self._tokens: Mapping[str, float] | None = None
        self._repository = repository
        self._clock = clock
        self._tracker = HealthTracker(config.models, config.failures_to_recover, config.recovery_backoff_s,
                                      config.max_backoff_s)
        self._lock = threading.Lock()
        self._worker = BackgroundThread("sidecar-monitor")
        self._rounds = 0
        self._was_ready = False
        self._shortfalls_logged: set[tuple[str, ...]] = set()
        self._temperature = TemperatureTracker(Thresholds(config.hot_coverage, config.hot_probe_ttft_s,
                                                          config.temperature_confirm_rounds))

    # ----------------------------------------------------------------------------------- public API
    def start(self) -> None:
        self._worker.start(self._loop)

    def stop(self, timeout: float = 30.0) -> None:
        self._worker.stop(timeout)

    def run_once(self) -> None:
        """Probe the server and every model once, then reload the models that need it."""
        ready, reason = self._server_ready()
        with self._lock:
            self._tracker.record_server(ready, reason)
        faults = self._scan_stubs() if ready else {}
        decision = self._restart_decision(faults)
        if decision is not None:
            self._restart(decision.reason)
        elif ready:
            with self._lock:
                for model, fault in faults.items():
                    self._tracker.record_stub_fault(model, fault.reason)
            # NOTE: with a dead stub known, reload first: a probe of it, and of the ensemble, would only spend
            # a second each finding out what the scan already said, while requests wait for the reload.
            results = [(model, self._probe(model)) for model in (() if faults else self.config.models)]
            progressed = self._progressed()
            with self._lock:
                for model, result in results:
                    self._tracker.record(model, result, progressed=PROGRESS_OF.get(model) in progressed)
            with self._lock:
                self._log_transition(self._readiness())
                due = self._tracker.to_recover(self._clock())
            for model in due:
                self._recover(model)
        if self._coverage is not None:
            verdict = self._coverage(self._covered)
            with self._lock:
                self._verdict = verdict
                self._covered = self._covered | verdict.covered
        with self._lock:
            self._rounds += 1
            self._log_transition(self._readiness())
            for change in self._temperature.observe(self._temperature_readings()):
                LOGGER.info("temperature of %s: %s -> %s (%s)", change.label, change.old.value, change.new.value,
                            change.why)

    def readiness(self) -> Readiness:
        with self._lock:
            return self._readiness()

    def temperature(self) -> tuple[str, dict[str, str]]:
        """The replica's temperature and each adapter's (``cold``, ``warm``, ``hot``), as of the last round."""
        with self._lock:
            return (self._temperature.state().value,
                    {name: state.value for name, state in self._temperature.adapters().items()})

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            status = self._tracker.snapshot()
            readiness = self._readiness()
            status["ready"], status["reason"] = readiness.ready, readiness.reason
            status["coverage"] = self._verdict.status
            status["temperature"] = self._temperature.snapshot()
            status["rounds"] = self._rounds
        status["probe_interval_s"] = self.config.probe_interval_s
        status["plan_id"] = self.plan_id
        for name, section in self.sections.items():
            status[name] = section()
        return status

    # ------------------------------------------------------------------------------------- helpers
    def _readiness(self) -> Readiness:
        """The models' readiness, then warm coverage (call with the lock held)."""
        readiness = self._tracker.readiness()
        if readiness.ready and not self._verdict.ready:
            return Readiness(False, f"warm coverage: {self._verdict.reason}")
        return readiness

    def _temperature_readings(self) -> dict[str, Reading]:
        """This round's reading of the replica and of each adapter a fresh coverage report names (call with
        the lock held): serving is readiness (and, for an adapter, live on every instance that reports it),
        the resident share the lowest over instances, the probe TTFT the last passing probe's latency."""
        ready = self._readiness().ready
        ttft = next((probe.latency_s for model in TTFT_PROBE_MODELS if model in self._tracker.health
                     for probe in [self._tracker.health[model].last_probe] if probe is not None and probe.ok), None)
        shares: dict[str, list[float]] = {}
        live: dict[str, bool] = {}
        for entry in dict(self._verdict.status.get("instances") or {}).values():
            if entry["stale"]:
                continue
            for adapter, cov in entry["adapters"].items():
                shares.setdefault(adapter, []).append(cov["coverage"])
                live[adapter] = live.get(adapter, True) and bool(cov["live"])
        readings = {name: Reading(ready and live[name], min(values), ttft) for name, values in shares.items()}
        readings[REPLICA] = replica_reading(ready, (min(v) for n, v in shares.items() if live[n]), ttft)
        return readings

    def _loop(self) -> None:
        while not self._worker.stopping.is_set():
            started = time.monotonic()
            try:
                self.run_once()
            except Exception as exc:
                # NOTE: a bug in one round must not stop the thread (readiness would freeze at its last
                # value); the round reports not ready and the next one starts on time.
                LOGGER.exception("probe round failed")
                with self._lock:
                    self._tracker.record_server(False, f"sidecar probe round failed: {exc!r}")
            self._wait_for_next_round(started + self.config.probe_interval_s)

    def _wait_for_next_round(self, deadline: float) -> None:
        """Until ``deadline`` (monotonic) or a stop; earlier when a stub exited or stopped."""
        while (left := deadline - time.monotonic()) > 0:
            if self._stub_faults is None:
                self._worker.stopping.wait(left)
                return
            if self._worker.stopping.wait(min(left, self.config.stub_check_interval_s)) or self._new_stub_fault():
                return

    def _restart_decision(self, faults: dict[str, StubFault]) -> Decision | None:
        """A restart of tritonserver when one of the dead stubs calls for it (see stub_death), else None."""
        if self._restart_server is None or self.config.on_stub_death != RESTART:
            return None
        for model, fault in faults.items():
            decoupled = self._stub_death.decoupled(model) if self._stub_death else None
            in_flight = (self._stub_death.in_flight(model, fault.instance)
                         if self._stub_death and decoupled is not False else None)
            decision = decide(self.config.on_stub_death, model, decoupled, in_flight)
            LOGGER.warning("%s: %s; %s (%s)", model, fault.reason, decision.action, decision.reason)
            if decision.action == RESTART:
                return Decision(RESTART, f"{model}: {fault.reason}; {decision.reason}")
        return None

    def _restart(self, reason: str) -> None:
        """Restart tritonserver; ``/ready`` answers 503 from now until a probe round passes after it."""
        if self._restart_server is None:
            return
        with self._lock:
            self._tracker.restart_started(reason)
            self._log_transition(self._readiness())
        LOGGER.warning("restarting tritonserver: %s", reason)
        started_at, start = self._clock(), time.monotonic()
        error = ""
        try:
            self._restart_server()
        except (WarmupToolsError, OSError) as exc:  # NOTE: OSError: the new process could not be spawned
            error = str(exc) or type(exc).__name__
        result = RecoveryResult(SERVER, not error, started_at, time.monotonic() - start, error)
        if result.ok:
            LOGGER.info("restarted tritonserver in %.1fs", result.duration_s)
        else:
            LOGGER.error("restarting tritonserver failed after %.1fs: %s", result.duration_s, error)
        with self._lock:
            self._tracker.restart_finished(result)
            self._covered = frozenset()  # every instance starts again
        self._pending_faults = {}  # the old server's stubs are gone with it

    def _progressed(self) -> frozenset[str]:
        """The models whose generated tokens rose since the last round's look (one read of /metrics, the next
        round's baseline)."""
        if self._progress is None:
            return frozenset()
        try:
            tokens = self._progress()
        except Exception:  # NOTE: no reading is no evidence, never a failed round
            LOGGER.warning("cannot read the models' generated tokens", exc_info=True)
            tokens = None
        before, self._tokens = self._tokens, tokens
        if tokens is None or before is None:
            return frozenset()
        return frozenset(m for m, n in tokens.items() if n > before.get(m, 0.0))

    def _scan_stubs(self) -> dict[str, StubFault]:
        """Faults seen since the last call (each dead stub is reported once: see StubScanner)."""
        if self._stub_faults is None:
            return {}
        faults, self._pending_faults = dict(self._pending_faults), {}
        try:
            faults.update(self._stub_faults())
        except OSError as exc:  # NOTE: /proc unreadable: the probes still find a dead stub, only later
            LOGGER.warning("cannot look at the Python backend stubs: %s", exc)
        return {m: f for m, f in faults.items() if m in self._tracker.health}

    def _new_stub_fault(self) -> bool:
        """Whether a stub exited or stopped since the last look (kept for the next round)."""
        self._pending_faults = self._scan_stubs()
        return bool(self._pending_faults)

    def _recover(self, model: str) -> None:
        with self._lock:
            reason = self._tracker.health[model].recovery_reason
            self._tracker.recovery_started(model)
        LOGGER.warning("reloading %s: %s", model, reason)
        started_at, start = self._clock(), time.monotonic()
        error = ""
        try:
            self._repository.reload(model, timeout_s=self.config.recovery_timeout_s)
            if model != ENSEMBLE_MODEL and ENSEMBLE_MODEL in self.config.models:
                # NOTE: unloading a composing model can take the ensemble with it; load it back if so.
                if self._repository.ensure_loaded(ENSEMBLE_MODEL, timeout_s=self.config.recovery_timeout_s):
                    LOGGER.info("loaded %s again after reloading %s", ENSEMBLE_MODEL, model)
        except WarmupToolsError as exc:
            error = str(exc)
        result = RecoveryResult(model, not error, started_at, time.monotonic() - start, error)
        if result.ok:
            LOGGER.info("reloaded %s in %.1fs", model, result.duration_s)
        else:
            LOGGER.error("reloading %s failed after %.1fs: %s", model, result.duration_s, error)
        with self._lock:
            self._tracker.recovery_finished(result)
            if model == "lora_adapter":
                self._covered = frozenset()  # its instances start again: they must reach the threshold again

    def _log_transition(self, readiness: Readiness) -> None:
        if readiness.ready != self._was_ready:
            if readiness.ready:
                LOGGER.info("ready")
            else:
                LOGGER.warning("not ready: %s", readiness.reason)
            self._was_ready = readiness.ready
        # NOTE: a plan the budget cannot hold keeps the pod unready; say why once per instance and adapter,
        # even when the pod was already unready for another reason.
        for instance, entry in dict(self._verdict.status.get("instances") or {}).items():
            for adapter, cov in entry["adapters"].items():
                key = (instance, adapter, entry["plan_id"], cov["shortfall"])
                if cov["shortfall"] and key not in self._shortfalls_logged:
                    self._shortfalls_logged.add(key)
                    LOGGER.warning("%s/%s: plan %s: %s", instance, adapter, entry["plan_id"], cov["shortfall"])
