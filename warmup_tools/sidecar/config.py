"""Every setting of the sidecar, in one validated object (fed by a JSON file and flags: see the CLI)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from warmup_tools.common.errors import ConfigError

#: The models the demo repository serves, composing models first: the ensemble is probed last, so a
#: failure it shares with a composing model is already attributed when the ensemble's probe fails.
COMPOSING_MODELS: tuple[str, ...] = ("tokenizer_cache", "embedding_cache", "lora_adapter")
ENSEMBLE_MODEL = "ensemble"
#: ``on_stub_death`` values: restart tritonserver, or reload the model whose stub died.
STUB_DEATH_ACTIONS: tuple[str, ...] = ("restart", "reload")


@dataclasses.dataclass(frozen=True, slots=True)
class SidecarConfig:
    """How the sidecar probes, when it repairs a model, and where it answers Kubernetes probes."""

    #: Seconds between probe rounds (one probe of every model per round, on the background thread).
    probe_interval_s: float = 2.0
    #: Deadline of one probe request; a probe that takes longer counts as failed.
    probe_timeout_s: float = 5.0
    #: Seconds between looks at the Python backend stubs in ``/proc`` (beside tritonserver): a stub that
    #: exited or was stopped is reloaded at once, without waiting for a probe round. 0: probes only.
    stub_check_interval_s: float = 0.25
    #: What to do when the stub of a decoupled model (lora_adapter) exits or stops: ``restart`` tritonserver
    #: (every client's connection drops at once, so a request streaming on the dead stub fails at once
    #: instead of waiting for its client's deadline: Triton never answers it) or ``reload`` the model only
    #: (such a request waits for its client's deadline). A model that is not decoupled is always reloaded.
    #: See docs/faults.md.
    on_stub_death: str = "restart"
    #: On a restart: seconds tritonserver gets after SIGINT to finish the requests on healthy instances
    #: before its process group is killed (Triton's own stop waits for the request on the dead stub,
    #: which never ends). The clients of the dead stub wait this long for their error.
    restart_grace_s: float = 1.0
    #: Consecutive failed probes of one model after which it is reloaded even without a stub error.
    failures_to_recover: int = 3
    #: Deadline of one reload (unload, then load, which re-runs the model's model_warmup samples).
    recovery_timeout_s: float = 300.0
    #: First wait before retrying a reload that failed; doubles per failure up to ``max_backoff_s``.
    recovery_backoff_s: float = 5.0
    max_backoff_s: float = 60.0
    #: Where ``/ready``, ``/live`` and ``/status`` are served.
    host: str = "127.0.0.1"
    port: int = 8080
    #: Connections served at once (a fixed pool of threads; more wait in the listen backlog) and the
    #: deadline of each read and write on one: a half-sent request frees its worker after this long.
    http_workers: int = 8
    http_timeout_s: float = 5.0
    models: tuple[str, ...] = (*COMPOSING_MODELS, ENSEMBLE_MODEL)
    #: Warm coverage (needs the control folder lora_adapter reports to): ``/ready`` also wants every live
    #: adapter's planned hot set resident at this share or above on every instance; 0 turns the check off.
    coverage_threshold: float = 0.95
    #: A coverage report older than this is ignored (its instance is gone, or its stub died).
    coverage_stale_s: float = 30.0
    #: Rolling re-plan: every this many seconds, re-plan from the request logs under ``replan_log_dir``
    #: (lora_adapter's request_log_dir) of the last ``replan_since_h`` hours, apply it to the running
    #: server through the control folder and write the stanzas for the next start. 0: off.
    replan_interval_s: float = 0.0
    replan_log_dir: Path | None = None
    replan_since_h: float = 6.0

    def __post_init__(self) -> None:
        for name in ("probe_interval_s", "probe_timeout_s", "recovery_timeout_s", "recovery_backoff_s",
                     "max_backoff_s", "http_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be positive")
        if self.stub_check_interval_s < 0:
            raise ConfigError(f"stub_check_interval_s={self.stub_check_interval_s} must be >= 0 (0: off)")
        if self.on_stub_death not in STUB_DEATH_ACTIONS:
            raise ConfigError(f"on_stub_death must be one of {', '.join(STUB_DEATH_ACTIONS)}")
        if not 0 < self.restart_grace_s <= 60:
            raise ConfigError(f"restart_grace_s={self.restart_grace_s} must be above 0 and at most 60")
        if not 1 <= self.http_workers <= 256:
            raise ConfigError(f"http_workers={self.http_workers} must be 1 to 256")
        if self.failures_to_recover < 1:
            raise ConfigError(f"failures_to_recover={self.failures_to_recover} must be at least 1")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port={self.port} is not a TCP port")
        if not 0.0 <= self.coverage_threshold <= 1.0:
            raise ConfigError(f"coverage_threshold={self.coverage_threshold} must be a share in [0, 1]")
        if not self.coverage_stale_s > 0:
            raise ConfigError(f"coverage_stale_s={self.coverage_stale_s} must be positive")
        if self.replan_interval_s < 0 or not self.replan_since_h > 0:
            raise ConfigError(f"replan_interval_s={self.replan_interval_s} must be >= 0 (0: off) and "
                              f"replan_since_h={self.replan_since_h} positive")
        if self.replan_interval_s and self.replan_log_dir is None:
            raise ConfigError("replan_interval_s is set but replan_log_dir (the request logs) is not")
        if not self.models:
            raise ConfigError("models must name at least one model")
