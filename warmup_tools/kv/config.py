"""The KV prefix cache's settings, and what a token of KV costs in bytes.

The defaults below are the only ones in the package: ``lora_adapter`` reads its ``config.pbtxt``
parameters into a :class:`KVCacheConfig` (see :mod:`warmup_tools.lora_adapter.settings`), and the planner
and the stanza writer read the same file through the same code, so a plan is sized for the cache that
will hold it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

#: Bytes of KV per instance (256 MiB).
DEFAULT_BUDGET_BYTES = 256 << 20
#: Tokens per block: a prefix is cached and matched in whole blocks.
DEFAULT_BLOCK_SIZE = 16
#: Share of the budget reserved for live traffic: warm-up may not fill it.
DEFAULT_LIVE_RESERVE = 0.15
DEFAULT_STORAGE = "fp"
DEFAULT_EVICTION = "lfu_ttl"
DEFAULT_TTL_S = 3600.0

#: Bytes per stored value and per block of values, by ``kv_storage``: fp keeps the model's dtype, int8
#: keeps one byte per value plus an fp16 scale per (layer, k/v, head, channel) per block.
_SCALE_BYTES = 2


@dataclasses.dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """One instance's KV prefix cache; ``budget_bytes`` 0 disables it."""

    budget_bytes: int = DEFAULT_BUDGET_BYTES
    block_size: int = DEFAULT_BLOCK_SIZE
    storage: str = DEFAULT_STORAGE
    eviction: str = DEFAULT_EVICTION
    ttl_s: float = DEFAULT_TTL_S
    live_reserve: float = DEFAULT_LIVE_RESERVE

    @property
    def warmup_budget_bytes(self) -> int:
        """Bytes warm-up may hold: the budget less the share reserved for live traffic."""
        return warmup_budget(self.budget_bytes, self.live_reserve)


def warmup_budget(budget_bytes: int, live_reserve: float) -> int:
    return int(budget_bytes * (1.0 - live_reserve))


@dataclasses.dataclass(frozen=True, slots=True)
class KVShape:
    """What one token's KV holds, from a Hugging Face model config."""

    layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_model_config(cls, config: Mapping[str, Any]) -> KVShape:
        """From ``config.json``'s fields; raises KeyError/TypeError/ValueError naming a missing one."""
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        return cls(layers, kv_heads, head_dim)

    def values_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim

    def bytes_per_token(self, storage: str, dtype_bytes: int, block_size: int) -> float:
        """Bytes one cached token takes with ``storage`` (int8: one byte, plus its share of the scales)."""
        if storage == "fp":
            return float(self.values_per_token() * dtype_bytes)
        if storage == "int8":
            scales_per_block = 2 * self.layers * self.kv_heads * self.head_dim
            return self.values_per_token() + scales_per_block * _SCALE_BYTES / block_size
        raise ValueError(f"unknown kv_storage {storage!r}; use fp or int8")
