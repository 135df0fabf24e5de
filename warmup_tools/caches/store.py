"""The local cache: one byte-bounded store, with its eviction policy chosen by name.

Like vLLM's block pool beside its eviction queue and LMCache's storage interface beside one file per
policy, the store owns what every local cache needs (the lock, byte accounting against the budget, the
statistics, get and put) and asks an :class:`~warmup_tools.caches.policies.EvictionPolicy` which entry goes
first. Policies are chosen from :data:`~warmup_tools.caches.policies.EVICTION_POLICIES` (``eviction`` of each
cache model).

Every cache has a byte budget and evicts to stay within it, so a flood of unique prompts cannot grow a
process without bound. An entry costs its value (a ``sizeof`` function), its key (a tenant id is client
input: a 256 KiB one must cost 256 KiB) and a fixed bookkeeping overhead.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from typing import Callable, Generic, Hashable, TypeVar

import numpy as np

from warmup_tools.caches.policies import EVICTION_POLICIES, EvictionPolicy
from warmup_tools.caches.policies.settings import EvictionSettings
from warmup_tools.common.errors import ConfigError

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: Bookkeeping cost of one entry (dict slot, list node), added to its value's and key's sizes.
ENTRY_OVERHEAD_BYTES = 128


@dataclasses.dataclass(slots=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    entries: int = 0
    bytes_used: int = 0

    @property
    def hit_ratio(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class LocalCache(Generic[K, V]):
    """A thread-safe map bounded by bytes; ``eviction`` names the policy that picks each victim.

    ``settings`` holds the policies' knobs (their defaults when None); ``clock`` gives the policies their
    time (tests pass a fake one).
    """

    def __init__(self, budget_bytes: int, eviction: str, settings: EvictionSettings | None = None, *,
                 sizeof: Callable[[V], int] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        if eviction not in EVICTION_POLICIES:
            raise ConfigError(f"unknown eviction policy {eviction!r}; known: {', '.join(EVICTION_POLICIES)}")
        self.budget_bytes = budget_bytes
        self.eviction = eviction
        self.policy: EvictionPolicy = EVICTION_POLICIES[eviction](budget_bytes, settings or EvictionSettings())
        self.stats = CacheStats()
        self._sizeof = sizeof or sizeof_value
        self._clock = clock
        self._entries: dict[K, tuple[V, int]] = {}  # key -> (value, bytes charged)
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.stats.misses += 1
                return None
            self.policy.on_access(key, self._clock())
            self.stats.hits += 1
            return entry[0]

    def put(self, key: K, value: V) -> bool:
        """Store ``value`` (replacing ``key``'s); False when it alone is larger than the budget (not stored)."""
        size = self._sizeof(value) + sizeof_value(key) + ENTRY_OVERHEAD_BYTES
        with self._lock:
            self._discard(key)
            if size <= self.budget_bytes:
                while self.stats.bytes_used + size > self.budget_bytes and self._entries:
                    victim = self.policy.victim(self._clock())
                    if not self._discard(victim):  # NOTE: loud, or the budget would no longer hold
                        raise RuntimeError(f"eviction policy {self.eviction!r} named {victim!r}, not a cached key")
                    self.stats.evictions += 1
                self._entries[key] = (value, size)
                self.stats.bytes_used += size
                self.policy.on_insert(key, size, self._clock())
            self.stats.entries = len(self._entries)
            return size <= self.budget_bytes

    def evict(self, key: K) -> bool:
        """Drop ``key``; False when it was not cached (not counted as an eviction: the caller chose it)."""
        with self._lock:
            found = self._discard(key)
            self.stats.entries = len(self._entries)
            return found

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def _discard(self, key: K) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.stats.bytes_used -= entry[1]
        self.policy.on_remove(key)
        return True


def sizeof_value(value: object) -> int:
    """Approximate bytes held by a cached value (numpy arrays, bytes, str, tuples of ints)."""
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, (bytes, bytearray, str)):
        return len(value)
    if isinstance(value, tuple):
        return sys.getsizeof(value) + sum(sizeof_value(v) for v in value)
    return sys.getsizeof(value)
