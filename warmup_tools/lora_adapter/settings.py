"""Every ``lora_adapter`` parameter of ``config.pbtxt``, read once into one typed object.

The server (``model.py``'s ``initialize``), the planner and the stanza writer all build a
:class:`LoraAdapterSettings` through :meth:`LoraAdapterSettings.from_parameters`: the defaults live here
(and in :mod:`warmup_tools.kv.config` for the KV cache) and nowhere else, and
:meth:`LoraAdapterSettings.from_repository` reads a repository's ``lora_adapter/config.pbtxt`` the way
Triton hands it to the model, so a plan is made for the block size, storage and budget the server uses.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import ClassVar

from warmup_tools.common.errors import AssetError, ConfigError
from warmup_tools.common.names import replica_name as check_replica_name
from warmup_tools.common.settings import check_settings, setting
from warmup_tools.kv.config import KVCacheConfig, KVShape
from warmup_tools.lora_adapter.profile import DEFAULT_PROFILE, load_profile
from warmup_tools.lora_adapter.requests import RequestLimits
from warmup_tools.triton.metrics import MetricsSettings
from warmup_tools.triton.params import ModelSettings
from warmup_tools.triton.trust import TrustSettings

MODEL_NAME = "lora_adapter"

#: ``dtype`` values: ``auto`` is bfloat16 on a GPU and float32 on the CPU.
DTYPES = ("auto", "float32", "float16", "bfloat16")

#: ``engine`` values: the Hugging Face LM, or a simulated one that waits a profile's step times
#: (:mod:`warmup_tools.lora_adapter.simulated`); model.py maps each to its class (``lora_adapter.engines``).
ENGINE_KINDS = ("real", "simulated")
#: How the real engine computes a forward: packed (its own Llama-family forward, the default) or Hugging Face's.
ENGINE_FORWARDS = ("packed", "hf")

#: Bytes per value of each torch dtype name the ``dtype`` parameter resolves to.
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def read_public_prefixes(path: Path) -> tuple[str, ...]:
    """A JSON list of texts every tenant may share the KV of (a platform system prompt)."""
    try:
        texts = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"public_prefixes_file: {path} is not readable JSON ({exc})") from None
    if not isinstance(texts, list) or not all(isinstance(t, str) and t for t in texts):
        raise ConfigError(f"public_prefixes_file: {path} must hold a JSON list of texts")
    return tuple(texts)


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the engine loads and how (:class:`warmup_tools.lora_adapter.loaded.LoadedModel`, or with
    ``engine=simulated`` :class:`warmup_tools.lora_adapter.simulated.SimulatedEngine`)."""

    base_model: Path = setting(doc="Hugging Face model folder of the base causal LM (config.json, safetensors "
                                   "weights, tokenizer).")
    adapter_root: Path | None = setting(None, "Folder of LoRA adapter folders (peft format, safetensors only); "
                                              "empty: no adapters.")
    adapters: tuple[str, ...] | None = setting(None, "Adapters to load at start; empty loads every folder under "
                                                     "adapter_root that holds an adapter_config.json.")
    device: str = setting("auto", "Torch device: auto picks the first CUDA device when there is one, else the "
                                  "CPU; or cpu, cuda, cuda:N.")
    dtype: str = setting("auto", "Weights and KV dtype: auto is bfloat16 on a GPU and float32 on the CPU.",
                         choices=DTYPES)
    num_threads: int = setting(0, "Torch CPU threads of the instance (torch.set_num_threads); 0 leaves torch's "
                                  "default.", ge=0, le=1024)
    reuse_freed_mib: int = setting(256, "MiB of freed host memory the process keeps for reuse (glibc's mallopt: "
                                        "buffers up to this size come from the heap, which is trimmed only above "
                                        "it) so a forward's buffers are not page-faulted anew at every step (about "
                                        "10 ms of system time per 528-token prefill of the demo LM on the CPU); 0 "
                                        "leaves the C library's defaults. Process-wide, set at load.",
                                   ge=0, le=1 << 20)
    kv: KVCacheConfig = dataclasses.field(default_factory=KVCacheConfig)
    #: Trust mode: a per-deployment salt in every block hash (from the deployment secret; "" in open mode).
    cache_salt: str = setting("", "Per-deployment salt in every block hash.", parameter="")
    public_prefixes: tuple[str, ...] = setting(
        (), "Operator-declared public prefixes (a platform system prompt every tenant uses): their full blocks "
            "are shared by all tenants on purpose, everything after them stays per tenant.",
        parameter="public_prefixes_file", load=read_public_prefixes, kind="path to a JSON list of texts")
    kind: str = setting("real", "real runs the base model; simulated loads no weights (the tokenizer only) and "
                                "waits the step times of engine_profile, its tokens a function of the context.",
                        parameter="engine", choices=ENGINE_KINDS)
    forward: str = setting("packed", "The real engine's forward: packed computes Llama, Mistral and Qwen2 models in "
                                     "one packed batch over a pool of KV (other models fall back to hf); hf runs "
                                     "the Hugging Face model with peft's LoRA layers.",
                           parameter="engine_forward", choices=ENGINE_FORWARDS)
    profile: str = setting(DEFAULT_PROFILE, "The simulated engine's profile: a shipped one's name or a JSON file's "
                                          "path (docs/serving.md, A simulated engine).", parameter="engine_profile")
    speedup: float = setting(1.0, "The simulated engine waits its modelled step times divided by this.",
                             parameter="engine_speedup", gt=0)
    time_scale: float = setting(0.0, "The simulated engine's KV cache keeps modelled time: wall seconds times this "
                                "(its TTLs, pin deadlines and live-check windows); 0: engine_speedup.",
                                parameter="engine_time_scale", ge=0)

    def __post_init__(self) -> None:
        check_settings(self)
        if self.kind == "simulated":
            load_profile(self.profile)  # a missing or bad profile fails here, naming it


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Knobs of one instance's scheduler (:class:`warmup_tools.lora_adapter.scheduler.Scheduler`)."""

    max_num_seqs: int = setting(8, "Sequences running at once (in one batch).", ge=1, le=1024)
    max_queue: int = setting(64, "Requests that may wait for a running slot; one more is refused with "
                                 "UNAVAILABLE (server busy: HTTP 429 at the front).", ge=0)
    tenant_queue_share: float = setting(0.5, "The share of max_queue one tenant's waiting requests may take (at "
                                              "least one request): a tenant holding its running slots and this "
                                              "many waiting is refused with its own rate-limit error (HTTP 429 at "
                                              "the front) while other tenants are still queued; 1: no tenant "
                                              "bound below max_queue (one tenant may fill it: a single-tenant "
                                              "deployment).", gt=0, le=1)
    tenant_slot_share: float = setting(0.75, "The share of max_num_seqs one tenant keeps running while another "
                                             "tenant's request waits for a slot (at least one slot): above it, "
                                             "its most recently admitted sequence is preempted (recomputed "
                                             "later, invisible to its client), one per step; free slots go to "
                                             "the waiting tenant that runs the fewest; 1: a tenant never yields "
                                             "a running slot.", gt=0, le=1)
    max_num_batched_tokens: int = setting(256, "New tokens per step (decode tokens plus prefill chunks); at least "
                                               "max_num_seqs.", ge=1)
    warm_chunk_tokens: int = setting(16, "Warm-up tokens per step while live traffic flows: warm chunks never "
                                         "share a step with a live prefill, and a live request waits for at most "
                                         "one such chunk.", ge=1)
    warm_share: float = setting(0.25, "While live traffic flows, the largest share of the engine's time adapter "
                                      "warm-up may take.", gt=0, le=1)
    live_quiet_s: float = setting(0.5, "Seconds without a live request after which warm-up takes whole steps (an "
                                       "idle instance warms fast).", ge=0)
    cancel_check_s: float = setting(0.05, "Seconds between two looks at whether one request's client cancelled it "
                                          "(each look is a round trip to Triton, too dear for every step); 0: "
                                          "every step.", ge=0, le=1)

    def __post_init__(self) -> None:
        check_settings(self)
        if self.max_num_batched_tokens < self.max_num_seqs:
            # NOTE: every running sequence's decode token must fit in one step, or decodes would starve.
            raise ConfigError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                              f"max_num_seqs ({self.max_num_seqs})")


