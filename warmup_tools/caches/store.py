"""Bounded in-process caches.

Every cache here has a byte budget and evicts to stay within it, so a flood of unique prompts cannot
grow a process without bound. An entry costs its value (a ``sizeof`` function), its key (a tenant id is
client input: a 256 KiB one must cost 256 KiB) and a fixed bookkeeping overhead.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import threading
import time
from collections import OrderedDict
from typing import Callable, Generic, Hashable, Protocol, TypeVar

import numpy as np

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: Bookkeeping cost of one entry (dict slot, list node), added to its value's and key's sizes.
ENTRY_OVERHEAD_BYTES = 128


def sizeof_value(value: object) -> int:
    """Approximate bytes held by a cached value (numpy arrays, bytes, str, tuples of ints)."""
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, (bytes, bytearray, str)):
        return len(value)
    if isinstance(value, tuple):
        return sys.getsizeof(value) + sum(sizeof_value(v) for v in value)
    return sys.getsizeof(value)


class LocalCache(Protocol[K, V]):
    """What a tier of :class:`~warmup_tools.caches.redis_tier.TieredCache` needs from a local cache."""

    stats: "CacheStats"

    def get(self, key: K) -> V | None: ...

    def put(self, key: K, value: V) -> bool: ...


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


class LRUCache(Generic[K, V]):
    """A thread-safe least-recently-used map bounded by bytes."""

    def __init__(self, budget_bytes: int, sizeof: Callable[[V], int] = sizeof_value) -> None:
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        self.budget_bytes = budget_bytes
        self._sizeof = sizeof
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def get(self, key: K) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.stats.misses += 1
                return None
            self._items.move_to_end(key)
            self.stats.hits += 1
            return item[0]

    def put(self, key: K, value: V) -> bool:
        """Store ``value``; returns False when it alone is larger than the budget (not stored)."""
        size = self._sizeof(value) + sizeof_value(key) + ENTRY_OVERHEAD_BYTES
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.stats.bytes_used -= old[1]
            if size > self.budget_bytes:
                self.stats.entries = len(self._items)
                return False
            while self.stats.bytes_used + size > self.budget_bytes and self._items:
                _, (_, evicted) = self._items.popitem(last=False)
                self.stats.bytes_used -= evicted
                self.stats.evictions += 1
            self._items[key] = (value, size)
            self.stats.bytes_used += size
            self.stats.entries = len(self._items)
            return True

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items


class SegmentedLRUCache(Generic[K, V]):
    """LRU plus heat: a segmented LRU (SLRU) bounded by bytes.

    New entries enter a *probation* segment; an entry hit again moves to the *protected* segment
    (``protected_share`` of the budget). Eviction takes the least recently used probation entry first,
    so a burst of one-off prompts cannot flush the entries that are hit again and again; protected
    entries that overflow their share drop back to probation rather than out.
    """

    def __init__(self, budget_bytes: int, sizeof: Callable[[V], int] = sizeof_value,
                 protected_share: float = 0.8) -> None:
        if budget_bytes < 0 or not 0.0 <= protected_share < 1.0:
            raise ValueError("budget_bytes >= 0 and 0 <= protected_share < 1 are required")
        self.budget_bytes = budget_bytes
        self.protected_budget = int(budget_bytes * protected_share)
        self._sizeof = sizeof
        self._probation: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._protected: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._protected_bytes = 0
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def get(self, key: K) -> V | None:
        with self._lock:
            item = self._protected.get(key)
            if item is not None:
                self._protected.move_to_end(key)
            else:
                item = self._probation.pop(key, None)
                if item is None:
                    self.stats.misses += 1
                    return None
                self._protected[key] = item
                self._protected_bytes += item[1]
                self._demote_overflow()
            self.stats.hits += 1
            return item[0]

    def put(self, key: K, value: V) -> bool:
        size = self._sizeof(value) + sizeof_value(key) + ENTRY_OVERHEAD_BYTES
        with self._lock:
            self._remove(key)
            if size > self.budget_bytes:
                self._sync()
                return False
            while self.stats.bytes_used + size > self.budget_bytes:
                segment = self._probation if self._probation else self._protected
                _, (_, evicted) = segment.popitem(last=False)
                if segment is self._protected:
                    self._protected_bytes -= evicted
                self.stats.bytes_used -= evicted
                self.stats.evictions += 1
            self._probation[key] = (value, size)
            self.stats.bytes_used += size
            self._sync()
            return True

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __contains__(self, key: object) -> bool:
        return key in self._probation or key in self._protected

    def _remove(self, key: K) -> None:
        for segment in (self._probation, self._protected):
            item = segment.pop(key, None)
            if item is not None:
                self.stats.bytes_used -= item[1]
                if segment is self._protected:
                    self._protected_bytes -= item[1]

    def _demote_overflow(self) -> None:
        while self._protected_bytes > self.protected_budget and len(self._protected) > 1:
            key, item = self._protected.popitem(last=False)
            self._protected_bytes -= item[1]
            self._probation[key] = item

    def _sync(self) -> None:
        self.stats.entries = len(self)


class DecayedLFUCache(Generic[K, V]):
    """LFU with time decay, bounded by bytes.

    Each entry's count halves every ``half_life_s`` without hits, so yesterday's favourites fade. Like
    Redis's ``allkeys-lfu``, eviction samples ``sample_size`` entries and drops the one with the lowest
    decayed count: O(sample) per eviction instead of a global ordering.
    """

    def __init__(self, budget_bytes: int, sizeof: Callable[[V], int] = sizeof_value, *,
                 half_life_s: float = 600.0, sample_size: int = 16, clock: Callable[[], float] | None = None,
                 seed: int = 0) -> None:
        self.budget_bytes = budget_bytes
        self.half_life_s = half_life_s
        self.sample_size = sample_size
        self._sizeof = sizeof
        self._clock = clock or time.monotonic
        self._rng = random.Random(seed)
        self._items: dict[K, list] = {}  # key -> [value, size, count, last_update]
        self._keys: list[K] = []
        self._index: dict[K, int] = {}
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def get(self, key: K) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.stats.misses += 1
                return None
            now = self._clock()
            item[2] = self._decayed(item, now) + 1.0
            item[3] = now
            self.stats.hits += 1
            return item[0]

    def put(self, key: K, value: V) -> bool:
        size = self._sizeof(value) + sizeof_value(key) + ENTRY_OVERHEAD_BYTES
        with self._lock:
            self._remove(key)
            if size > self.budget_bytes:
                return False
            now = self._clock()
            while self.stats.bytes_used + size > self.budget_bytes and self._keys:
                sample = [self._keys[self._rng.randrange(len(self._keys))] for _ in range(self.sample_size)]
                victim = min(sample, key=lambda k: self._decayed(self._items[k], now))
                self._remove(victim)
                self.stats.evictions += 1
            self._items[key] = [value, size, 1.0, now]
            self._index[key] = len(self._keys)
            self._keys.append(key)
            self.stats.bytes_used += size
            self.stats.entries = len(self._items)
            return True

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def _decayed(self, item: list, now: float) -> float:
        return item[2] * 0.5 ** ((now - item[3]) / self.half_life_s)

    def _remove(self, key: K) -> None:
        item = self._items.pop(key, None)
        if item is None:
            return
        # O(1) removal from the sampling list: move the last key into the hole.
        index = self._index.pop(key)
        last = self._keys.pop()
        if last != key:
            self._keys[index] = last
            self._index[last] = index
        self.stats.bytes_used -= item[1]
        self.stats.entries = len(self._items)
