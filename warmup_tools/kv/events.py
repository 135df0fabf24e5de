"""KV events: what one instance's prefix cache does, numbered, for a router that routes on cache state.

Like vLLM's KV events (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` on a ZMQ publisher with a replay
buffer) and the smg gRPC protocol's ``SubscribeKvEvents`` (:mod:`warmup_tools.smg_worker`): every change to the
set of cached blocks is one :class:`KvEvent` with a sequence number, 1, 2, 3, ... for the life of the cache.

- ``stored``: blocks cached, parents before children, by live traffic (``live``), by warm-up (``warmup``:
  ``model_warmup`` stanzas, live plans, the preload sidecar's prompts) or by a snapshot restore (``restore``);
- ``removed``: blocks dropped by the eviction policy (``evicted``, or ``expired``: past the TTL when evicted);
- ``unpinned``: blocks that stay cached but lost their warm-up pin (``plan_change``, ``expired`` at their
  retention, ``released`` by the live check or to make room for live traffic): no change for a router's index,
  but what the cache holds for how long changed;
- ``cleared``: every block dropped.

:class:`KvEventJournal` keeps the last ``window_blocks`` blocks' worth of events (the replay window): a subscriber
that reconnects with the last sequence number it applied resumes without losing one; one whose number fell out of
the window (or that starts late) is answered with the full state instead (:meth:`KvEventJournal.read` says which),
which the cache makes (:meth:`~warmup_tools.kv.prefix_cache.PrefixCache.event_state`). Bounded: a flood of unique
prompts moves the window, never grows it.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Callable

from warmup_tools.kv.hashing import BlockHash

#: Event kinds, in the order of the module docstring.
EVENT_KINDS = ("stored", "removed", "unpinned", "cleared")
#: Why blocks were stored, removed or unpinned.
STORE_SOURCES = ("live", "warmup", "restore")
REMOVE_REASONS = ("evicted", "expired")
UNPIN_REASONS = ("plan_change", "expired", "released")
#: Blocks of events the journal keeps by default (about 64 bytes of token ids and hash per block, plus overhead).
DEFAULT_WINDOW_BLOCKS = 16384


@dataclasses.dataclass(frozen=True, slots=True)
class EventBlock:
    """One block of a ``stored`` event: its hash, its token ids (empty when the cache did not keep them), the
    adapter (``owner``, "" for the base model) and tenant (``tenant``; the public marker inside a public prefix)
    its hash was computed under."""

    block_hash: BlockHash
    tokens: tuple[int, ...] = ()
    owner: str = ""
    tenant: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class KvEvent:
    """One numbered change. ``blocks`` (stored), ``hashes`` (removed, unpinned), ``parent`` (stored: the block
    before the first one, None at the root), ``reason`` (a :data:`STORE_SOURCES`, :data:`REMOVE_REASONS` or
    :data:`UNPIN_REASONS` entry; "" for cleared)."""

    seq: int
    kind: str
    reason: str = ""
    blocks: tuple[EventBlock, ...] = ()
    hashes: tuple[BlockHash, ...] = ()
    parent: BlockHash | None = None
    timestamp: float = 0.0

    @property
    def size(self) -> int:
        """What the event counts against the window: its blocks (at least 1)."""
        return max(1, len(self.blocks) + len(self.hashes))


@dataclasses.dataclass(frozen=True, slots=True)
class JournalRead:
    """What :meth:`KvEventJournal.read` found after a sequence number: the events, and ``resync`` True when the
    number is outside the window (older than its first event, or ahead of the last: another cache's number), so
    the reader must take the full state instead."""

    events: tuple[KvEvent, ...]
    resync: bool
    last_seq: int


class KvEventJournal:
    """The numbered events of one cache with a bounded replay window; thread-safe. The cache appends under its own
    lock (:meth:`append`), readers wait on a condition (:meth:`read` with ``timeout_s``)."""

    def __init__(self, window_blocks: int = DEFAULT_WINDOW_BLOCKS, *, first_seq: int | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        """``first_seq``: the number of the first event; by default the wall clock in milliseconds, so that a
        restarted cache numbers past the one before it and a subscriber's old number asks for a resync, never
        for events of another life of the cache."""
        if window_blocks < 1:
            raise ValueError("window_blocks must be >= 1")
        first = int(clock() * 1000) if first_seq is None else first_seq
        if first < 1:
            raise ValueError("first_seq must be >= 1")
        self.window_blocks = window_blocks
        self._clock = clock
        self._events: collections.deque[KvEvent] = collections.deque()
        self._blocks = 0
        self._seq = first - 1
        self._cond = threading.Condition()
        #: Events dropped from the window so far (a subscriber that fell behind them must resync).
        self.dropped = 0

    @property
    def last_seq(self) -> int:
        return self._seq

    @property
    def last_timestamp(self) -> float:
        """When the last event was recorded (now, before the first)."""
        with self._cond:
            return self._events[-1].timestamp if self._events else self._clock()

    @property
    def first_seq(self) -> int:
        """The oldest event still in the window (``last_seq + 1`` when it is empty)."""
        with self._cond:
            return self._events[0].seq if self._events else self._seq + 1

    def append(self, kind: str, reason: str = "", *, blocks: tuple[EventBlock, ...] = (),
               hashes: tuple[BlockHash, ...] = (), parent: BlockHash | None = None) -> int:
        """Number and keep one event; returns its sequence number."""
        with self._cond:
            self._seq += 1
            event = KvEvent(self._seq, kind, reason, blocks, hashes, parent, self._clock())
            self._events.append(event)
            self._blocks += event.size
            while self._blocks > self.window_blocks and len(self._events) > 1:
                self._blocks -= self._events.popleft().size
                self.dropped += 1
            self._cond.notify_all()
            return event.seq

    def read(self, after: int, *, max_events: int = 256, timeout_s: float = 0.0) -> JournalRead:
        """Events numbered after ``after`` (at most ``max_events``), waiting up to ``timeout_s`` for one when there
        is none yet. ``resync`` when ``after`` is outside the window (see :class:`JournalRead`)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if after > self._seq or (after < self._seq and (not self._events or after + 1 < self._events[0].seq)):
                    return JournalRead((), True, self._seq)
                if after < self._seq:
                    start = after + 1 - self._events[0].seq
                    events = tuple(self._events[i] for i in range(start, min(len(self._events), start + max_events)))
                    return JournalRead(events, False, self._seq)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return JournalRead((), False, self._seq)
                self._cond.wait(remaining)

    def wake(self) -> None:
        """Wake every waiting reader (a subscriber closing)."""
        with self._cond:
            self._cond.notify_all()
