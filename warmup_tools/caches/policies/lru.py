"""Least recently used first."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Hashable

if TYPE_CHECKING:
    from warmup_tools.caches.policies.settings import EvictionSettings


class LRUPolicy:
    """Least recently used first: one ordering, oldest first."""

    def __init__(self, budget_bytes: int, settings: EvictionSettings) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def on_insert(self, key: Hashable, size: int, now: float) -> None:
        self._order[key] = None

    def on_access(self, key: Hashable, now: float) -> None:
        self._order.move_to_end(key)

    def on_remove(self, key: Hashable) -> None:
        del self._order[key]

    def victim(self, now: float) -> Hashable:
        return next(iter(self._order))
