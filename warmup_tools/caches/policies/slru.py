"""LRU plus heat: a segmented LRU (SLRU), the tokenizer cache's policy."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Hashable

if TYPE_CHECKING:
    from warmup_tools.caches.policies.settings import EvictionSettings


class SegmentedLRUPolicy:
    """New entries enter a *probation* segment; an entry hit again moves to the *protected* segment
    (``slru_protected_share`` of the budget). Eviction takes the least recently used probation entry
    first, so a burst of one-off prompts cannot flush the entries that are hit again and again; protected
    entries that overflow their share drop back to probation rather than out.
    """

    def __init__(self, budget_bytes: int, settings: EvictionSettings) -> None:
        self.protected_budget = int(budget_bytes * settings.protected_share)
        self._probation: OrderedDict[Hashable, int] = OrderedDict()  # key -> bytes, oldest first
        self._protected: OrderedDict[Hashable, int] = OrderedDict()
        self._protected_bytes = 0

    def on_insert(self, key: Hashable, size: int, now: float) -> None:
        self._probation[key] = size

    def on_access(self, key: Hashable, now: float) -> None:
        if key in self._protected:
            self._protected.move_to_end(key)
            return
        size = self._probation.pop(key)
        self._protected[key] = size
        self._protected_bytes += size
        while self._protected_bytes > self.protected_budget and len(self._protected) > 1:
            demoted, demoted_size = self._protected.popitem(last=False)
            self._protected_bytes -= demoted_size
            self._probation[demoted] = demoted_size

    def on_remove(self, key: Hashable) -> None:
        if self._probation.pop(key, None) is None:
            self._protected_bytes -= self._protected.pop(key)

    def victim(self, now: float) -> Hashable:
        return next(iter(self._probation or self._protected))
