"""One instance's KV events (:mod:`warmup_tools.kv.events`) as smg's ``SubscribeKvEvents`` stream.

The contract smg 1.13's subscriber holds a worker to (``../shared/ROUTER_NOTES.md``, read from its source and
checked against the binary):

- one batch per journal event, numbered with the event's sequence number; an event a stream does not publish
  goes out as an empty batch under its number, so the router never sees a gap it would try to replay;
- ``start_sequence_number`` 0: a state snapshot first (:class:`~common_pb2.KvSnapshotChunk` chunks, the first
  beginning with ``KvCacheCleared``, every cached block's ``KvBlocksStored`` parents before children, ``event_id``
  0, chunk numbers consecutive and ending at the number the state was taken at), then live events;
- a number inside the replay window: the events from that number on (inclusive: the router skips the one it
  applied); a number outside it (fallen out, or from a former life of the cache, which numbers from the wall
  clock): :class:`OutOfWindow`, which the servicer answers ``OUT_OF_RANGE`` before it sends headers, and the router
  clears the worker and resubscribes from 0;
- full blocks only, every block ``block_size`` tokens.

What a stream publishes (:class:`StreamScope`): smg hashes a request's tokens with no adapter or salt, and keeps one
index per model id. So a worker listener serves one model (the base model or one adapter), and its stream carries
only the blocks a request through it can hit: that model's blocks of the tenant its requests run as, and public
prefixes; ``lora_name`` and ``cache_salt`` stay unset (smg folds them into its hash, which no request carries).
``unpinned`` events change nothing a router indexes and go out as empty batches. A removal goes out only for a
block the stream published (:class:`KvEventStream` keeps their hashes: as many as the cache holds).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Sequence

from smg_grpc_proto.generated import common_pb2

from warmup_tools.kv.events import EventBlock, KvEvent, KvEventJournal
from warmup_tools.kv.hashing import PUBLIC_TENANT, BlockHash

#: Blocks per snapshot chunk (a chunk of 512 blocks of 16 tokens is about 60 KB on the wire).
SNAPSHOT_CHUNK_BLOCKS = 512
_U64 = 1 << 64


def to_int64(block_hash: BlockHash) -> int:
    """A block hash as the protocol's ``int64``: its last eight bytes, big-endian, signed (what vLLM would send for
    the same digest; smg uses it only as the node's identity)."""
    value = int.from_bytes(block_hash[-8:], "big")
    return value - _U64 if value >= 1 << 63 else value


class OutOfWindow(Exception):
    """The subscriber's number is outside the replay window: it must resubscribe from 0 (a state snapshot)."""


@dataclasses.dataclass(frozen=True, slots=True)
class StreamScope:
    """The blocks one worker listener publishes: those of ``owner`` (the adapter, "" for the base model) written for
    ``tenant`` (the tenant its requests run as) or inside a public prefix."""

    owner: str = ""
    tenant: str = "default"

    def admits(self, block: EventBlock) -> bool:
        return block.owner == self.owner and block.tenant in (self.tenant, PUBLIC_TENANT, "")


#: The full state of a cache: ``(sequence number, [(block, parent, source), ...])`` parents first
#: (:meth:`~warmup_tools.kv.prefix_cache.PrefixCache.event_state`).
StateFn = Callable[[], tuple[int, Sequence[tuple[EventBlock, BlockHash, str]]]]


