"""Eviction policies of the local caches, chosen by name (``eviction`` of ``tokenizer_cache`` and
``embedding_cache``).

A policy only orders keys: :class:`~warmup_tools.caches.store.LocalCache` holds the values, the lock, the
byte accounting and the statistics, tells the policy what was inserted, hit and removed, and asks it for
a victim while an insert would overflow the budget. Each policy is one class in its own module, built as
``cls(budget_bytes, settings)``; adding one is that class and a line in :data:`EVICTION_POLICIES`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Hashable, Protocol

from warmup_tools.caches.policies.decayed_lfu import DecayedLFUPolicy
from warmup_tools.caches.policies.lru import LRUPolicy
from warmup_tools.caches.policies.slru import SegmentedLRUPolicy

if TYPE_CHECKING:
    from warmup_tools.caches.policies.settings import EvictionSettings


class EvictionPolicy(Protocol):
    """Tracks the cached keys and names the next victim; called under the store's lock."""

    def on_insert(self, key: Hashable, size: int, now: float) -> None:
        """``key`` was stored, charged ``size`` bytes (it was not cached: a replacement is removed first)."""

    def on_access(self, key: Hashable, now: float) -> None:
        """``key`` was hit."""

    def on_remove(self, key: Hashable) -> None:
        """``key`` left the cache (evicted, replaced or dropped)."""

    def victim(self, now: float) -> Hashable:
        """The cached key to evict next (called only while the cache holds at least one)."""


#: ``eviction`` name -> policy class; the ``eviction`` settings take their ``choices`` from here.
EVICTION_POLICIES: dict[str, Callable[[int, "EvictionSettings"], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "slru": SegmentedLRUPolicy,
    "decayed_lfu": DecayedLFUPolicy,
}
