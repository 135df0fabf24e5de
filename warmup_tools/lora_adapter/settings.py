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
from typing import Any, Mapping

from warmup_tools.common.errors import AssetError, ConfigError
from warmup_tools.kv.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_BUDGET_BYTES,
    DEFAULT_EVICTION,
    DEFAULT_LIVE_RESERVE,
    DEFAULT_STORAGE,
    DEFAULT_TTL_S,
    KVCacheConfig,
    KVShape,
)
from warmup_tools.lora_adapter.requests import RequestLimits
from warmup_tools.triton.params import ModelParameters, parse_bool

MODEL_NAME = "lora_adapter"

#: Who may use the engine next while an adapter warms: live requests first, or first come first served.
WARM_PRIORITIES = ("live_first", "fifo")

#: How ``execute`` serves: ``continuous`` (iteration-level batching on the scheduler's thread) or
#: ``serial`` (each request to its last token inside ``execute``, one at a time; kept to measure against).
SCHEDULERS = ("continuous", "serial")

#: Bytes per value of each torch dtype name the ``dtype`` parameter resolves to.
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Knobs of one instance's scheduler (``config.pbtxt`` parameters of ``lora_adapter``)."""

    #: Sequences running at once (in one batch).
    max_num_seqs: int = 8
    #: Requests that may wait for a running slot; one more is refused with UNAVAILABLE.
    max_queue: int = 64
    #: New tokens per step (decode tokens plus prefill chunks).
    max_num_batched_tokens: int = 256
    #: Warm-up tokens per step while live traffic flows (``warm_chunk_tokens``): warm chunks never share a
    #: step with a live prefill, and a live request waits for at most one such chunk.
    warm_chunk_tokens: int = 16
    #: While live traffic flows, the largest share of the time warm chunks may take (``warm_share``).
    warm_share: float = 0.25
    #: Seconds without a live request after which warm-up takes whole steps (an idle instance warms fast).
    live_quiet_s: float = 0.5

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_queue < 0:
            raise ConfigError(f"max_num_seqs must be >= 1 and max_queue >= 0, not {self.max_num_seqs}, "
                              f"{self.max_queue}")
        if self.warm_chunk_tokens < 1 or self.live_quiet_s < 0 or not 0.0 < self.warm_share <= 1.0:
            raise ConfigError(f"warm_chunk_tokens must be >= 1, live_quiet_s >= 0 and 0 < warm_share <= 1 with "
                              f"the continuous scheduler, not {self.warm_chunk_tokens}, {self.live_quiet_s}, "
                              f"{self.warm_share}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # NOTE: every running sequence's decode token must fit in one step, or decodes would starve.
            raise ConfigError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                              f"max_num_seqs ({self.max_num_seqs})")


@dataclasses.dataclass(frozen=True, slots=True)
class SnapshotConfig:
    """KV snapshots of an instance (``snapshot_*`` parameters; :mod:`warmup_tools.lora_adapter.snapshots`)."""

    #: Folder shared by instances and replicas; None: no snapshots (neither written nor restored).
    folder: Path | None = None
    #: Bytes of KV blocks (payload and token ids) one snapshot may hold; also bounds what is read back.
    max_bytes: int = 128 << 20
    #: Seconds between periodic writes (0: only at shutdown).
    interval_s: float = 300.0
    #: Share of each snapshot's blocks recomputed before it is trusted (at least one block).
    verify_share: float = 0.05

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.interval_s < 0 or not 0.0 < self.verify_share <= 1.0:
            raise ConfigError(f"lora_adapter parameters: snapshot_bytes >= 1, snapshot_interval_s >= 0 and "
                              f"0 < snapshot_verify_share <= 1 are required (got {self.max_bytes}, "
                              f"{self.interval_s}, {self.verify_share})")


#: Snapshot defaults (one source: the parameters below fall back to these).
DEFAULT_SNAPSHOTS = SnapshotConfig()
#: Request bounds when config.pbtxt sets none.
DEFAULT_LIMITS = RequestLimits()
#: The scheduler defaults (one source: the parameters below fall back to these).
DEFAULT_BATCHING = SchedulerConfig()


