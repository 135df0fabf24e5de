"""The sidecar's state machine: per-model health, readiness, and which model to repair. No I/O.

Each probe round feeds one :class:`ProbeResult` per model to :meth:`HealthTracker.record`. A model is

- ``unknown`` until its first probe,
- ``healthy`` after a probe that passed, or that proved the model alive without passing: answered ``busy``
  (saturation is not failure), or failed while the model went on generating tokens (it is serving:
  ``progressed``, from the scheduler's token counter on Triton's ``/metrics``),
- ``failing`` after a failed probe (not ready, but not yet worth a reload),
- ``unhealthy`` once a probe failed with Triton's stub error or ``failures_to_recover`` probes in a row
  failed (neither busy nor while the model generated tokens): :meth:`HealthTracker.to_recover` names it,
- ``recovering`` while the monitor reloads it, and ``recovery_failed`` (retried after a backoff) when
  the reload failed.

A restart of tritonserver (:meth:`HealthTracker.restart_started`) makes the server not ready until it is
back; then every model starts over as ``unknown`` until its next probe.

The sidecar is ready only when the server is ready and every model is ``healthy``: from the first failed
probe until the model is reloaded and its probes pass again, ``/ready`` answers 503 with the reason.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Sequence


class ModelState(str, enum.Enum):
    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    FAILING = "failing"
    UNHEALTHY = "unhealthy"
    RECOVERING = "recovering"
    RECOVERY_FAILED = "recovery_failed"


@dataclasses.dataclass(frozen=True, slots=True)
class ProbeResult:
    """One probe of one model: whether it answered, how fast, and Triton's error if not."""

    ok: bool
    latency_s: float
    at: float
    error: str = ""
    #: The server refused the probe's request itself (INVALID_ARG): the probe is wrong for this
    #: repository, so the model is not ready but a reload would not help.
    rejected: bool = False
    #: The model refused the probe for lack of room (``busy``, ``rate_limited``): it answered, so it is alive.
    busy: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class RecoveryResult:
    """One reload of one model (unload, then load)."""

    model: str
    ok: bool
    started_at: float
    duration_s: float
    error: str = ""


@dataclasses.dataclass(slots=True)
class ModelHealth:
    state: ModelState = ModelState.UNKNOWN
    consecutive_failures: int = 0
    last_probe: ProbeResult | None = None
    last_ok_at: float | None = None
    #: Why the model needs a reload (the stub error, or the failure count), kept until it is reloaded.
    recovery_reason: str = ""
    recoveries: int = 0
    failed_recoveries: int = 0
    #: Probes that did not pass but proved the model alive: answered busy, or failed while it generated tokens.
    busy_probes: int = 0
    stalled_probes: int = 0
    #: Reloads since a probe last passed; each one doubles the wait before the next (see ``retry_at``).
    reloads_without_success: int = 0
    retry_at: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class Readiness:
    ready: bool
    reason: str


# NOTE: Triton 2.51 answers every request to an instance whose Python backend stub died with
# "Stub process '<instance>' is not healthy." and never restarts the stub itself; its model and server
# readiness endpoints keep answering 200. Instances are named <model>_<group>_<index>.
_STUB_UNHEALTHY = re.compile(r"Stub process '([^']+)' is not healthy")


def unhealthy_stub_model(error: str, models: Sequence[str]) -> str | None:
    """The model whose stub ``error`` says died (longest model name the instance starts with), if any."""
    match = _STUB_UNHEALTHY.search(error)
    if match is None:
        return None
    instance = match.group(1)
    owners = [m for m in models if instance == m or instance.startswith(f"{m}_")]
    return max(owners, key=len) if owners else None


