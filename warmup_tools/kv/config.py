"""The KV prefix cache's settings, and what a token of KV costs in bytes.

The defaults below are the only ones in the package: ``lora_adapter`` reads its ``config.pbtxt``
parameters into a :class:`KVCacheConfig` (see :mod:`warmup_tools.lora_adapter.settings`), and the planner
and the stanza writer read the same file through the same code, so a plan is sized for the cache that
will hold it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from warmup_tools.common.settings import check_settings, setting
from warmup_tools.kv.blocks import BLOCK_EVICTION_POLICIES
from warmup_tools.kv.events import DEFAULT_WINDOW_BLOCKS

#: Bytes of KV per instance (256 MiB).
DEFAULT_BUDGET_BYTES = 256 << 20
#: Tokens per block: a prefix is cached and matched in whole blocks.
DEFAULT_BLOCK_SIZE = 16
#: Share of the budget reserved for live traffic: warm-up may not fill it.
DEFAULT_LIVE_RESERVE = 0.15
DEFAULT_STORAGE = "fp"
DEFAULT_EVICTION = "lfu_ttl"
DEFAULT_TTL_S = 3600.0
#: Seconds a warm-up block stays pinned when its plan names no retention of its own (docs/planner.md,
#: "Pins that expire"): then it is an ordinary block of the live eviction policy.
DEFAULT_PIN_RETENTION_S = 600.0
#: Whether a hit on a pinned block pushes its deadline to the hit plus its retention (SGLang's soft retention)
#: or the deadline stays where the pin set it (TensorRT-LLM's retention duration). On: measured in docs/planner.md.
DEFAULT_PIN_REFRESH_ON_HIT = True
#: Share of the budget warm-up blocks may hold at most (with ``kv_live_reserve``, the smaller cap wins).
DEFAULT_WARM_SHARE = 0.5
#: Seconds of the live check's window: pins that gave fewer block hits than the blocks evicted for them
#: would have given are released (0: no check).
DEFAULT_PIN_CHECK_S = 60.0

#: Bytes per stored value and per block of values, by ``kv_storage``: fp keeps the model's dtype, int8
#: keeps one byte per value plus an fp16 scale per (layer, k/v, head, channel) per block.
_SCALE_BYTES = 2


#: ``kv_storage`` values (each has a codec in :mod:`warmup_tools.kv.codecs`).
KV_STORAGES = ("fp", "int8")


@dataclasses.dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """One instance's KV prefix cache (the ``kv_*`` parameters of ``lora_adapter``)."""

    budget_bytes: int = setting(DEFAULT_BUDGET_BYTES, "Bytes of KV blocks (payload and token ids) one instance "
                                "keeps; 0 turns the prefix cache off.", parameter="kv_cache_bytes", ge=0)
    block_size: int = setting(DEFAULT_BLOCK_SIZE, "Tokens per KV block: prefixes are cached and matched in whole "
                              "blocks.", parameter="kv_block_size", ge=1, le=4096)
    storage: str = setting(DEFAULT_STORAGE, "How blocks are stored: fp keeps the model's dtype, int8 one byte per "
                           "value plus a scale per channel.", parameter="kv_storage", choices=KV_STORAGES)
    eviction: str = setting(DEFAULT_EVICTION, "Which unpinned block goes first when the budget is full.",
                            parameter="kv_eviction", choices=tuple(BLOCK_EVICTION_POLICIES))
    ttl_s: float = setting(DEFAULT_TTL_S, "Seconds after its last use when a live block counts as expired "
                           "(lfu_ttl evicts expired blocks first).", parameter="kv_ttl_s", gt=0)
    live_reserve: float = setting(DEFAULT_LIVE_RESERVE, "Share of kv_cache_bytes kept for live traffic: warm-up "
                                  "blocks may fill the rest.", parameter="kv_live_reserve", ge=0, lt=1)
    warm_share: float = setting(DEFAULT_WARM_SHARE, "Share of kv_cache_bytes warm-up blocks may hold at most (the "
                                "smaller of this and 1 - kv_live_reserve).", parameter="kv_warm_share", ge=0, le=1)
    pin_retention_s: float = setting(DEFAULT_PIN_RETENTION_S, "Seconds a warmed block stays pinned when its plan item "
                                     "names no retention; then it is an ordinary block of the eviction policy.",
                                     parameter="kv_pin_retention_s", gt=0)
    pin_refresh_on_hit: bool = setting(DEFAULT_PIN_REFRESH_ON_HIT, "A hit on a pinned block moves its deadline to "
                                       "the hit plus its retention.", parameter="kv_pin_refresh_on_hit")
    pin_check_s: float = setting(DEFAULT_PIN_CHECK_S, "Window of the live check: when pinned blocks gave fewer hits "
                                 "than the blocks evicted for them would have, the plan's pins are released (0: off).",
                                 parameter="kv_pin_check_s", ge=0)

    events_window_blocks: int = setting(DEFAULT_WINDOW_BLOCKS, "Blocks of KV events (stored, removed, unpinned, "
                                        "cleared) kept for a router that reconnects (the replay window); 0: no events.",
                                        parameter="kv_events_window_blocks", ge=0, le=1 << 22)

    def __post_init__(self) -> None:
        check_settings(self)

    @property
    def warmup_budget_bytes(self) -> int:
        """Bytes warm-up may hold: the budget less the share reserved for live traffic."""
        return warmup_budget(self.budget_bytes, self.live_reserve, self.warm_share)


def warmup_budget(budget_bytes: int, live_reserve: float, warm_share: float = DEFAULT_WARM_SHARE) -> int:
    """Bytes warm-up may hold: the budget times the smaller of ``warm_share`` and ``1 - live_reserve``."""
    return int(budget_bytes * min(warm_share, 1.0 - live_reserve))


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