@dataclasses.dataclass(frozen=True, slots=True)
class SnapshotConfig:
    """KV snapshots of an instance (:mod:`warmup_tools.lora_adapter.snapshots`)."""

    folder: Path | None = setting(None, "Folder of KV snapshots, shared by instances and replicas; empty: no "
                                        "snapshots (neither written nor restored).", parameter="snapshot_dir")
    max_bytes: int = setting(128 << 20, "Bytes of KV blocks (payload and token ids) one snapshot may hold; also "
                                        "bounds what is read back.", parameter="snapshot_bytes", ge=1)
    interval_s: float = setting(300.0, "Seconds between periodic snapshot writes; 0: only at shutdown.",
                                parameter="snapshot_interval_s", ge=0)
    verify_share: float = setting(0.05, "Share of each snapshot's blocks recomputed before it is trusted (at "
                                        "least one block).", parameter="snapshot_verify_share", gt=0, le=1)

    def __post_init__(self) -> None:
        check_settings(self)


#: The scheduler's and the snapshots' defaults, as objects (the fields above are their one source).
DEFAULT_BATCHING = SchedulerConfig()
DEFAULT_SNAPSHOTS = SnapshotConfig()


@dataclasses.dataclass(frozen=True, slots=True)
class ServiceConfig:
    """What one instance serves and how it follows the control folder
    (:class:`~warmup_tools.lora_adapter.service.LoraService`)."""

    control_dir: Path | None = setting(None, "Control folder shared with the sidecar and the CLI (desired "
                                             "adapters, live plans, coverage reports); empty: none.")
    serve_cold: bool = setting(False, "Serve an adapter that is registered but still warming (its first "
                                      "requests are cold) instead of refusing it.")
    control_poll_s: float = setting(0.5, "Seconds between looks at the control folder (one stat each) by an idle "
                                         "instance.", ge=0.01, le=60)
    kv_events_dir: Path | None = setting(None, "A private folder (0700) where this instance serves its KV events on a "
                                               "unix socket, <instance>.sock, smg's SubscribeKvEvents for the "
                                               "replica's gRPC worker listeners; empty: not served.")
    replica_name: str = setting("", "This replica's name in the shared control and snapshot folders (its coverage "
                                    "reports and KV snapshot files); empty: the host name. Replicas that share a "
                                    "host and the folders need distinct names.")

    def __post_init__(self) -> None:
        check_settings(self)
        if self.replica_name:
            check_replica_name(self.replica_name)


