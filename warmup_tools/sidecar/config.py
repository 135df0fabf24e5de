"""Every setting of the sidecar, in one validated object (a JSON file, ``WARMUP_SIDECAR_<FIELD>`` variables and
flags: :func:`warmup_tools.common.settings.load_settings`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

from warmup_tools.common.errors import ConfigError
from warmup_tools.common.settings import check_settings, setting

#: The models the demo repository serves, composing models first: the ensemble is probed last, so a
#: failure it shares with a composing model is already attributed when the ensemble's probe fails.
COMPOSING_MODELS: tuple[str, ...] = ("tokenizer_cache", "embedding_cache", "lora_adapter")
ENSEMBLE_MODEL = "ensemble"
#: ``on_stub_death`` values: restart tritonserver, or reload the model whose stub died.
STUB_DEATH_ACTIONS: tuple[str, ...] = ("restart", "reload")
#: The shortest ``stale_writer_prune_s`` (but 0): a live replica writes its files more often than this.
MIN_STALE_WRITER_PRUNE_S = 3600.0


@dataclasses.dataclass(frozen=True, slots=True)
class SidecarConfig:
    """How the sidecar probes, when it repairs a model, and where it answers Kubernetes probes (the keys of
    ``--sidecar-config``'s JSON file; flags override them)."""

    section: ClassVar[str] = "SIDECAR"

    probe_interval_s: float = setting(2.0, "Seconds between probe rounds (one probe of every model per round, on "
                                           "the background thread).", gt=0)
    probe_timeout_s: float = setting(5.0, "Deadline of one probe request; a probe that takes longer counts as "
                                          "failed.", gt=0)
    stub_check_interval_s: float = setting(0.25, "Seconds between looks at the Python backend stubs in /proc: a "
                                                 "stub that exited or was stopped is repaired at once, without "
                                                 "waiting for a probe round; 0: probes only.", ge=0)
    on_stub_death: str = setting("restart", "When the stub of a decoupled model (lora_adapter) exits or stops: "
                                            "restart tritonserver (a request streaming on the dead stub fails at "
                                            "once) or reload the model only (such a request waits for its "
                                            "client's deadline); docs/faults.md.", choices=STUB_DEATH_ACTIONS)
    restart_grace_s: float = setting(1.0, "On a restart: seconds tritonserver gets after SIGINT to finish the "
                                          "requests on healthy instances before its process group is killed.",
                                     gt=0, le=60)
    failures_to_recover: int = setting(3, "Consecutive failed probes of one model after which it is reloaded "
                                          "even without a stub error.", ge=1)
    recovery_timeout_s: float = setting(300.0, "Deadline of one reload (unload, then load, which re-runs the "
                                               "model's model_warmup samples).", gt=0)
    recovery_backoff_s: float = setting(5.0, "First wait before retrying a reload that failed; doubles per "
                                             "failure up to max_backoff_s.", gt=0)
    max_backoff_s: float = setting(60.0, "The longest wait between two reload attempts.", gt=0)
    host: str = setting("127.0.0.1", "Address /ready, /live, /status and /metrics are served on.",
                        flag="sidecar-host")
    port: int = setting(8080, "Port of /ready, /live, /status and /metrics (0: any free port).", ge=0, le=65535,
                      flag="sidecar-port")
    http_workers: int = setting(8, "Connections served at once (a fixed pool of threads; more wait in the "
                                   "listen backlog).", ge=1, le=256)
    http_timeout_s: float = setting(5.0, "Deadline of each read and write on one connection: a half-sent "
                                         "request frees its worker after this long.", gt=0)
    models: tuple[str, ...] = setting((*COMPOSING_MODELS, ENSEMBLE_MODEL), "Models probed, in order (the "
                                                                         "ensemble last).")
    coverage_threshold: float = setting(0.95, "Warm coverage: /ready also wants every live adapter's planned hot "
                                              "set resident at this share or above on every instance; 0 turns "
                                              "the check off.", ge=0, le=1)
    coverage_stale_s: float = setting(30.0, "A coverage report older than this is ignored (its instance is gone, "
                                            "or its stub died).", gt=0)
    hot_coverage: float = setting(1.0, "Service temperature: a replica or adapter is hot (not merely warm) when its "
                                       "planned hot set is resident at this share or above on every instance "
                                       "(and its probe TTFT is within hot_probe_ttft_s); docs/sidecar.md.",
                                  ge=0, le=1)
    hot_probe_ttft_s: float = setting(0.25, "Service temperature: the longest lora_adapter probe (one token) a hot "
                                            "replica answers in; docs/sidecar.md for the measurement behind it.",
                                      gt=0)
    temperature_confirm_rounds: int = setting(3, "Probe rounds in a row that must read hot (or warm) before a "
                                                 "replica or adapter moves between warm and hot; cold follows "
                                                 "readiness at once.", ge=1, le=100)
    replan_interval_s: float = setting(0.0, "Rolling re-plan: every this many seconds, re-plan from the request "
                                            "logs, apply the plan to the running server and write the stanzas "
                                            "for the next start; 0: off.", ge=0)
    replan_log_dir: Path | None = setting(None, "The request logs the rolling re-plan and the canary read "
                                                "(lora_adapter's request_log_dir).")
    fleet_log_dir: Path | None = setting(None, "A fleet's request log folder, shared by every replica: each "
                                               "replica's lora_adapter logs into the subfolder named after its "
                                               "replica_name (else its host name), which is then this sidecar's "
                                               "replan_log_dir; the rolling re-plan reads every subfolder, and a "
                                               "plan on trial on a whole replica is judged against the other "
                                               "replicas' logs; empty: no fleet.")
    replan_since_h: float = setting(6.0, "Hours of request logs each re-plan reads.", gt=0)
    stale_writer_prune_s: float = setting(7 * 86400.0, "Seconds after which what another replica left in the "
                                                       "shared folders is removed, when it wrote nothing there and "
                                                       "reported nothing on the control folder's plan status board "
                                                       "for as long (a replica gone for good): its KV snapshot "
                                                       "files, its request-log folder (fleet_log_dir) and its plan "
                                                       "status files. Every sidecar looks once an hour and never "
                                                       "removes its own replica's files. 0: never; else at least "
                                                       f"{MIN_STALE_WRITER_PRUNE_S:g}, and more than lora_adapter's "
                                                       "snapshot_interval_s.", ge=0)
    canary_window_s: float = setting(600.0, "Canary: seconds a plan on trial is compared with the plan the other "
                                            "instances serve before it is promoted (a worse plan is rolled back "
                                            "as soon as it is seen worse); 0: the rolling re-plan applies its "
                                            "plans to every instance at once.", ge=0)
    canary_fleet_share: float = setting(0.5, "Canary: in a fleet, the most of its replicas a plan on trial runs on "
                                             "(never all). The proposing replica takes the busiest others of "
                                             "the last canary_window_s until they served four "
                                             "times canary_min_requests, so that a large fleet's trial sees enough "
                                             "traffic to be judged; 0: one replica.", ge=0, le=1)
    canary_min_requests: int = setting(5, "Canary: requests each side (the canary instance, the others) must "
                                           "have served before anything is judged; on a whole replica of a "
                                           "fleet, the early tests start when the canary replica has them and "
                                           "the other replicas one (promotion needs them on each side).", ge=1)
    canary_tenant_cap: int = setting(1000, "Canary: the most requests one tenant counts for in a comparison (the "
                                           "canary and the others; on a whole replica, a side's trial and its "
                                           "baseline), and the TTFT samples kept of each tenant per window; a "
                                           "tenant counts as many requests as it has in the smaller of the two "
                                           "windows, up to this and canary_min_tenants' bound "
                                           "(docs/planner.md).", ge=1, le=100_000)
    canary_min_tenants: int = setting(3, "Canary: no tenant counts for more requests than the canary_min_tenants-"
                                         "th busiest of the tenants seen in both windows of a comparison, so that "
                                         "once this many count none carries more than that share of a verdict; a "
                                         "trial on a whole replica also waits until this many of the tenants "
                                         "each side served in its baseline (all, when fewer) are back on that "
                                         "side.", ge=1, le=1000)
    canary_cold_margin: float = setting(0.05, "Canary: the cold share (requests with no cached prompt token) "
                                              "may exceed the other instances' by this much.", ge=0, le=1)
    canary_cached_margin: float = setting(0.10, "Canary: the share of prompt tokens from the KV cache may fall "
                                                "this much below the other instances'.", ge=0, le=1)
    canary_ttft_ratio: float = setting(1.5, "Canary: TTFT p99 may be this many times the other instances' "
                                            "(compared once each side has 100 requests).", ge=1)
    canary_alpha: float = setting(0.01, "Canary: the cold share or the cached tokens count as worse before the "
                                        "window ends only when a one-sided z-test (on the tenants' weighted "
                                        "cold shares, and on each request's uncached share) puts the difference "
                                        "below this level (strict: the tests are repeated as requests come).",
                                  gt=0, le=1)
    canary_judge: bool = setting(True, "Canary: this sidecar judges a plan on trial on its replica (promotes or "
                                       "rolls it back); false: it never ends a trial, something else judges it "
                                       "(`bench rollout --fleet` drives the verdict itself, on the replay's "
                                       "clock).")

    def __post_init__(self) -> None:
        check_settings(self)
        if self.replan_interval_s and self.replan_log_dir is None and self.fleet_log_dir is None:
            raise ConfigError("replan_interval_s is set but neither replan_log_dir nor fleet_log_dir (the request "
                              "logs) is")
        if not self.models:
            raise ConfigError("models must name at least one model")
        if 0 < self.stale_writer_prune_s < MIN_STALE_WRITER_PRUNE_S:
            raise ConfigError(f"stale_writer_prune_s must be 0 (never) or at least {MIN_STALE_WRITER_PRUNE_S:g} "
                              "seconds: a live replica's files are not rewritten every second")