@dataclasses.dataclass(frozen=True, slots=True)
class LoraAdapterSettings:
    base_model: Path
    adapter_root: Path | None
    #: Adapters to load at start; None loads every folder under ``adapter_root``.
    adapters: tuple[str, ...] | None
    device: str
    dtype: str
    num_threads: int
    kv: KVCacheConfig
    control_dir: Path | None
    serve_cold: bool
    warm_priority: str
    #: The largest share of the engine's time adapter warm-up may hold.
    warm_share: float
    warm_chunk_tokens: int
    max_tokens_limit: int
    default_max_tokens: int
    request_log_dir: Path | None
    request_log_redact: bool
    #: Trust mode (see :mod:`warmup_tools.triton.trust`): the tenant only from a signed token.
    deployment_secret_file: Path | None
    #: Trust mode: the hashed tenant keys a token's key version is checked against (as the file is now).
    tenant_keys_file: Path | None
    #: Open mode: the sidecar's per-start probe secret (``WARMUP_PROBE_SECRET``), proof of the probe tenant.
    probe_secret: str | None
    #: False withholds ``cached_tokens`` from clients (the prompt-cache side channel; SECURITY.md).
    expose_cached_tokens: bool
    #: Operator-declared public prefixes, shared by every tenant on purpose (``public_prefixes_file``).
    public_prefixes: tuple[str, ...]
    #: One of :data:`SCHEDULERS`.
    scheduler: str
    batching: SchedulerConfig
    #: KV snapshots (``snapshot_dir`` empty: off).
    snapshots: SnapshotConfig = DEFAULT_SNAPSHOTS

    @classmethod
    def from_parameters(cls, params: ModelParameters) -> LoraAdapterSettings:
        """Read and check every parameter; unknown ones are refused (a typo fails the load)."""
        adapters = params.get("adapters", str, "")
        names = tuple(a.strip() for a in adapters.split(",") if a.strip()) or None
        warm_chunk = params.get("warm_chunk_tokens", int, DEFAULT_BATCHING.warm_chunk_tokens)
        warm_share = params.get("warm_share", float, DEFAULT_BATCHING.warm_share)
        settings = cls(
            base_model=params.path("base_model"),
            adapter_root=params.path("adapter_root") if params.get("adapter_root", str, "") else None,
            adapters=names,
            device=params.get("device", str, "auto"),
            dtype=params.get("dtype", str, "auto"),
            num_threads=params.get("num_threads", int, 0),
            kv=KVCacheConfig(
                budget_bytes=params.get("kv_cache_bytes", int, DEFAULT_BUDGET_BYTES),
                block_size=params.get("kv_block_size", int, DEFAULT_BLOCK_SIZE),
                storage=params.get("kv_storage", str, DEFAULT_STORAGE),
                eviction=params.get("kv_eviction", str, DEFAULT_EVICTION),
                ttl_s=params.get("kv_ttl_s", float, DEFAULT_TTL_S),
                live_reserve=params.get("kv_live_reserve", float, DEFAULT_LIVE_RESERVE),
            ),
            control_dir=params.path("control_dir") if params.get("control_dir", str, "") else None,
            serve_cold=params.get("serve_cold", parse_bool, False),
            warm_priority=params.get("warm_priority", str, "live_first"),
            warm_share=warm_share,
            warm_chunk_tokens=warm_chunk,
            max_tokens_limit=params.get("max_tokens_limit", int, DEFAULT_LIMITS.max_tokens_limit),
            default_max_tokens=params.get("default_max_tokens", int, DEFAULT_LIMITS.default_max_tokens),
            request_log_dir=params.path("request_log_dir") if params.get("request_log_dir", str, "") else None,
            request_log_redact=params.get("request_log_redact", parse_bool, False),
            deployment_secret_file=(params.path("deployment_secret_file")
                                    if params.get("deployment_secret_file", str, "") else None),
            tenant_keys_file=params.path("tenant_keys_file") if params.get("tenant_keys_file", str, "") else None,
            probe_secret=params.get("probe_secret", str, "") or None,
            expose_cached_tokens=params.get("expose_cached_tokens", parse_bool, True),
            public_prefixes=(read_public_prefixes(params.path("public_prefixes_file"))
                             if params.get("public_prefixes_file", str, "") else ()),
            scheduler=params.get("scheduler", str, "continuous"),
            batching=SchedulerConfig(
                max_num_seqs=params.get("max_num_seqs", int, DEFAULT_BATCHING.max_num_seqs),
                max_queue=params.get("max_queue", int, DEFAULT_BATCHING.max_queue),
                max_num_batched_tokens=params.get("max_num_batched_tokens", int,
                                                  DEFAULT_BATCHING.max_num_batched_tokens),
                warm_chunk_tokens=warm_chunk,
                warm_share=warm_share,
            ),
            snapshots=SnapshotConfig(
                folder=params.path("snapshot_dir") if params.get("snapshot_dir", str, "") else None,
                max_bytes=params.get("snapshot_bytes", int, DEFAULT_SNAPSHOTS.max_bytes),
                interval_s=params.get("snapshot_interval_s", float, DEFAULT_SNAPSHOTS.interval_s),
                verify_share=params.get("snapshot_verify_share", float, DEFAULT_SNAPSHOTS.verify_share),
            ),
        )
        params.check_unknown()
        settings.check()
        return settings

    @classmethod
    def from_repository(cls, model_repository: Path, environ: Mapping[str, str] | None = None) -> LoraAdapterSettings:
        """The settings a server on ``model_repository`` (with ``environ``, default this process's) would
        run ``lora_adapter`` with."""
        return cls.from_parameters(repository_parameters(model_repository, MODEL_NAME, environ))

    def check(self) -> None:
        """Refuse values no instance could serve with, naming the parameter."""
        if self.scheduler not in SCHEDULERS:
            raise ConfigError(f"lora_adapter parameter scheduler must be one of {', '.join(SCHEDULERS)}, "
                              f"not {self.scheduler!r}")
        if self.warm_priority not in WARM_PRIORITIES:
            raise ConfigError(f"lora_adapter parameter warm_priority must be one of {', '.join(WARM_PRIORITIES)}, "
                              f"not {self.warm_priority!r}")
        if not 0.0 < self.warm_share <= 1.0:
            raise ConfigError(f"lora_adapter parameter warm_share must be a share of time in (0, 1], "
                              f"not {self.warm_share}")
        if self.warm_chunk_tokens < 0:
            raise ConfigError(f"lora_adapter parameter warm_chunk_tokens must be 0 (whole prompts) or a token "
                              f"count, not {self.warm_chunk_tokens}")
        if self.kv.block_size < 1 or self.kv.budget_bytes < 0 or not 0.0 <= self.kv.live_reserve < 1.0:
            raise ConfigError("lora_adapter parameters: kv_block_size >= 1, kv_cache_bytes >= 0 and "
                              f"0 <= kv_live_reserve < 1 are required (got {self.kv.block_size}, "
                              f"{self.kv.budget_bytes}, {self.kv.live_reserve})")

    def kv_bytes_per_token(self, device_dtype: str | None = None) -> float:
        """KV bytes one cached token takes: from the base model's config.json, dtype and ``kv_storage``.

        ``device_dtype`` is the torch dtype name ``dtype=auto`` resolves to on the serving device;
        by default ``auto`` resolves as it would on this machine.
        """
        dtype = device_dtype or self.dtype
        if dtype == "auto":
            from warmup_tools.lora_adapter.engine import select_device, select_dtype  # torch

            dtype = str(select_dtype("auto", select_device(self.device))).removeprefix("torch.")
        if dtype not in _DTYPE_BYTES:
            raise ConfigError(f"lora_adapter parameter dtype {dtype!r} is not one of auto, "
                              f"{', '.join(_DTYPE_BYTES)}")
        return model_kv_shape(self.base_model).bytes_per_token(self.kv.storage, _DTYPE_BYTES[dtype],
                                                               self.kv.block_size)


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