@dataclasses.dataclass(frozen=True, slots=True)
class LoraAdapterSettings(ModelSettings):
    """Every ``lora_adapter`` parameter (:meth:`from_parameters`)."""

    MODEL: ClassVar[str] = MODEL_NAME

    engine: EngineConfig
    limits: RequestLimits = dataclasses.field(default_factory=RequestLimits)
    service: ServiceConfig = dataclasses.field(default_factory=ServiceConfig)
    request_log_dir: Path | None = setting(None, "Folder of the request logs the planner reads "
                                                 "(requests-<instance>.jsonl, 0600); empty: no log.")
    request_log_redact: bool = setting(False, "Log a keyed digest of each prompt instead of its text.")
    trust: TrustSettings = dataclasses.field(default_factory=TrustSettings)
    metrics: MetricsSettings = dataclasses.field(default_factory=MetricsSettings)
    expose_cached_tokens: bool = setting(True, "Return cached_tokens to clients; false withholds it (the "
                                               "prompt-cache side channel, SECURITY.md).")
    batching: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    snapshots: SnapshotConfig = dataclasses.field(default_factory=SnapshotConfig)

    def __post_init__(self) -> None:
        check_settings(self)

    def kv_bytes_per_token(self, device_dtype: str | None = None) -> float:
        """KV bytes one cached token takes: from the base model's config.json, dtype and ``kv_storage`` (a
        simulated engine: its profile's ``kv_bytes_per_token``).

        ``device_dtype`` is the torch dtype name ``dtype=auto`` resolves to on the serving device;
        by default ``auto`` resolves as it would on this machine.
        """
        if self.engine.kind == "simulated":
            return float(load_profile(self.engine.profile).kv_bytes_per_token)
        dtype = device_dtype or self.engine.dtype
        if dtype == "auto":
            from warmup_tools.lora_adapter.devices import select_device, select_dtype  # torch

            dtype = str(select_dtype("auto", select_device(self.engine.device))).removeprefix("torch.")
        if dtype not in _DTYPE_BYTES:
            raise ConfigError(f"lora_adapter parameter dtype {dtype!r} is not one of auto, "
                              f"{', '.join(_DTYPE_BYTES)}")
        kv = self.engine.kv
        return model_kv_shape(self.engine.base_model).bytes_per_token(kv.storage, _DTYPE_BYTES[dtype], kv.block_size)


def model_kv_shape(model_dir: Path) -> KVShape:
    """The KV shape of a Hugging Face model folder, from its ``config.json``."""
    config_path = Path(model_dir) / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AssetError(f"{config_path} does not exist; point base_model at a Hugging Face model folder") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise AssetError(f"{config_path} is not readable JSON ({exc})") from None
    try:
        return KVShape.from_model_config(config)
    except (KeyError, TypeError, ValueError) as exc:
        raise AssetError(f"{config_path} lacks a usable {exc} entry for the KV size") from None


def discover_adapters(root: Path | None, names: tuple[str, ...] | None) -> dict[str, Path]:
    """Adapter folders under ``root``: the given names, or every folder holding an adapter_config.json."""
    if root is None:
        if names:
            raise AssetError("adapters are listed but no adapter_root is configured")
        return {}
    root = root.resolve()
    if names is None:
        if not root.is_dir():
            raise AssetError(f"adapter_root {root} is not a folder")
        names = tuple(sorted(p.name for p in root.iterdir() if (p / "adapter_config.json").exists()))
    found: dict[str, Path] = {}
    for name in names:
        path = (root / name).resolve()
        if path.parent != root:
            raise AssetError(f"adapter name {name!r} escapes the adapter root {root}")
        if not (path / "adapter_config.json").exists():
            raise AssetError(f"adapter {name!r}: {path} has no adapter_config.json")
        # NOTE: adapters load from safetensors only; a pickled adapter_model.bin can run code on load.
        if not (path / "adapter_model.safetensors").exists():
            raise AssetError(f"adapter {name!r}: {path} has no adapter_model.safetensors (pickled weights are refused)")
        found[name] = path
    return found


#: The context a model config without ``max_position_embeddings`` is served with.
DEFAULT_CONTEXT_LENGTH = 2048


def model_context_length(model_dir: Path) -> int:
    """The longest sequence the base model in ``model_dir`` serves (``max_position_embeddings``)."""
    config_path = Path(model_dir) / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise AssetError(f"{config_path} is not readable ({exc}); point base_model at a Hugging Face model "
                         "folder") from None
    return int(config.get("max_position_embeddings", DEFAULT_CONTEXT_LENGTH))