class KvEventStream:
    """One subscription: :meth:`open` checks the start number (raises :class:`OutOfWindow`), :meth:`batches` yields
    the snapshot (start 0), then each event as it comes, until ``stopped()`` says so."""

    def __init__(self, journal: KvEventJournal, state: StateFn, scope: StreamScope, block_size: int,
                 start_seq: int) -> None:
        self.journal = journal
        self.state = state
        self.scope = scope
        self.block_size = block_size
        self.start_seq = start_seq
        self._published: set[int] = set()
        self._cursor = 0
        self._snapshot_due = False

    def open(self) -> None:
        """Check the start number before the servicer answers (``OUT_OF_RANGE`` must come before headers)."""
        if self.start_seq == 0:
            self._snapshot_due = True
            return
        if self.journal.read(self.start_seq - 1).resync:
            raise OutOfWindow(f"KV event {self.start_seq} is outside this worker's replay window (events "
                              f"{self.journal.first_seq} to {self.journal.last_seq}); resubscribe from 0")
        self._cursor = self.start_seq - 1

    def batches(self, stopped: Callable[[], bool], poll_s: float = 0.5) -> Iterator[common_pb2.KvEventBatch]:
        if self._snapshot_due:
            self._snapshot_due = False
            seq, blocks = self.state()
            self._cursor = seq
            yield from self.snapshot(seq, blocks)
        while not stopped():
            read = self.journal.read(self._cursor, timeout_s=poll_s)
            if read.resync:
                # NOTE: this subscriber fell out of the window while it read (a flood of events): it must start over.
                raise OutOfWindow("this subscriber fell behind the replay window; resubscribe from 0")
            for event in read.events:
                self._cursor = event.seq
                yield self.batch(event)

    def batch(self, event: KvEvent) -> common_pb2.KvEventBatch:
        """One journal event as a batch under its number (empty when this stream does not publish it)."""
        return common_pb2.KvEventBatch(sequence_number=event.seq, timestamp=event.timestamp,
                                       events=self.convert(event))

    def convert(self, event: KvEvent) -> list[common_pb2.KvCacheEvent]:
        if event.kind == "stored":
            stored = self._stored(event.blocks, event.parent)
            return [common_pb2.KvCacheEvent(event_id=event.seq, stored=stored)] if stored is not None else []
        if event.kind == "removed":
            gone = [h for h in map(to_int64, event.hashes) if h in self._published]
            self._published.difference_update(gone)
            return [common_pb2.KvCacheEvent(event_id=event.seq, removed=common_pb2.KvBlocksRemoved(
                block_hashes=gone))] if gone else []
        if event.kind == "cleared":
            self._published.clear()
            return [common_pb2.KvCacheEvent(event_id=event.seq, cleared=common_pb2.KvCacheCleared())]
        return []  # unpinned: the block stays cached; nothing a router indexes changed

    def snapshot(self, seq: int, blocks: Sequence[tuple[EventBlock, BlockHash, str]]
                 ) -> Iterator[common_pb2.KvEventBatch]:
        """The state at ``seq`` as snapshot chunks numbered up to ``seq``."""
        self._published.clear()
        events = [common_pb2.KvCacheEvent(event_id=0, cleared=common_pb2.KvCacheCleared())]
        for block, parent, _source in blocks:
            stored = self._stored((block,), parent)
            if stored is not None:
                events.append(common_pb2.KvCacheEvent(event_id=0, stored=stored))
        published = len(events) - 1
        chunks = [events[i:i + SNAPSHOT_CHUNK_BLOCKS] for i in range(0, len(events), SNAPSHOT_CHUNK_BLOCKS)]
        count = len(chunks)
        first = max(1, seq - count + 1)
        for index, chunk in enumerate(chunks):
            yield common_pb2.KvEventBatch(
                sequence_number=first + index, timestamp=self.journal.last_timestamp, events=chunk,
                snapshot=common_pb2.KvSnapshotChunk(index=index, count=count, blocks=published, unknown_before=0))

    def _stored(self, blocks: Sequence[EventBlock], parent: BlockHash | None) -> common_pb2.KvBlocksStored | None:
        out = []
        for block in blocks:
            # NOTE: a run stops at the first block this stream does not publish: its children are not reachable
            # through it either (a public prefix is followed by the tenant's own blocks, never the other way).
            if not self.scope.admits(block) or len(block.tokens) != self.block_size:
                break
            out.append(common_pb2.KvBlock(block_hash=to_int64(block.block_hash), token_ids=list(block.tokens),
                                          block_size=self.block_size))
        if not out:
            return None
        self._published.update(b.block_hash for b in out)
        stored = common_pb2.KvBlocksStored(blocks=out)
        if parent is not None and to_int64(parent) in self._published:
            stored.parent_block_hash = to_int64(parent)
        return stored
