"""Block metadata and eviction policies of the KV prefix cache (vLLM's block pool, SGLang's evict policies).

Only evictable blocks (no running request holds them, no cached child depends on them, no active plan
pins them) are ever shown to a policy, so whatever a policy names is safe to drop. A pin is not forever: it
holds until its deadline (``pin_until``), then the block joins its policy like any other.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import OrderedDict
from typing import Callable, Mapping, Protocol

import numpy as np

from warmup_tools.kv.hashing import BlockHash


class BlockSource(str, enum.Enum):
    """Who stored a block: a live request, or warm-up (a model_warmup sample, an adapter preload)."""

    LIVE = "live"
    WARMUP = "warmup"


@dataclasses.dataclass(slots=True)
class CachedBlock:
    block_hash: BlockHash
    parent: BlockHash
    payload: object
    nbytes: int
    source: BlockSource
    created: float = 0.0
    last_access: float = 0.0
    #: The warm-up plan that pinned this block; None when not pinned.
    plan_id: str | None = None
    #: When the pin ends (the cache's clock): the block is then an ordinary block of the eviction policy.
    pin_until: float | None = None
    #: How long a pin of this block holds (its plan item's predicted reuse horizon; None: the cache's default).
    retention_s: float | None = None
    #: Who the block is accounted to (the adapter name; "" for the base model).
    owner: str = ""
    #: The tenant whose request wrote it (``PUBLIC_TENANT`` inside a public prefix; "" when unknown).
    tenant: str = ""
    hits: int = 0
    #: The block's token ids (int32), kept so a snapshot can re-derive its hash and recompute its KV;
    #: counted in ``nbytes``. None for a block stored without them (it is never written to a snapshot).
    tokens: np.ndarray | None = None
    #: Running requests using this block.
    ref_count: int = 0
    #: Cached blocks whose parent this block is.
    children: int = 0

    @property
    def evictable(self) -> bool:
        return self.ref_count == 0 and self.children == 0 and self.plan_id is None


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest cached block prefix of a request; holds a reference on each block until released."""

    hashes: tuple[BlockHash, ...]
    block_size: int
    #: How many of the matched blocks the active warm-up plan pins (the rest are live traffic's, evictable).
    planned: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.hashes) * self.block_size

    @property
    def planned_tokens(self) -> int:
        return self.planned * self.block_size

    def __len__(self) -> int:
        return len(self.hashes)


@dataclasses.dataclass(slots=True)
class PrefixCacheStats:
    lookups: int = 0
    query_blocks: int = 0
    hit_blocks: int = 0
    stored_blocks: int = 0
    evictions: int = 0
    expired_evictions: int = 0
    #: Blocks a store could not place (budget full of pinned or in-use blocks, or warm-up cap reached).
    rejected_blocks: int = 0
    #: Blocks a warm-up store asked to pin under a plan that was no longer the current one (a sample in
    #: flight across a live plan change): stored unpinned, the current plan's pins kept.
    stale_plan_blocks: int = 0
    #: Matches refused because the block was written for another tenant (never expected: the hashes carry
    #: the tenant; counted as a last line of defence, and the suite checks it stays 0).
    cross_tenant_hits: int = 0
    bytes_used: int = 0
    #: KV bytes of running sequences reserved against the same budget (not part of ``bytes_used``).
    running_bytes: int = 0
    warmup_bytes: int = 0
    pinned_bytes: int = 0
    blocks: int = 0
    #: Block hits on pinned blocks (a hit is one matched block of one lookup).
    pin_hits: int = 0
    #: Block hits that blocks evicted while pins held room would have given (the shadow list's hits).
    shadow_hits: int = 0
    #: Pins that ended at their deadline, and pins the live check released early.
    expired_pins: int = 0
    released_pins: int = 0
    #: Times the live check released a plan's pins (its pins cost more hits than they gave).
    pin_releases: int = 0
    bytes_by_owner: dict[str, int] = dataclasses.field(default_factory=dict)
    evictions_by_owner: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.query_blocks if self.query_blocks else 0.0


class BlockEvictionPolicy(Protocol):
    """Tracks the evictable blocks and names the next victim. ``add(block, cold=True)`` places a block
    first in line (a pin that ended without a hit: the plan's bet on it lost)."""

    def add(self, block: CachedBlock, cold: bool = False) -> None: ...

    def remove(self, block: CachedBlock) -> None: ...

    def touch(self, block: CachedBlock) -> None: ...

    def victim(self, now: float) -> BlockHash | None: ...


class BlockLRUPolicy:
    """Least recently used first."""

    def __init__(self, ttl_s: float = 0.0) -> None:
        self._order: OrderedDict[BlockHash, None] = OrderedDict()

    def add(self, block: CachedBlock, cold: bool = False) -> None:
        self._order[block.block_hash] = None
        if cold:
            self._order.move_to_end(block.block_hash, last=False)

    def remove(self, block: CachedBlock) -> None:
        self._order.pop(block.block_hash, None)

    def touch(self, block: CachedBlock) -> None:
        if block.block_hash in self._order:
            self._order.move_to_end(block.block_hash)

    def victim(self, now: float) -> BlockHash | None:
        return next(iter(self._order), None)


class BlockLFUWithTTLPolicy:
    """Least frequently used first, but anything idle longer than ``ttl_s`` goes before that.

    Frequencies are bucketed by powers of two (1, 2-3, 4-7, ...), oldest first within a bucket, so a
    victim is found in O(number of buckets) and a burst long ago cannot keep a block forever: once it
    has been idle for the TTL it is the first to go whatever its count.
    """

    _BUCKETS = 32

    def __init__(self, ttl_s: float = 3600.0) -> None:
        self.ttl_s = ttl_s
        self._by_age: OrderedDict[BlockHash, CachedBlock] = OrderedDict()
        self._buckets: list[OrderedDict[BlockHash, None]] = [OrderedDict() for _ in range(self._BUCKETS)]
        self._bucket_of: dict[BlockHash, int] = {}

    def add(self, block: CachedBlock, cold: bool = False) -> None:
        self._by_age[block.block_hash] = block
        self._by_age.move_to_end(block.block_hash, last=not cold)
        self._place(block, cold)

    def remove(self, block: CachedBlock) -> None:
        self._by_age.pop(block.block_hash, None)
        bucket = self._bucket_of.pop(block.block_hash, None)
        if bucket is not None:
            self._buckets[bucket].pop(block.block_hash, None)

    def touch(self, block: CachedBlock) -> None:
        if block.block_hash in self._by_age:
            self._by_age.move_to_end(block.block_hash)
            self._place(block)

    def victim(self, now: float) -> BlockHash | None:
        oldest = next(iter(self._by_age.values()), None)
        if oldest is None:
            return None
        if now - oldest.last_access > self.ttl_s:
            return oldest.block_hash
        for bucket in self._buckets:
            if bucket:
                return next(iter(bucket))
        return None

    def _place(self, block: CachedBlock, cold: bool = False) -> None:
        new = min(max(block.hits, 1).bit_length() - 1, self._BUCKETS - 1)
        old = self._bucket_of.get(block.block_hash)
        if old is not None:
            self._buckets[old].pop(block.block_hash, None)
        self._buckets[new][block.block_hash] = None
        if cold:
            self._buckets[new].move_to_end(block.block_hash, last=False)
        self._bucket_of[block.block_hash] = new


BLOCK_EVICTION_POLICIES: Mapping[str, Callable[[float], BlockEvictionPolicy]] = {
    "lfu_ttl": BlockLFUWithTTLPolicy,
    "lru": BlockLRUPolicy,
}
