"""Which port serves which model: the base model on slot 0 (``grpc_worker_port``), each live adapter on one of the
next slots, stable while it is live.

NOTE: smg 1.13 sets no adapter field on a Generate request: a worker URL is one model, so each adapter needs a
listener of its own. A router keeps a registered URL's model: an adapter keeps its slot while it is live, gets
its previous slot back when it returns and that slot is free, and a freed slot goes to a new adapter only after
the slots never used (so a URL names one model for as long as it can).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable


@dataclasses.dataclass(frozen=True, slots=True)
class SlotChanges:
    """What one :meth:`SlotTable.update` changed: ``(slot, adapter)`` pairs to open and to close."""

    opened: tuple[tuple[int, str], ...] = ()
    closed: tuple[tuple[int, str], ...] = ()


class SlotTable:
    """The adapters' slots, ``1 .. size - 1`` (slot 0 is the base model's)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"at least one slot (the base model's), not {size}")
        self.size = size
        self._by_adapter: dict[str, int] = {}
        #: Each slot's last adapter, and the order slots were freed in (oldest first).
        self._last: dict[int, str] = {}
        self._freed: list[int] = []
        self._next_unused = 1
        #: Live adapters with no slot (more than ``size - 1`` at once), in arrival order.
        self.unplaced: tuple[str, ...] = ()

    def slot_of(self, adapter: str) -> int | None:
        return self._by_adapter.get(adapter)

    def assigned(self) -> dict[str, int]:
        """Each placed adapter's slot."""
        return dict(self._by_adapter)

    def update(self, live: Iterable[str]) -> SlotChanges:
        """Follow the live adapters now: close the slots of those no longer live, place the new ones."""
        wanted = list(dict.fromkeys(live))
        wanted_set = set(wanted)
        closed = []
        for adapter, slot in sorted(self._by_adapter.items(), key=lambda item: item[1]):
            if adapter not in wanted_set:
                del self._by_adapter[adapter]
                self._last[slot] = adapter
                self._freed.append(slot)
                closed.append((slot, adapter))
        opened = []
        unplaced = []
        for adapter in wanted:
            if adapter in self._by_adapter:
                continue
            slot = self._take(adapter)
            if slot is None:
                unplaced.append(adapter)
                continue
            self._by_adapter[adapter] = slot
            opened.append((slot, adapter))
        self.unplaced = tuple(unplaced)
        return SlotChanges(tuple(opened), tuple(closed))

    def _take(self, adapter: str) -> int | None:
        for slot in self._freed:  # its own slot, when it is free
            if self._last.get(slot) == adapter:
                self._freed.remove(slot)
                return slot
        if self._next_unused < self.size:
            slot = self._next_unused
            self._next_unused += 1
            return slot
        if self._freed:
            return self._freed.pop(0)
        return None
