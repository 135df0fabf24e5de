"""Bounded in-process caches.

Every cache here has a byte budget and evicts to stay within it, so a flood of unique prompts cannot
grow a process without bound. Sizes are estimated from the stored values by a ``sizeof`` function.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

import numpy as np

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: Bookkeeping cost of one entry (key object, dict slot, list node), added to each value's size.
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
        size = self._sizeof(value) + ENTRY_OVERHEAD_BYTES
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
