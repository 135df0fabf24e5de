"""KV prefix cache: reuse the attention keys and values of prompt prefixes seen (or warmed) before.

Reads like vLLM's ``kv_cache_utils`` / ``block_pool`` and SGLang's ``radix_cache``:

* a prompt is cut into fixed-size token blocks, each full block named by a chained hash
  (:mod:`warmup_tools.kv.hashing`); the scope in the hash keeps tenants and adapters apart;
* a request reuses the KV of its longest cached block prefix and prefills only the rest;
* memory is a byte budget per instance. Warm-up may fill at most ``warm_share`` of it, and never the share
  reserved for live traffic (``live_reserve``). The KV of running sequences (the continuous-batching
  scheduler's) is counted against the same budget (:meth:`PrefixCache.reserve`): cached blocks are evicted
  to make room for it. Eviction is chosen from :data:`~warmup_tools.kv.blocks.BLOCK_EVICTION_POLICIES` (LFU with
  TTL by default); blocks in use by a running request and blocks that have cached children are never
  evicted (evicting a parent would strand its children);
* a block the active warm-up plan pins is a bounded, expiring priority, not a lock (TensorRT-LLM's retention
  priority with a duration, SGLang's soft retention, LMCache's retention TTL): it is not evicted until its
  deadline (its plan item's ``retention_s``, else ``pin_retention_s``, from when it was pinned; with
  ``pin_refresh_on_hit`` from its last hit), then it is an ordinary block of the eviction policy, first in
  line if it was never hit. Live traffic that cannot fit otherwise ends pins early, earliest deadline first:
  a pin never makes a request fail;
* a live check keeps pins honest (:meth:`PrefixCache.pin_report`): a shadow list holds the blocks evicted
  while pins held room (as many bytes as the pins hold: with the pins gone, those are the blocks that would
  still be cached), and a lookup that misses on a shadow block counts the hits it would have had. When, over a
  window of ``pin_check_s``, the shadow hits outnumber the hits on pinned blocks, every pin of the plan is
  released early: warm-up never costs live traffic its hit rate for longer than a window.

Block metadata and eviction policies are in :mod:`warmup_tools.kv.blocks`, storage codecs in
:mod:`warmup_tools.kv.codecs`.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import logging
import threading
import time
from typing import Any, Callable, Collection, Iterable, Sequence

import numpy as np

from warmup_tools.kv.arrays import Array, KVArrays, kv_arrays
from warmup_tools.kv.blocks import (
    BLOCK_EVICTION_POLICIES,
    BlockSource,
    CachedBlock,
    PrefixCacheStats,
    PrefixMatch,
)
from warmup_tools.kv.codecs import STORAGE_CODECS
from warmup_tools.kv.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_EVICTION,
    DEFAULT_LIVE_RESERVE,
    DEFAULT_PIN_CHECK_S,
    DEFAULT_PIN_REFRESH_ON_HIT,
    DEFAULT_PIN_RETENTION_S,
    DEFAULT_STORAGE,
    DEFAULT_TTL_S,
    DEFAULT_WARM_SHARE,
    warmup_budget,
)
from warmup_tools.kv.events import EventBlock, KvEventJournal
from warmup_tools.kv.hashing import NONE_HASH, PUBLIC_TENANT, BlockHash

LOGGER = logging.getLogger(__name__)

#: The live check decides only once a window has seen this many block hits (pinned and shadow together):
#: a window of a handful of lookups says nothing either way.
MIN_PIN_EVIDENCE_BLOCKS = 8
#: The owner key of the base model in pin reports (adapters go by their names).
BASE_OWNER = "base"


class PrefixCache:
    """Block-level KV prefix cache of one model instance; thread-safe."""

    def __init__(
        self,
        budget_bytes: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        live_reserve: float = DEFAULT_LIVE_RESERVE,
        eviction: str = DEFAULT_EVICTION,
        ttl_s: float = DEFAULT_TTL_S,
        storage: str = DEFAULT_STORAGE,
        clock: Callable[[], float] = time.monotonic,
        bytes_per_token: int | None = None,
        warm_share: float = DEFAULT_WARM_SHARE,
        pin_retention_s: float = DEFAULT_PIN_RETENTION_S,
        pin_refresh_on_hit: bool = DEFAULT_PIN_REFRESH_ON_HIT,
        pin_check_s: float = DEFAULT_PIN_CHECK_S,
        events: KvEventJournal | None = None,
        arrays: KVArrays | None = None,
    ) -> None:
        """``bytes_per_token``: what one cached token counts against the budget instead of its payload and token
        ids (a simulated engine's modelled KV size: its payloads are a few bytes); None: the stored bytes.
        ``clock``: seconds of the cache's time (TTLs, retention deadlines and the live check's window).
        ``events``: where every change to the cached blocks is numbered (:mod:`warmup_tools.kv.events`; None: not
        recorded). ``arrays``: the library of the forward's KV (:mod:`warmup_tools.kv.arrays`; None: torch)."""
        if budget_bytes < 0 or block_size < 1 or not 0.0 <= live_reserve < 1.0:
            raise ValueError("budget_bytes >= 0, block_size >= 1 and 0 <= live_reserve < 1 are required")
        if not 0.0 <= warm_share <= 1.0 or not pin_retention_s > 0 or not pin_check_s >= 0:
            raise ValueError("0 <= warm_share <= 1, pin_retention_s > 0 and pin_check_s >= 0 are required")
        if bytes_per_token is not None and bytes_per_token < 1:
            raise ValueError("bytes_per_token must be >= 1 (or None: the stored bytes)")
        try:
            self._policy = BLOCK_EVICTION_POLICIES[eviction](ttl_s)
            self._codec = STORAGE_CODECS[storage](arrays or kv_arrays("torch"))
        except KeyError as exc:
            raise ValueError(
                f"unknown {'eviction policy' if exc.args[0] == eviction else 'storage'} {exc.args[0]!r}; "
                f"eviction: {', '.join(BLOCK_EVICTION_POLICIES)}; storage: {', '.join(STORAGE_CODECS)}"
            ) from None
        self.budget_bytes = budget_bytes
        self.block_size = block_size
        self.live_reserve = live_reserve
        self.warm_share = warm_share
        self.pin_retention_s = pin_retention_s
        self.pin_refresh_on_hit = pin_refresh_on_hit
        self.pin_check_s = pin_check_s
        self.storage = storage
        #: Bytes every block counts (None: each block's stored bytes); see ``bytes_per_token``.
        self.block_bytes = None if bytes_per_token is None else bytes_per_token * block_size
        self.active_plan: str | None = None
        self.stats = PrefixCacheStats()
        self._clock = clock
        self._blocks: dict[BlockHash, CachedBlock] = {}
        self._tracked: set[BlockHash] = set()
        self._lock = threading.RLock()
        #: The last plan a stale pin action was logged for (one line per plan, not one per block).
        self._stale_logged: str | None = None
        #: Pin deadlines, earliest first: ``(pin_until, sequence, hash)``; an entry whose block was unpinned or
        #: re-pinned since is skipped (at most one live entry per pinned block, see :meth:`_expire_pins`).
        self._deadlines: list[tuple[float, int, BlockHash]] = []
        self._deadline_seq = 0
        #: Blocks whose pin under the active plan ended (expired or released): covered, never pinned again by
        #: that plan. Cleared when the plan changes.
        self._ended: set[BlockHash] = set()
        #: The shadow list: blocks evicted while pins held room, newest last, with their bytes and owner.
        self._shadow: collections.OrderedDict[BlockHash, tuple[int, str]] = collections.OrderedDict()
        self._shadow_bytes = 0
        self._pins = _PinCheck()
        self.events = events

    # ----------------------------------------------------------------------------------- public API
    @property
    def warmup_budget(self) -> int:
        """Bytes warm-up may hold: the budget less the share reserved for live traffic."""
        return warmup_budget(self.budget_bytes, self.live_reserve, self.warm_share)

    def match(self, hashes: Sequence[BlockHash], tenant: str | None = None) -> PrefixMatch:
        """The longest cached prefix of ``hashes``; each matched block is held until :meth:`release`.

        With ``tenant``, a block written for another tenant (not public) ends the match and is counted
        in ``stats.cross_tenant_hits``.
        """
        now = self._clock()
        with self._lock:
            self._expire_pins(now)
            matched: list[BlockHash] = []
            planned = 0
            missed = False
            for block_hash in hashes:
                block = self._blocks.get(block_hash)
                if block is None:
                    missed = True
                    break
                if tenant is not None and block.tenant not in ("", tenant, PUBLIC_TENANT):
                    self.stats.cross_tenant_hits += 1
                    break
                matched.append(block_hash)
                if block.plan_id is not None:
                    planned += 1
                    self._pins.hit(block.owner, 1, 0)
                    if self.pin_refresh_on_hit:
                        block.pin_until = max(block.pin_until or now, now + self._retention(block))
                block.hits += 1
                block.last_access = now
                block.ref_count += 1
                self._refresh(block, touched=True)
            if missed and self._shadow:
                # NOTE: a miss's blocks are missing from it to the end (a child is never cached without its
                # parent), so the shadow hits are the run of shadow blocks from the miss on.
                for block_hash in hashes[len(matched):]:
                    ghost = self._shadow.get(block_hash)
                    if ghost is None:
                        break
                    self._pins.hit(ghost[1], 0, 1)
                    self.stats.shadow_hits += 1
            self.stats.pin_hits += planned
            self._check_pins(now)
            self.stats.lookups += 1
            self.stats.query_blocks += len(hashes)
            self.stats.hit_blocks += len(matched)
            return PrefixMatch(tuple(matched), self.block_size, planned)

    def release(self, match: PrefixMatch) -> None:
        with self._lock:
            for block_hash in match.hashes:
                block = self._blocks.get(block_hash)
                if block is not None and block.ref_count > 0:
                    block.ref_count -= 1
                    self._refresh(block)

    def load(self, match: PrefixMatch, dtype: object) -> list[tuple[Array, Array]]:
        """Per layer ``(keys, values)`` of shape ``[1, kv_heads, match.num_tokens, head_dim]`` (new arrays)."""
        return self.arrays.join(self.load_blocks(match, dtype))

    def load_blocks(self, match: PrefixMatch, dtype: object) -> list[Array]:
        """Each matched block ``[layers, 2, kv_heads, block_size, head_dim]``, in order; read only (a block may be
        a view of what the cache holds)."""
        with self._lock:
            payloads = [self._blocks[h].payload for h in match.hashes]
        return [self._codec.decode(p, dtype) for p in payloads]

    def store(
        self,
        hashes: Sequence[BlockHash],
        layers: Sequence[tuple[Array, Array]],
        *,
        start_block: int = 0,
        source: BlockSource = BlockSource.LIVE,
        plan_id: str | None = None,
        owner: str = "",
        tenant: str = "",
        public_blocks: int = 0,
        tokens: Sequence[int] | None = None,
        retention_s: float | None = None,
    ) -> int:
        """Store blocks ``start_block..len(hashes)`` from per-layer KV ``[1, heads, >= n*bs, dim]``.

        ``tokens`` (the prompt's token ids) are kept with each new block (:attr:`CachedBlock.tokens`), so
        snapshots can re-derive and verify it; a block stored without them is never snapshotted.

        Returns how many new blocks were stored. Stops at the first block that does not fit, so the
        cache never holds a block whose parent it dropped. A warm-up store (``source=BlockSource.WARMUP``) stays
        within :attr:`warmup_budget`; with ``plan_id`` its blocks are pinned under that plan, which must be
        :attr:`active_plan` (with no plan active, the store activates it). A store for any other plan is a
        stale pin action (a warm-up sample still in flight when a live plan change made another plan
        current): its blocks are stored as ordinary live KV, unpinned, counted in
        ``stats.stale_plan_blocks`` and logged once per plan; it never moves the cache back to that plan.
        ``retention_s``: how long this store's pins hold (None: ``pin_retention_s``). A block whose pin under
        the plan ended already (expired, or released by the live check) is not pinned again by that plan.
        """
        if retention_s is not None and not 0 < retention_s < float("inf"):
            raise ValueError(f"retention_s must be a positive number of seconds, got {retention_s!r}")
        stored = 0
        now = self._clock()
        new_blocks: list[CachedBlock] = []
        with self._lock:
            self._expire_pins(now)
            plan_id, source = self._bind_plan(plan_id, source, len(hashes) - start_block)
            for index in range(start_block, len(hashes)):
                block_hash = hashes[index]
                existing = self._blocks.get(block_hash)
                pin = plan_id if plan_id is not None and self._may_pin(block_hash) else None
                if existing is not None:
                    existing.last_access = now
                    if pin is not None and existing.plan_id is None:
                        # NOTE: a live block a plan pins becomes warm-up KV, so it counts against the warm-up
                        # cap like a new one: pins never eat the live reserve.
                        if existing.source is not BlockSource.WARMUP:
                            if self.stats.warmup_bytes + existing.nbytes > self.warmup_budget:
                                self.stats.rejected_blocks += len(hashes) - index
                                break
                            existing.source = BlockSource.WARMUP
                            self.stats.warmup_bytes += existing.nbytes
                        existing.plan_id = plan_id
                        self.stats.pinned_bytes += existing.nbytes
                        self._set_deadline(existing, retention_s, now)
                    self._refresh(existing, touched=True)
                    continue
                payload, nbytes = self._codec.encode(self.arrays.block(layers, index, self.block_size))
                block_tokens = _block_tokens(tokens, index, self.block_size)
                if block_tokens is not None:
                    nbytes += block_tokens.nbytes
                if self.block_bytes is not None:
                    nbytes = self.block_bytes
                # NOTE: a block whose pin ended is cached as live KV: the plan had its chance on it.
                block_source = BlockSource.LIVE if plan_id is not None and pin is None else source
                if not self._make_room(nbytes, block_source):
                    self.stats.rejected_blocks += len(hashes) - index
                    break
                parent = hashes[index - 1] if index > 0 else NONE_HASH
                block = CachedBlock(block_hash, parent, payload, nbytes, block_source, now, now, plan_id=pin,
                                    owner=owner, tenant=PUBLIC_TENANT if index < public_blocks else tenant,
                                    tokens=block_tokens)
                if pin is not None:
                    self._set_deadline(block, retention_s, now)
                self._forget_shadow(block_hash)
                self._blocks[block_hash] = block
                parent_block = self._blocks.get(parent)
                if parent_block is not None:
                    parent_block.children += 1
                    self._refresh(parent_block)
                self._account(block, +1)
                self._refresh(block)
                stored += 1
                new_blocks.append(block)
            self.stats.stored_blocks += stored
            if new_blocks and self.events is not None:
                # NOTE: a store's new blocks are one run (a child is never cached without its parent).
                self.events.append("stored", source.value, blocks=tuple(_event_block(b) for b in new_blocks),
                                   parent=new_blocks[0].parent)
        return stored

    def restore(self, block: CachedBlock) -> bool:
        """Insert a block read back from a snapshot (verified by the caller), without evicting anything.

        Its parent must be cached already (or be the root): restore parents before children. False when
        it is cached already, its parent is missing, or it does not fit (the whole budget, or the warm-up
        cap for a warm-up block) without evicting: a restore never pushes out what is cached.
        A block with a ``plan_id`` is pinned only when that plan is :attr:`active_plan`.
        """
        with self._lock:
            if block.block_hash in self._blocks or (block.parent != NONE_HASH and block.parent not in self._blocks):
                return False
            if self.block_bytes is not None:
                # NOTE: a snapshot reader counts the payload it read; this cache counts its modelled size.
                block = dataclasses.replace(block, nbytes=self.block_bytes)
            if block.source is BlockSource.WARMUP and self.stats.warmup_bytes + block.nbytes > self.warmup_budget:
                return False
            if self.stats.bytes_used + self.stats.running_bytes + block.nbytes > self.budget_bytes:
                return False
            now = self._clock()
            pinned = block.plan_id is not None and block.plan_id == self.active_plan and self._may_pin(block.block_hash)
            block = dataclasses.replace(block, created=now, last_access=now, ref_count=0, children=0,
                                        plan_id=block.plan_id if pinned else None, pin_until=None)
            if pinned:
                self._set_deadline(block, block.retention_s, now)
            self._forget_shadow(block.block_hash)
            self._blocks[block.block_hash] = block
            parent_block = self._blocks.get(block.parent)
            if parent_block is not None:
                parent_block.children += 1
                self._refresh(parent_block)
            self._account(block, +1)
            self._refresh(block)
            self.stats.stored_blocks += 1
            if self.events is not None:
                self.events.append("stored", "restore", blocks=(_event_block(block),), parent=block.parent)
            return True

    def snapshot_blocks(self, budget_bytes: int) -> list[CachedBlock]:
        """Copies of the blocks a snapshot should hold, parents before children, within ``budget_bytes``.

        Pinned blocks (with a plan) first, then the others hottest first (hits, then recency); a block is
        taken only with its whole chain of ancestors (a child is useless without them), and only blocks
        that kept their token ids. The payloads are shared, not copied: a stored payload never changes.
        """
        with self._lock:
            blocks = {h: dataclasses.replace(b) for h, b in self._blocks.items() if b.tokens is not None}
        order = sorted(blocks.values(), key=lambda b: (b.plan_id is None, -b.hits, -b.last_access))
        chosen: dict[BlockHash, CachedBlock] = {}
        used = 0
        for block in order:
            chain: list[CachedBlock] = []
            cursor: CachedBlock | None = block
            while cursor is not None and cursor.block_hash not in chosen:
                chain.append(cursor)
                cursor = blocks.get(cursor.parent) if cursor.parent != NONE_HASH else None
                if cursor is None and chain[-1].parent != NONE_HASH:
                    chain = []  # an ancestor without token ids: the chain cannot be written
                    break
            cost = sum(b.nbytes for b in chain)
            if chain and used + cost <= budget_bytes:
                for b in chain:
                    chosen[b.block_hash] = b
                used += cost
        depth: dict[BlockHash, int] = {}
        for block_hash in chosen:
            _depth(block_hash, chosen, depth)
        return sorted(chosen.values(), key=lambda b: depth[b.block_hash])

    @property
    def codec(self) -> object:
        """The storage codec of this cache's payloads (:data:`~warmup_tools.kv.codecs.STORAGE_CODECS`)."""
        return self._codec

    @property
    def arrays(self) -> KVArrays:
        """The array library of this cache's payloads (:mod:`warmup_tools.kv.arrays`)."""
        return self._codec.arrays

    def reserve(self, nbytes: int, *, end_pins: bool = True) -> bool:
        """Count ``nbytes`` of a running sequence's KV against the budget, evicting blocks to make room.

        False (nothing reserved) when even evicting every evictable block would not make room: the
        caller then preempts a sequence. Give the bytes back with :meth:`unreserve`. ``end_pins``: room may
        come from ending pins (a live request's KV); a warm prompt's KV passes False, so warm-up never ends a
        pin (one plan item cannot push out another, and a plan too big for the budget shows as a shortfall).
        """
        if nbytes <= 0:
            return True
        with self._lock:
            if not self._make_room(nbytes, BlockSource.LIVE if end_pins else BlockSource.WARMUP, reserve=True):
                return False
            self.stats.running_bytes += nbytes
            return True

    def unreserve(self, nbytes: int) -> None:
        """Give back bytes taken with :meth:`reserve` (a sequence finished, was cancelled or preempted)."""
        with self._lock:
            self.stats.running_bytes = max(0, self.stats.running_bytes - nbytes)

    def activate_plan(self, plan_id: str | None) -> int:
        """Make ``plan_id`` the active warm-up plan; blocks pinned by any other plan are unpinned."""
        unpinned = 0
        with self._lock:
            if plan_id != self.active_plan:
                self._new_plan(plan_id)
            ended = []
            for block in self._blocks.values():
                if block.plan_id is not None and block.plan_id != plan_id:
                    block.plan_id = None
                    block.pin_until = None
                    self.stats.pinned_bytes -= block.nbytes
                    self._refresh(block)
                    ended.append(block.block_hash)
            self._record_unpinned(ended, "plan_change")
            unpinned = len(ended)
        return unpinned

    def move_plan(self, plan_id: str, keep: Collection[BlockHash]) -> tuple[int, int]:
        """Make ``plan_id`` active without dropping the blocks it keeps (a live plan change).

        Pinned blocks in ``keep`` are re-pinned under ``plan_id``; every other pinned block is unpinned and
        becomes an ordinary evictable block (live KV, outside the warm-up cap). Blocks of ``keep`` that are
        not pinned yet are pinned when the new plan warms them (:meth:`store` with ``plan_id``). Returns
        ``(kept, unpinned)``.
        """
        kept = unpinned = 0
        ended: list[BlockHash] = []
        with self._lock:
            if plan_id != self.active_plan:
                self._new_plan(plan_id)
            for block in self._blocks.values():
                if block.plan_id is None:
                    continue
                if block.block_hash in keep:
                    block.plan_id = plan_id
                    kept += 1
                else:
                    # NOTE: a dropped block no longer counts against the warm-up cap, or the new plan's items could
                    # be refused for room the old plan's leftovers hold.
                    self._unpin(block)
                    self._refresh(block)
                    ended.append(block.block_hash)
            self._record_unpinned(ended, "plan_change")
            unpinned = len(ended)
        return kept, unpinned

    def resident(self, hashes: Iterable[BlockHash], plan_id: str | None = None) -> int:
        """How many of ``hashes`` are cached now (with ``plan_id``: and pinned under that plan)."""
        with self._lock:
            self._expire_pins(self._clock())
            blocks = (self._blocks.get(h) for h in hashes)
            return sum(1 for b in blocks if b is not None and (plan_id is None or b.plan_id == plan_id))

    def covered(self, hashes: Iterable[BlockHash], plan_id: str | None) -> int:
        """How many of ``hashes`` the plan ``plan_id`` covers: pinned under it now, or pinned under it before and
        their pin ended (at its deadline, or released by the live check). What warm coverage counts: a pin that
        ends by design does not make a replica less ready, and the plan does not warm it again."""
        with self._lock:
            if plan_id is None or plan_id != self.active_plan:
                return self.resident(hashes, plan_id)
            count = 0
            for block_hash in hashes:
                block = self._blocks.get(block_hash)
                count += (block is not None and block.plan_id == plan_id) or block_hash in self._ended
            return count

    def pin_report(self) -> dict[str, Any]:
        """The live check, JSON-ready: the active plan, whether its pins hold (``pinned``), were released
        (``released``) or there are none (``none``); pinned blocks, and this window's pinned hits against the
        shadow hits, with the totals since the plan became active, overall and per adapter (``base`` for the
        base model)."""
        with self._lock:
            self._expire_pins(self._clock())
            pinned: dict[str, int] = collections.Counter()
            for block in self._blocks.values():
                if block.plan_id is not None:
                    pinned[block.owner or BASE_OWNER] += 1
            return self._pins.report(self.active_plan, pinned, self.pin_check_s)

    def event_state(self) -> tuple[int, list[tuple[EventBlock, BlockHash, str]]]:
        """The full state for a KV-event subscriber that starts late or fell out of the replay window: the last
        event's sequence number and every cached block as ``(block, parent, source)``, parents before children,
        taken at that number (the events after it continue the state with no gap)."""
        with self._lock:
            seq = self.events.last_seq if self.events is not None else 0
            blocks = list(self._blocks.values())
        depth: dict[BlockHash, int] = {}
        by_hash = {b.block_hash: b for b in blocks}
        for block in blocks:
            chain = []
            cursor: CachedBlock | None = block
            while cursor is not None and cursor.block_hash not in depth:
                chain.append(cursor)
                cursor = by_hash.get(cursor.parent)
            base = depth[cursor.block_hash] if cursor is not None else -1
            for offset, item in enumerate(reversed(chain), start=1):
                depth[item.block_hash] = base + offset
        blocks.sort(key=lambda b: depth[b.block_hash])
        return seq, [(_event_block(b), b.parent, b.source.value) for b in blocks]

    def clear(self) -> None:
        with self._lock:
            for block in list(self._blocks.values()):
                self._policy.remove(block)
            self._tracked.clear()
            self._blocks.clear()
            self._deadlines.clear()
            self._shadow.clear()
            self._shadow_bytes = 0
            self.stats.bytes_used = self.stats.warmup_bytes = self.stats.pinned_bytes = self.stats.blocks = 0
            self.stats.bytes_by_owner.clear()
            if self.events is not None:
                self.events.append("cleared")

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def block(self, block_hash: BlockHash) -> CachedBlock | None:
        return self._blocks.get(block_hash)

    # ------------------------------------------------------------------------------------- helpers
    def _bind_plan(self, plan_id: str | None, source: BlockSource, blocks: int) -> tuple[str | None, BlockSource]:
        """The plan and source a store of ``blocks`` for ``plan_id`` really gets (see :meth:`store`)."""
        if plan_id is None or plan_id == self.active_plan:
            return plan_id, source
        if self.active_plan is None:
            self.activate_plan(plan_id)  # nothing is pinned: the first warm-up sample of this instance's plan
            return plan_id, source
        # NOTE: binding the pin to its own plan is what keeps a live plan change final: activating the
        # sample's plan here would unpin every block of the current plan while its coverage still read full.
        self.stats.stale_plan_blocks += blocks
        if self._stale_logged != plan_id:
            self._stale_logged = plan_id
            LOGGER.warning("KV cache: a warm-up store for plan %s arrived while plan %s is current; its blocks "
                           "are cached unpinned and the current plan's pins are kept", plan_id, self.active_plan)
        return None, BlockSource.LIVE

    def _make_room(self, nbytes: int, source: BlockSource, reserve: bool = False) -> bool:
        """Evict until ``nbytes`` more fit the budget; a LIVE caller may end pins for it. A WARMUP block must also
        fit the warm-up cap (``reserve``: a warm prompt's running KV, which is not pinned, need not)."""
        if source is BlockSource.WARMUP and not reserve and self.stats.warmup_bytes + nbytes > self.warmup_budget:
            return False
        while self.stats.bytes_used + self.stats.running_bytes + nbytes > self.budget_bytes:
            victim = self._policy.victim(self._clock())
            if victim is None:
                if source is BlockSource.LIVE and self._yield_pin():
                    continue
                return False
            block = self._blocks[victim]
            self._evict(block)
            if self.stats.pinned_bytes > 0:
                self._remember_shadow(block)
        return True

    def _evict(self, block: CachedBlock) -> None:
        now = self._clock()
        self._policy.remove(block)
        self._tracked.discard(block.block_hash)
        del self._blocks[block.block_hash]
        self._account(block, -1)
        self.stats.evictions += 1
        self.stats.evictions_by_owner[block.owner] = self.stats.evictions_by_owner.get(block.owner, 0) + 1
        expired = now - block.last_access > getattr(self._policy, "ttl_s", float("inf"))
        if expired:
            self.stats.expired_evictions += 1
        if self.events is not None:
            self.events.append("removed", "expired" if expired else "evicted", hashes=(block.block_hash,))
        parent = self._blocks.get(block.parent)
        if parent is not None:
            parent.children -= 1
            self._refresh(parent)

    def _may_pin(self, block_hash: BlockHash) -> bool:
        """The active plan may pin ``block_hash``: its pin did not end already, and the live check did not release
        the plan's pins."""
        return not self._pins.releases and block_hash not in self._ended

    def _retention(self, block: CachedBlock) -> float:
        return block.retention_s if block.retention_s is not None else self.pin_retention_s

    def _set_deadline(self, block: CachedBlock, retention_s: float | None, now: float) -> None:
        """Pin ``block`` (its ``plan_id`` set by the caller) until ``now`` plus its retention."""
        if retention_s is not None:
            block.retention_s = retention_s
        block.pin_until = now + self._retention(block)
        self._deadline_seq += 1
        heapq.heappush(self._deadlines, (block.pin_until, self._deadline_seq, block.block_hash))

    def _expire_pins(self, now: float) -> None:
        """End every pin whose deadline has passed: the block joins the eviction policy (first in line if the
        pin never paid: no hit since it was stored)."""
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, _, block_hash = heapq.heappop(self._deadlines)
            block = self._blocks.get(block_hash)
            if block is None or block.plan_id is None or block.pin_until is None or block.pin_until < deadline:
                continue  # evicted, unpinned or re-pinned since: a stale entry
            if block.pin_until > deadline:
                # NOTE: a hit moved the deadline (pin_refresh_on_hit): one entry per pinned block, re-queued here.
                self._deadline_seq += 1
                heapq.heappush(self._deadlines, (block.pin_until, self._deadline_seq, block_hash))
                continue
            self._end_pin(block)
            self.stats.expired_pins += 1
            self._pins.ended(block.owner, expired=1)
            self._record_unpinned((block_hash,), "expired")

    def _end_pin(self, block: CachedBlock) -> None:
        """``block``'s pin under the active plan ends: it becomes live KV of the eviction policy."""
        self._unpin(block)
        self._ended.add(block.block_hash)
        if block.evictable and block.block_hash not in self._tracked:
            self._policy.add(block, cold=block.hits == 0)
            self._tracked.add(block.block_hash)
        if self.stats.pinned_bytes <= 0:
            self._shadow.clear()
            self._shadow_bytes = 0

    def _unpin(self, block: CachedBlock) -> None:
        """``block`` is no longer pinned: live KV, outside the warm-up cap (the caller refreshes its policy)."""
        block.plan_id = None
        block.pin_until = None
        self.stats.pinned_bytes -= block.nbytes
        if block.source is BlockSource.WARMUP:
            block.source = BlockSource.LIVE
            self.stats.warmup_bytes -= block.nbytes

    def _yield_pin(self) -> bool:
        """Live traffic needs room that only pinned blocks hold: end the pin with the earliest deadline (a pin is
        a priority over other blocks, never a reason to refuse a request). False when no pin is held."""
        while self._deadlines:
            _, _, block_hash = heapq.heappop(self._deadlines)
            block = self._blocks.get(block_hash)
            if block is None or block.plan_id is None:
                continue
            self._pins.ended(block.owner, released=1)
            self._end_pin(block)
            self.stats.released_pins += 1
            self._record_unpinned((block_hash,), "released")
            return True
        return False

    def _check_pins(self, now: float) -> None:
        """Close the live check's window when it is due and has evidence; release the pins if they cost more
        block hits than they gave."""
        if self.pin_check_s <= 0 or self.active_plan is None or self.stats.pinned_bytes <= 0:
            return  # NOTE: with no pin held (all expired), there is nothing to release
        verdict = self._pins.close_window(now, self.pin_check_s)
        if verdict is None:
            return
        released_hashes: list[BlockHash] = []
        for block in list(self._blocks.values()):
            if block.plan_id is not None:
                self._pins.ended(block.owner, released=1)
                self._end_pin(block)
                released_hashes.append(block.block_hash)
        self._record_unpinned(released_hashes, "released")
        released = len(released_hashes)
        self.stats.released_pins += released
        self.stats.pin_releases += 1
        LOGGER.warning("KV cache: plan %s's pins are released (%d blocks): %s", self.active_plan, released, verdict)

    def _record_unpinned(self, hashes: Sequence[BlockHash], reason: str) -> None:
        if hashes and self.events is not None:
            self.events.append("unpinned", reason, hashes=tuple(hashes))

    def _remember_shadow(self, block: CachedBlock) -> None:
        """``block`` was evicted while pins held room: keep its hash in the shadow list, as many bytes of the
        newest such evictions as the pins hold."""
        self._forget_shadow(block.block_hash)
        self._shadow[block.block_hash] = (block.nbytes, block.owner)
        self._shadow_bytes += block.nbytes
        while self._shadow and self._shadow_bytes > self.stats.pinned_bytes:
            _, (nbytes, _) = self._shadow.popitem(last=False)
            self._shadow_bytes -= nbytes

    def _forget_shadow(self, block_hash: BlockHash) -> None:
        ghost = self._shadow.pop(block_hash, None)
        if ghost is not None:
            self._shadow_bytes -= ghost[0]

    def _new_plan(self, plan_id: str | None) -> None:
        self.active_plan = plan_id
        self._ended.clear()
        self._pins = _PinCheck()

    def _account(self, block: CachedBlock, sign: int) -> None:
        self.stats.bytes_used += sign * block.nbytes
        self.stats.blocks += sign
        self.stats.bytes_by_owner[block.owner] = self.stats.bytes_by_owner.get(block.owner, 0) + sign * block.nbytes
        if block.source is BlockSource.WARMUP:
            self.stats.warmup_bytes += sign * block.nbytes
        if block.plan_id is not None:
            self.stats.pinned_bytes += sign * block.nbytes

    def _refresh(self, block: CachedBlock, touched: bool = False) -> None:
        # NOTE: the policy only ever sees evictable blocks, so a victim is always safe to drop.
        tracked = block.block_hash in self._tracked
        if block.evictable:
            if not tracked:
                self._policy.add(block)
                self._tracked.add(block.block_hash)
            elif touched:
                self._policy.touch(block)
        elif tracked:
            self._policy.remove(block)
            self._tracked.discard(block.block_hash)


