"""LFU with time decay, sampled like Redis's ``allkeys-lfu``: the embedding cache's policy."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Hashable

if TYPE_CHECKING:
    from warmup_tools.caches.policies.settings import EvictionSettings


class DecayedLFUPolicy:
    """Each entry's count halves every ``lfu_half_life_s`` without hits, so yesterday's favourites fade.
    Eviction samples ``lfu_sample_size`` entries and drops the one with the lowest decayed count: O(sample)
    per eviction instead of a global ordering.
    """

    def __init__(self, budget_bytes: int, settings: EvictionSettings) -> None:
        self.half_life_s = settings.half_life_s
        self.sample_size = settings.sample_size
        # NOTE: seeded, so a run's evictions are the same on every run (benchmarks, tests).
        self._rng = random.Random(0)
        self._counts: dict[Hashable, tuple[float, float]] = {}  # key -> (count, time of that count)
        self._keys: list[Hashable] = []  # what victim() samples from
        self._index: dict[Hashable, int] = {}

    def on_insert(self, key: Hashable, size: int, now: float) -> None:
        self._counts[key] = (1.0, now)
        self._index[key] = len(self._keys)
        self._keys.append(key)

    def on_access(self, key: Hashable, now: float) -> None:
        self._counts[key] = (self._decayed(key, now) + 1.0, now)

    def on_remove(self, key: Hashable) -> None:
        del self._counts[key]
        # O(1) removal from the sampling list: move the last key into the hole.
        index = self._index.pop(key)
        last = self._keys.pop()
        if last != key:
            self._keys[index] = last
            self._index[last] = index

    def victim(self, now: float) -> Hashable:
        sample = [self._keys[self._rng.randrange(len(self._keys))] for _ in range(self.sample_size)]
        return min(sample, key=lambda k: self._decayed(k, now))

    def _decayed(self, key: Hashable, now: float) -> float:
        count, since = self._counts[key]
        return count * 0.5 ** ((now - since) / self.half_life_s)
