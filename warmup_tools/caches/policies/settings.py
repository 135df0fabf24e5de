"""The knobs of the local caches' eviction policies, each read by its policy only (the policies are built as
``cls(budget_bytes, settings)``: :data:`warmup_tools.caches.policies.EVICTION_POLICIES`)."""

from __future__ import annotations

import dataclasses

from warmup_tools.common.settings import check_settings, setting


@dataclasses.dataclass(frozen=True, slots=True)
class EvictionSettings:
    """The knobs of the local caches' eviction policies (:mod:`warmup_tools.caches.policies`); each applies
    to its policy only."""

    protected_share: float = setting(0.8, "slru: share of cache_bytes kept for entries hit again (the protected "
                                          "segment); the rest holds entries seen once.",
                                     parameter="slru_protected_share", ge=0, lt=1)
    half_life_s: float = setting(600.0, "decayed_lfu: an entry's hit count halves every this many seconds "
                                        "without hits.", parameter="lfu_half_life_s", gt=0)
    sample_size: int = setting(16, "decayed_lfu: entries sampled per eviction (the least frequently used of "
                                   "them goes), as in Redis's allkeys-lfu.",
                               parameter="lfu_sample_size", ge=1, le=1024)

    def __post_init__(self) -> None:
        check_settings(self)