class HealthTracker:
    """Health of each model from its probes; decides readiness and what the monitor must reload."""

    def __init__(self, models: Sequence[str], failures_to_recover: int = 3, recovery_backoff_s: float = 5.0,
                 max_backoff_s: float = 60.0) -> None:
        self.models = tuple(models)
        self.failures_to_recover = failures_to_recover
        self.recovery_backoff_s = recovery_backoff_s
        self.max_backoff_s = max_backoff_s
        self.health: dict[str, ModelHealth] = {m: ModelHealth() for m in self.models}
        self.server_ready = False
        self.server_reason = "tritonserver not probed yet"
        self.last_recovery: RecoveryResult | None = None
        self.restarts = 0
        self.failed_restarts = 0
        self._restarting = ""

    # ----------------------------------------------------------------------------------- public API
    def record_server(self, ready: bool, reason: str = "") -> None:
        if self._restarting:
            return  # the restart decides when the server counts again
        self.server_ready = ready
        self.server_reason = "" if ready else (reason or "tritonserver is not ready")

    def restart_started(self, reason: str) -> None:
        """The monitor restarts tritonserver: not ready, whatever a probe says, until :meth:`restart_finished`."""
        self._restarting = reason
        self.server_ready = False
        self.server_reason = f"restarting tritonserver: {reason}"

    def restart_finished(self, result: RecoveryResult) -> None:
        """After a restart (``result.model`` names the server): every model unknown until probed again."""
        self._restarting = ""
        self.last_recovery = result
        if result.ok:
            self.restarts += 1
            self.server_reason = "tritonserver restarted, waiting for a probe round"
        else:
            self.failed_restarts += 1
            self.server_reason = f"restarting tritonserver failed: {result.error}"
        for model in self.models:
            old = self.health[model]
            self.health[model] = ModelHealth(recoveries=old.recoveries, failed_recoveries=old.failed_recoveries)

    def record(self, model: str, result: ProbeResult, progressed: bool = False) -> None:
        """Fold one probe of ``model`` into its state; ``progressed``: the model generated tokens since the last
        look (a failed probe of a model that is serving is not a failure, unless its stub died)."""
        health = self.health[model]
        health.last_probe = result
        if health.state is ModelState.RECOVERING:
            return  # the monitor's reload decides what comes next
        stub_died = not result.ok and unhealthy_stub_model(result.error, self.models) is not None
        # NOTE: saturation is not failure. A full instance answers busy, and a probe that times out behind a
        # flood while tokens still flow has met a model that serves: a reload would cost every request it holds
        # and fix nothing (issue 41: one tenant's burst reloaded every replica).
        alive = result.busy or (progressed and not result.rejected and not stub_died)
        if not result.ok and alive:
            if result.busy:
                health.busy_probes += 1
            else:
                health.stalled_probes += 1
            if health.state in (ModelState.UNHEALTHY, ModelState.RECOVERY_FAILED):
                return  # NOTE: a stub that died (another instance may still serve) is reloaded all the same
        if result.ok or alive:
            health.consecutive_failures = 0
            health.reloads_without_success = 0
            health.retry_at = 0.0
            health.last_ok_at = result.at
            health.state = ModelState.HEALTHY
            health.recovery_reason = ""
            return
        health.consecutive_failures += 1
        if result.rejected:
            # NOTE: never reload because of a bad probe: seen when a server began to refuse the probe's
            # tenant name, which reloaded every model in turn, over and over.
            if health.state not in (ModelState.UNHEALTHY, ModelState.RECOVERY_FAILED):
                health.state = ModelState.FAILING
            return
        owner = unhealthy_stub_model(result.error, self.models)
        if owner is not None and owner != model:
            # A stub error seen through another model (the ensemble) marks the model that owns the stub.
            self._mark_unhealthy(owner, result.error)
            if health.state is not ModelState.UNHEALTHY:
                health.state = ModelState.FAILING
        elif owner == model:
            self._mark_unhealthy(model, result.error)
        elif health.consecutive_failures >= self.failures_to_recover:
            self._mark_unhealthy(model, f"{health.consecutive_failures} probes failed in a row: {result.error}")
        elif health.state not in (ModelState.UNHEALTHY, ModelState.RECOVERY_FAILED):
            health.state = ModelState.FAILING

    def record_stub_fault(self, model: str, reason: str) -> None:
        """The sidecar saw ``model``'s stub exit or stop: reload it (unless a reload is under way)."""
        health = self.health[model]
        if health.state is ModelState.RECOVERING:
            return
        health.consecutive_failures += 1
        self._mark_unhealthy(model, reason)

    def to_recover(self, now: float) -> list[str]:
        """Models to reload now, in probe order (composing models before the ensemble)."""
        due = []
        for model in self.models:
            health = self.health[model]
            if health.state in (ModelState.UNHEALTHY, ModelState.RECOVERY_FAILED) and now >= health.retry_at:
                due.append(model)
        return due

    def recovery_started(self, model: str) -> None:
        self.health[model].state = ModelState.RECOVERING

    def recovery_finished(self, result: RecoveryResult) -> None:
        """After a reload: ``failing`` until a probe passes (readiness waits for that), or a retry later."""
        health = self.health[result.model]
        self.last_recovery = result
        health.consecutive_failures = 0
        # NOTE: a model that is reloaded but never passes a probe (a load that succeeds into a model that
        # still fails, an overloaded server timing probes out) waits longer before each further reload,
        # as a failed reload does, so the sidecar never reloads it in a tight loop.
        health.reloads_without_success += 1
        backoff = min(self.max_backoff_s, self.recovery_backoff_s * 2 ** (health.reloads_without_success - 1))
        health.retry_at = result.started_at + result.duration_s + backoff
        if result.ok:
            health.recoveries += 1
            health.state = ModelState.FAILING
            health.recovery_reason = f"reloaded in {result.duration_s:.1f}s, waiting for a probe to pass"
        else:
            health.failed_recoveries += 1
            health.state = ModelState.RECOVERY_FAILED
            health.recovery_reason = f"reload failed: {result.error}"

    def readiness(self) -> Readiness:
        if not self.server_ready:
            return Readiness(False, self.server_reason)
        reasons = [self._reason(m) for m in self.models if self.health[m].state is not ModelState.HEALTHY]
        return Readiness(not reasons, "; ".join(reasons))

    def snapshot(self) -> dict[str, object]:
        """What ``/status`` shows (JSON-ready)."""
        readiness = self.readiness()
        return {
            "ready": readiness.ready,
            "reason": readiness.reason,
            "server_ready": self.server_ready,
            "models": {m: _health_json(h) for m, h in self.health.items()},
            "last_recovery": dataclasses.asdict(self.last_recovery) if self.last_recovery else None,
            "restarts": self.restarts,
            "failed_restarts": self.failed_restarts,
        }

    # ------------------------------------------------------------------------------------- helpers
    def _mark_unhealthy(self, model: str, reason: str) -> None:
        health = self.health[model]
        if health.state in (ModelState.UNHEALTHY, ModelState.RECOVERING, ModelState.RECOVERY_FAILED):
            return  # keeps the first reason
        health.state = ModelState.UNHEALTHY
        health.recovery_reason = reason

    def _reason(self, model: str) -> str:
        health = self.health[model]
        if health.state is ModelState.UNKNOWN:
            return f"{model}: not probed yet"
        detail = health.recovery_reason or (health.last_probe.error if health.last_probe else "")
        return f"{model}: {health.state.value}" + (f" ({detail})" if detail else "")


def _health_json(health: ModelHealth) -> dict[str, object]:
    probe = health.last_probe
    return {
        "state": health.state.value,
        "consecutive_failures": health.consecutive_failures,
        "last_probe": None if probe is None else {
            "ok": probe.ok, "latency_ms": round(probe.latency_s * 1000, 1), "at": probe.at, "error": probe.error},
        "last_ok_at": health.last_ok_at,
        "recovery_reason": health.recovery_reason,
        "recoveries": health.recoveries,
        "failed_recoveries": health.failed_recoveries,
        "busy_probes": health.busy_probes,
        "stalled_probes": health.stalled_probes,
    }