@dataclasses.dataclass(slots=True)
class _OwnerPins:
    pin_hits: int = 0
    shadow_hits: int = 0
    expired: int = 0
    released: int = 0


class _PinCheck:
    """The live check's counters for the active plan: this window's and the plan's totals, per owner."""

    def __init__(self) -> None:
        self.window_start: float | None = None
        self.window = _OwnerPins()
        self.owners: dict[str, _OwnerPins] = {}
        self.reason = ""
        self.releases = 0

    def hit(self, owner: str, pinned: int, shadow: int) -> None:
        entry = self._owner(owner)
        entry.pin_hits += pinned
        entry.shadow_hits += shadow
        self.window.pin_hits += pinned
        self.window.shadow_hits += shadow

    def ended(self, owner: str, *, expired: int = 0, released: int = 0) -> None:
        entry = self._owner(owner)
        entry.expired += expired
        entry.released += released

    def close_window(self, now: float, window_s: float) -> str | None:
        """At the end of a window with evidence (``MIN_PIN_EVIDENCE_BLOCKS``; until then the window goes on):
        the reason to release the pins, or None (and a new window)."""
        if self.window_start is None:
            self.window_start = now
            return None
        pinned, shadow = self.window.pin_hits, self.window.shadow_hits
        if now - self.window_start < window_s or pinned + shadow < MIN_PIN_EVIDENCE_BLOCKS:
            return None
        span = now - self.window_start
        self.window_start, self.window = now, _OwnerPins()
        if shadow <= pinned:
            return None
        self.releases += 1
        self.reason = (f"over {span:.0f} s the pinned blocks gave {pinned} block hits and the blocks evicted "
                       f"for them would have given {shadow}")
        return self.reason

    def report(self, plan_id: str | None, pinned: dict[str, int], window_s: float) -> dict[str, Any]:
        adapters = {}
        for name in sorted(set(self.owners) | set(pinned)):
            entry = self._owner(name)
            adapters[name] = {"pinned_blocks": pinned.get(name, 0), "pin_hits": entry.pin_hits,
                              "shadow_hits": entry.shadow_hits, "expired_blocks": entry.expired,
                              "released_blocks": entry.released}
        total = sum(pinned.values())
        expired = any(entry.expired for entry in self.owners.values())
        state = "released" if self.releases else "pinned" if total else "expired" if expired else "none"
        return {"plan_id": plan_id, "state": state,
                "window_s": window_s, "pinned_blocks": total,
                "window_pin_hits": self.window.pin_hits, "window_shadow_hits": self.window.shadow_hits,
                **{key: sum(a[key] for a in adapters.values())
                   for key in ("pin_hits", "shadow_hits", "expired_blocks", "released_blocks")},
                "releases": self.releases, "reason": self.reason, "adapters": adapters}

    def _owner(self, owner: str) -> _OwnerPins:
        return self.owners.setdefault(owner or BASE_OWNER, _OwnerPins())


def _depth(block_hash: BlockHash, blocks: dict[BlockHash, CachedBlock], depth: dict[BlockHash, int]) -> int:
    chain = []
    while block_hash in blocks and block_hash not in depth:
        chain.append(block_hash)
        block_hash = blocks[block_hash].parent
    base = depth.get(block_hash, -1)
    for h in reversed(chain):
        base += 1
        depth[h] = base
    return base


def _block_tokens(tokens: Sequence[int] | None, index: int, block_size: int) -> np.ndarray | None:
    if tokens is None or len(tokens) < (index + 1) * block_size:
        return None
    return np.asarray(tokens[index * block_size:(index + 1) * block_size], dtype=np.int32).copy()


def _event_block(block: CachedBlock) -> EventBlock:
    tokens = tuple(int(t) for t in block.tokens) if block.tokens is not None else ()
    return EventBlock(block.block_hash, tokens, block.owner, block.tenant)
