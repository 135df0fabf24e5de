"""The warm-up plan file: versioned, content-hashed, validated on load (the one plan loader).

The file crosses processes like the request record: :mod:`warmup_tools.planning` writes it, and the
control folder carries it to every ``lora_adapter`` instance, which checks it
(:mod:`warmup_tools.control.plan_control`); so it lives here, below both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from warmup_tools.common.control_json import read_json_bounded
from warmup_tools.common.errors import ConfigError, FileFormatError
from warmup_tools.common.files import write_atomic
from warmup_tools.common.wire import plan_retention

#: Version of the plan file layout; :meth:`Plan.load` refuses any other.
PLAN_FORMAT = 1
#: The largest plan file :meth:`Plan.load` reads (an instance reads at most 16 MiB of a live plan).
MAX_PLAN_FILE_BYTES = 64 * 1024 * 1024
#: The most arrays and objects a plan file :meth:`Plan.load` reads may hold, counted on its bytes before it is
#: parsed (control_json.json_containers): four times what an instance allows in its 16 MiB (plan_control's
#: MAX_PLAN_CONTAINERS, 16 per item of at most 4,096), as these 64 MiB are four times those. The sidecar loads the
#: live plan.json with it: 64 MiB of ``[[],[],...]`` would be 22 million lists, about 3 GiB.
MAX_PLAN_FILE_CONTAINERS = 1 << 18


class PlanError(ConfigError):
    """A plan file is missing, unreadable, of another format, or was edited after it was built."""


@dataclasses.dataclass(frozen=True, slots=True)
class Budgets:
    """What one warm-up may use, per model instance (every instance warms the same plan)."""

    #: KV bytes of warmed prefixes per adapter ("" is the base model), over all tenants.
    kv_bytes_per_adapter: int
    #: KV bytes of warmed prefixes over all adapters.
    kv_bytes_total: int
    #: Prompt embeddings to pre-compute into the embedding cache.
    embedding_entries: int = 256
    #: Texts to register with the tokenizer cache.
    tokenizer_entries: int = 256
    #: Time the KV warm-up may take, estimated from the prefill tokens it computes.
    warm_seconds: float = 60.0
    #: Prefill throughput of one instance, used to turn prefill tokens into warm seconds.
    prefill_tokens_per_s: float = 3000.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"budget {field.name} must be a number, got {value!r}")
            if value < 0:
                raise ConfigError(f"budget {field.name} must be >= 0, got {value!r}")
        if self.prefill_tokens_per_s <= 0:
            raise ConfigError(f"budget prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Budgets:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown budget key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING and f.name not in data)
        if missing:
            raise ConfigError(f"budget key(s) {', '.join(missing)} are required")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(slots=True)
class Plan:
    """A versioned warm-up plan. ``plan_id`` hashes what is warmed: items, block size and tokenizer."""

    plan_id: str
    created: str
    block_size: int
    tokenizer_fingerprint: str
    budgets: dict[str, Any]
    settings: dict[str, Any]
    summary: dict[str, Any]
    items: list[dict[str, Any]]
    embedding_items: list[dict[str, Any]]
    tokenizer_templates: list[dict[str, Any]]
    clusters: list[dict[str, Any]]
    format: int = PLAN_FORMAT

    @staticmethod
    def content_id(items: Sequence[Mapping[str, Any]], block_size: int, fingerprint: str) -> str:
        payload = {"block_size": block_size, "items": list(items), "tokenizer_fingerprint": fingerprint}
        return hashlib.sha256(_canonical(payload).encode("utf-8")).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return _canonical(self.to_dict())

    def save(self, path: Path) -> None:
        """Write the plan atomically (a reader never sees half a file)."""
        write_atomic(Path(path), self.to_json() + "\n")

    @classmethod
    def load(cls, path: Path) -> Plan:
        """Read and validate a plan file; :class:`PlanError` says what is wrong and what to do."""
        path = Path(path)
        rebuild = "rebuild it from the request logs with `warmup_tools plan`"
        if not path.exists():
            raise PlanError(f"plan file {path} does not exist; {rebuild}")
        try:
            data = read_json_bounded(path, max_bytes=MAX_PLAN_FILE_BYTES, max_containers=MAX_PLAN_FILE_CONTAINERS)
        except FileFormatError as exc:
            raise PlanError(f"plan file {exc}; {rebuild}") from None
        if not isinstance(data, dict):
            raise PlanError(f"plan file {path} does not hold a JSON object; {rebuild}")
        if data.get("format") != PLAN_FORMAT:
            raise PlanError(f"plan file {path} has format {data.get('format')!r}, this version of warmup_tools "
                            f"reads format {PLAN_FORMAT}; {rebuild}")
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in data]
        unknown = sorted(set(data) - set(names))
        if missing or unknown:
            raise PlanError(f"plan file {path} is malformed (missing: {', '.join(missing) or '-'}; "
                            f"unknown: {', '.join(unknown) or '-'}); {rebuild}")
        plan = cls(**data)
        block_size = plan.block_size
        if not isinstance(block_size, int) or block_size < 1:
            raise PlanError(f"plan file {path}: block_size must be a positive integer; {rebuild}")
        for index, item in enumerate(plan.items):
            ids = item.get("token_ids") if isinstance(item, dict) else None
            if (not isinstance(ids, list) or not ids or len(ids) % block_size
                    or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
                raise PlanError(f"plan file {path}: item {index} needs token_ids, a non-empty list of integers "
                                f"whose length is a multiple of block_size {block_size}; {rebuild}")
            try:
                plan_retention(item.get("retention_s"))
            except ValueError as exc:
                raise PlanError(f"plan file {path}: item {index}: {exc}; {rebuild}") from None
        expected = cls.content_id(plan.items, plan.block_size, plan.tokenizer_fingerprint)
        if expected != plan.plan_id:
            raise PlanError(f"plan file {path} names plan_id {plan.plan_id} but its content hashes to {expected}: "
                            f"it was edited after it was built; {rebuild}")
        return plan


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)

