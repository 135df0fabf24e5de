"""What each operations command takes beyond the processes' settings: one frozen class per command (or per set
of commands that take the same), each field declared once with :func:`~warmup_tools.common.settings.setting`.

The command line derives each field's flag, type, bound and help from it
(:func:`warmup_tools.common.flags.add_options`), and the command reads the values back through the class
(:func:`~warmup_tools.common.flags.options_from_args`), so a default lives here and nowhere else. Unlike the
processes' settings these have no JSON file and no environment variable: they say what one invocation does.
Where a command also needs the server's folders (``--model-repository``, ``--control-dir``, ``--assets-dir``) it
takes those fields of :class:`~warmup_tools.server.config.ServeConfig` (their ``WARMUP_<FIELD>`` variables
included). ``docs/parameters.md`` lists every class here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from warmup_tools.common.settings import check_settings, parse_duration, setting
from warmup_tools.demo.assets import DEFAULT_SEED
from warmup_tools.server.config import REPO_ROOT, ServeConfig
from warmup_tools.sim.traffic import TrafficConfig

_SERVED = ServeConfig()
_GENERATED = TrafficConfig()


class _Checked:
    __slots__ = ()

    def __post_init__(self) -> None:
        check_settings(self)


@dataclasses.dataclass(frozen=True, slots=True)
class MakePlanOptions(_Checked):
    """``plan LOGS...``: what the plan is sized by and where it is written (with ``--model-repository``)."""

    out: Path = setting(REPO_ROOT / "runs" / "plan.json", "Where the plan is written.")
    kv_bytes_total: int | None = setting(None, "KV bytes per instance the plan may fill; empty: lora_adapter's "
                                               "kv_cache_bytes less kv_live_reserve.", ge=0)
    kv_bytes_per_adapter: int | None = setting(None, "An upper bound per adapter; empty: --kv-bytes-total "
                                                     "(--arbitration splits the total).", ge=0)
    arbitration: str | None = setting(None, "When the adapters' hot sets do not all fit: split the budget by each "
                                            "adapter's cold share and traffic (measured, the default), or let every "
                                            "adapter take up to --kv-bytes-per-adapter, hottest blocks first "
                                            "(fixed); docs/planner.md.", choices=("measured", "fixed"))
    replicas: int = setting(1, "Replicas that each warm this plan behind a prefix-affine router (smg cache_aware): "
                               "the warm set is sized by replaying one replica's share of the log's tail "
                               "(docs/planner.md).", ge=1)
    embedding_entries: int | None = setting(None, "Prompt embeddings to pre-compute; empty: the plan's.", ge=0)
    tokenizer_entries: int | None = setting(None, "Texts to register with the tokenizer cache; empty: the plan's.",
                                            ge=0)
    warm_seconds: float | None = setting(None, "Time the KV warm-up may take; empty: the plan's.", ge=0)
    now: float | None = setting(None, "Epoch seconds the heat decays to; empty: the last record.")
    since: float | None = setting(None, "Plan from the last DURATION of the logs only (before --now, or the last "
                                         "record): 30m, 6h, 2d.", parse=parse_duration, kind="duration", gt=0)
    previous: Path | None = setting(None, "The plan now served: its items are kept unless clearly beaten (no "
                                          "flapping), and the new plan says what it added, kept and dropped.")
    progress: bool = setting(True, "Show the planner's progress bars.")


@dataclasses.dataclass(frozen=True, slots=True)
class LiveApplyOptions(_Checked):
    """``apply-plan`` and ``plan rollback``: the stanzas, the wait (with ``--history-keep``)."""

    stanzas: bool = setting(False, "Also write the plan's model_warmup stanzas, so the next start begins from it.")
    wait: float = setting(600.0, "Seconds to wait for the instances (0: don't).", ge=0)
    instances: int | None = setting(None, "How many instances must report; empty: all that report.", ge=1)


@dataclasses.dataclass(frozen=True, slots=True)
class StanzasOptions(_Checked):
    """``stanzas``: which stanzas are written into ``--model-repository``, or only checked."""

    plan: Path | None = setting(None, "A plan from `warmup_tools plan`; empty: the demo prompts.")
    tokenizer: Path = setting(_SERVED.assets_dir / "lm", "Tokenizer folder used to turn the demo warm-up prompts "
                                                         "into token ids.")
    check: bool = setting(False, "Only validate the stanzas against the configs.")


@dataclasses.dataclass(frozen=True, slots=True)
class HistoryOptions(_Checked):
    """``plan history``."""

    limit: int = setting(50, "Show at most this many entries.", ge=1)


@dataclasses.dataclass(frozen=True, slots=True)
class DiffOptions(_Checked):
    """``plan diff A B``."""

    items: int = setting(20, "List at most this many added and dropped items.", ge=0)


@dataclasses.dataclass(frozen=True, slots=True)
class CanaryOptions(_Checked):
    """``plan canary [PLAN]`` (with ``--model-repository`` and ``--control-dir``)."""

    canary_instances: tuple[str, ...] = setting((), "An instance that serves the plan on trial (repeat); empty: "
                                                    "the replica's last one, of those that report.",
                                                flag="instance", repeat=True, kind="name (one per flag)")
    replica: str = setting("", "The replica's name (its replica_name, else its host name); empty: this host's "
                               "name. Without --instance: every instance of it, judged against the fleet's other "
                               "replicas.")
    abort: bool = setting(False, "End the running trial: every instance goes back to the plan served now.")


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterAddOptions(_Checked):
    """``adapters add NAME``."""

    path: str | None = setting(None, "Folder under adapter_root; empty: the name.")
    warm_prompt: tuple[str, ...] = setting((), "A prompt to pre-fill (repeat).", repeat=True,
                                           kind="text (one per flag)")
    warm_file: Path | None = setting(None, "File of prompts to pre-fill, one per line.")
    register_only: bool = setting(False, "Register without loading it.")
    wait: float = setting(300.0, "Seconds to wait for every instance (0: don't).", ge=0)
    instances: int | None = setting(None, "How many instances must report; empty: all that report.", ge=1)


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterRetireOptions(_Checked):
    """``adapters retire NAME``."""

    wait: float = setting(120.0, "Seconds to wait for every instance (0: don't).", ge=0)
    instances: int | None = setting(None, "How many instances must report; empty: all that report.", ge=1)


@dataclasses.dataclass(frozen=True, slots=True)
class JoinOptions(_Checked):
    """``join``: which replica joins which router (with the fleet's settings that ``join`` reads)."""

    router: str = setting(doc="The router's base URL, e.g. http://router:30000.")
    replica: str = setting(doc="The replica's OpenAI front, e.g. http://triton:9000.")
    worker_host: str | None = setting(None, "The host the router reaches the replica at, when not --replica's (a "
                                            "pod's join reads its front on localhost; the router dials the pod's "
                                            "IP).")
    once: bool = setting(False, "Register once the replica is warm, then exit (no updates, no removal at exit).")
    timeout_s: float = setting(1800.0, "With --once: how long to wait for the replica to be warm.", gt=0)


@dataclasses.dataclass(frozen=True, slots=True)
class BesideOptions(_Checked):
    """``serve`` and ``sidecar``: what runs beside tritonserver."""

    front: bool = setting(True, "Start the OpenAI front beside tritonserver (--no-front: do not).")


@dataclasses.dataclass(frozen=True, slots=True)
class AssetsOptions(_Checked):
    """``assets``."""

    out: Path = setting(_SERVED.assets_dir, "The folder the demo assets are built in (the server's assets_dir).")
    seed: int = setting(DEFAULT_SEED, "The seed of the demo LM, adapters and embedder.")
    force: bool = setting(False, "Rebuild even if the assets are complete.")


@dataclasses.dataclass(frozen=True, slots=True)
class TrafficOptions(_Checked):
    """``traffic``: the generator's own defaults (:class:`~warmup_tools.sim.traffic.TrafficConfig`)."""

    out: Path = setting(REPO_ROOT / "runs" / "traffic", "The folder the request logs are written in.")
    seed: int = setting(_GENERATED.seed, "The generator's seed: the same seed, the same records.")
    days: int = setting(_GENERATED.days, "Days of traffic, one log file each.", ge=1)
    requests_per_day: int = setting(_GENERATED.requests_per_day, "Requests per day.", ge=1)
    gzip: bool = setting(False, "Write .jsonl.gz files.")


@dataclasses.dataclass(frozen=True, slots=True)
class TenantKeyOptions(_Checked):
    """``tenant-key TENANT``."""

    keys_file: Path = setting(doc="The tenant_keys_file of tokenizer_cache.")
    secret_file: Path = setting(doc="The deployment_secret_file of the composing models (created if missing).")


@dataclasses.dataclass(frozen=True, slots=True)
class DeploySecretsOptions(_Checked):
    """``deploy-secrets`` (with :func:`~warmup_tools.ops.deploy_secrets.make_deployment_secrets`'s arguments)."""

    dir: Path = setting(doc="The folder (made 0700; every file 0600).")


@dataclasses.dataclass(frozen=True, slots=True)
class ProfileFitOptions(_Checked):
    """``profile-fit`` (with ``--assets-dir`` and :func:`~warmup_tools.lora_adapter.profile_fit.fit_profile`'s
    arguments)."""

    out: Path = setting(doc="The profile JSON to write.")


#: Each class above, the commands that take it: the parameter reference lists them in this order.
COMMAND_OPTIONS = (
    (MakePlanOptions, "`plan`"),
    (LiveApplyOptions, "`apply-plan` and `plan rollback`"),
    (StanzasOptions, "`stanzas`"),
    (HistoryOptions, "`plan history`"),
    (DiffOptions, "`plan diff`"),
    (CanaryOptions, "`plan canary`"),
    (AdapterAddOptions, "`adapters add`"),
    (AdapterRetireOptions, "`adapters retire`"),
    (JoinOptions, "`join`"),
    (BesideOptions, "`serve` and `sidecar`"),
    (AssetsOptions, "`assets`"),
    (TrafficOptions, "`traffic`"),
    (TenantKeyOptions, "`tenant-key`"),
    (DeploySecretsOptions, "`deploy-secrets`"),
    (ProfileFitOptions, "`profile-fit`"),
)