def repository_parameters(model_repository: Path, model: str,
                          environ: Mapping[str, str] | None = None) -> ModelParameters:
    """A model's ``config.pbtxt`` parameters as Triton hands them to ``initialize`` (paths relative to
    the model's folder, ``${ENV}`` expanded from this process's environment)."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    path = Path(model_repository) / model / "config.pbtxt"
    try:
        config = text_format.Parse(path.read_text(encoding="utf-8"), model_config_pb2.ModelConfig())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist; point --model-repository at a repository with {model}") from None
    except text_format.ParseError as exc:
        raise ConfigError(f"{path} does not parse: {exc}") from None
    data: dict[str, Any] = json_format.MessageToDict(config, preserving_proto_field_name=True)
    return ModelParameters(data, base_dir=path.parent, environ=environ)


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


def read_public_prefixes(path: Path) -> tuple[str, ...]:
    """A JSON list of texts every tenant may share the KV of (a platform system prompt)."""
    try:
        texts = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"lora_adapter parameter public_prefixes_file: {path} is not readable JSON ({exc})") from None
    if not isinstance(texts, list) or not all(isinstance(t, str) and t for t in texts):
        raise ConfigError(f"lora_adapter parameter public_prefixes_file: {path} must hold a JSON list of texts")
    return tuple(texts)
