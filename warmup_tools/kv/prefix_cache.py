"""KV prefix cache: reuse the attention keys and values of prompt prefixes seen (or warmed) before.

Reads like vLLM's ``kv_cache_utils`` / ``block_pool`` and SGLang's ``radix_cache``:

* a prompt is cut into fixed-size token blocks, each full block named by a chained hash
  (:mod:`warmup_tools.kv.hashing`); the scope in the hash keeps tenants and adapters apart;
* a request reuses the KV of its longest cached block prefix and prefills only the rest;
* memory is a byte budget per instance. A share of it (15% by default) is reserved for live traffic:
  warm-up may not fill it. The KV of running sequences (the continuous-batching scheduler's) is counted
  against the same budget (:meth:`PrefixCache.reserve`): cached blocks are evicted to make room for it.
  Eviction is chosen from :data:`~warmup_tools.kv.blocks.EVICTION_POLICIES` (LFU with TTL by default);
  blocks pinned by the active warm-up plan, blocks in use by a running request, and blocks that have
  cached children are never evicted (evicting a parent would strand its children).

Block metadata and eviction policies are in :mod:`warmup_tools.kv.blocks`, storage codecs in
:mod:`warmup_tools.kv.codecs`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable, Collection, Iterable, Sequence

import numpy as np
import torch

from warmup_tools.kv.blocks import (
    EVICTION_POLICIES,
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
    DEFAULT_STORAGE,
    DEFAULT_TTL_S,
    warmup_budget,
)
from warmup_tools.kv.hashing import NONE_HASH, PUBLIC_TENANT, BlockHash

LOGGER = logging.getLogger(__name__)


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
    ) -> None:
        """``bytes_per_token``: what one cached token counts against the budget instead of its payload and token
        ids (a simulated engine's modelled KV size: its payloads are a few bytes); None: the stored bytes."""
        if budget_bytes < 0 or block_size < 1 or not 0.0 <= live_reserve < 1.0:
            raise ValueError("budget_bytes >= 0, block_size >= 1 and 0 <= live_reserve < 1 are required")
        if bytes_per_token is not None and bytes_per_token < 1:
            raise ValueError("bytes_per_token must be >= 1 (or None: the stored bytes)")
        try:
            self._policy = EVICTION_POLICIES[eviction](ttl_s)
            self._codec = STORAGE_CODECS[storage]()
        except KeyError as exc:
            raise ValueError(
                f"unknown {'eviction policy' if exc.args[0] == eviction else 'storage'} {exc.args[0]!r}; "
                f"eviction: {', '.join(EVICTION_POLICIES)}; storage: {', '.join(STORAGE_CODECS)}"
            ) from None
        self.budget_bytes = budget_bytes
        self.block_size = block_size
        self.live_reserve = live_reserve
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

    # ----------------------------------------------------------------------------------- public API
    @property
    def warmup_budget(self) -> int:
        """Bytes warm-up may hold: the budget less the share reserved for live traffic."""
        return warmup_budget(self.budget_bytes, self.live_reserve)

    def match(self, hashes: Sequence[BlockHash], tenant: str | None = None) -> PrefixMatch:
        """The longest cached prefix of ``hashes``; each matched block is held until :meth:`release`.

        With ``tenant``, a block written for another tenant (not public) ends the match and is counted
        in ``stats.cross_tenant_hits``.
        """
        now = self._clock()
        with self._lock:
            matched: list[BlockHash] = []
            planned = 0
            for block_hash in hashes:
                block = self._blocks.get(block_hash)
                if block is None:
                    break
                if tenant is not None and block.tenant not in ("", tenant, PUBLIC_TENANT):
                    self.stats.cross_tenant_hits += 1
                    break
                matched.append(block_hash)
                planned += block.plan_id is not None
                block.hits += 1
                block.last_access = now
                block.ref_count += 1
                self._refresh(block, touched=True)
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

    def load(self, match: PrefixMatch, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(keys, values)`` of shape ``[1, kv_heads, match.num_tokens, head_dim]``."""
        joined = torch.cat(self.load_blocks(match, dtype), dim=3)  # [layers, 2, heads, tokens, dim], a new tensor
        return [(joined[i, 0].unsqueeze(0), joined[i, 1].unsqueeze(0)) for i in range(joined.shape[0])]

    def load_blocks(self, match: PrefixMatch, dtype: torch.dtype) -> list[torch.Tensor]:
        """Each matched block ``[layers, 2, kv_heads, block_size, head_dim]``, in order; read only (a block may be
        a view of what the cache holds)."""
        with self._lock:
            payloads = [self._blocks[h].payload for h in match.hashes]
        return [self._codec.decode(p, dtype) for p in payloads]

    def store(
        self,
        hashes: Sequence[BlockHash],
        layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        start_block: int = 0,
        source: BlockSource = BlockSource.LIVE,
        plan_id: str | None = None,
        owner: str = "",
        tenant: str = "",
        public_blocks: int = 0,
        tokens: Sequence[int] | None = None,
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
        """
        stored = 0
        now = self._clock()
        with self._lock:
            plan_id, source = self._bind_plan(plan_id, source, len(hashes) - start_block)
            for index in range(start_block, len(hashes)):
                block_hash = hashes[index]
                existing = self._blocks.get(block_hash)
                if existing is not None:
                    existing.last_access = now
                    if plan_id is not None and existing.plan_id is None:
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
                    self._refresh(existing, touched=True)
                    continue
                tensor = _block_tensor(layers, index, self.block_size)
                payload, nbytes = self._codec.encode(tensor)
                block_tokens = _block_tokens(tokens, index, self.block_size)
                if block_tokens is not None:
                    nbytes += block_tokens.nbytes
                if self.block_bytes is not None:
                    nbytes = self.block_bytes
                if not self._make_room(nbytes, source):
                    self.stats.rejected_blocks += len(hashes) - index
                    break
                parent = hashes[index - 1] if index > 0 else NONE_HASH
                block = CachedBlock(block_hash, parent, payload, nbytes, source, now, now, plan_id=plan_id, owner=owner,
                                    tenant=PUBLIC_TENANT if index < public_blocks else tenant, tokens=block_tokens)
                self._blocks[block_hash] = block
                parent_block = self._blocks.get(parent)
                if parent_block is not None:
                    parent_block.children += 1
                    self._refresh(parent_block)
                self._account(block, +1)
                self._refresh(block)
                stored += 1
            self.stats.stored_blocks += stored
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
            block = dataclasses.replace(block, created=now, last_access=now, ref_count=0, children=0,
                                        plan_id=block.plan_id if block.plan_id == self.active_plan else None)
            self._blocks[block.block_hash] = block
            parent_block = self._blocks.get(block.parent)
            if parent_block is not None:
                parent_block.children += 1
                self._refresh(parent_block)
            self._account(block, +1)
            self._refresh(block)
            self.stats.stored_blocks += 1
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

    def reserve(self, nbytes: int) -> bool:
        """Count ``nbytes`` of a running sequence's KV against the budget, evicting blocks to make room.

        False (nothing reserved) when even evicting every evictable block would not make room: the
        caller then preempts a sequence. Give the bytes back with :meth:`unreserve`.
        """
        if nbytes <= 0:
            return True
        with self._lock:
            if not self._make_room(nbytes, BlockSource.LIVE):
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
            self.active_plan = plan_id
            for block in self._blocks.values():
                if block.plan_id is not None and block.plan_id != plan_id:
                    block.plan_id = None
                    self.stats.pinned_bytes -= block.nbytes
                    self._refresh(block)
                    unpinned += 1
        return unpinned

    def move_plan(self, plan_id: str, keep: Collection[BlockHash]) -> tuple[int, int]:
        """Make ``plan_id`` active without dropping the blocks it keeps (a live plan change).

        Pinned blocks in ``keep`` are re-pinned under ``plan_id``; every other pinned block is unpinned and
        becomes an ordinary evictable block (live KV, outside the warm-up cap). Blocks of ``keep`` that are
        not pinned yet are pinned when the new plan warms them (:meth:`store` with ``plan_id``). Returns
        ``(kept, unpinned)``.
        """
        kept = unpinned = 0
        with self._lock:
            self.active_plan = plan_id
            for block in self._blocks.values():
                if block.plan_id is None:
                    continue
                if block.block_hash in keep:
                    block.plan_id = plan_id
                    kept += 1
                else:
                    block.plan_id = None
                    self.stats.pinned_bytes -= block.nbytes
                    if block.source is BlockSource.WARMUP:
                        # NOTE: a dropped block no longer counts against the warm-up cap, or the new plan's
                        # items could be refused for room the old plan's leftovers hold.
                        block.source = BlockSource.LIVE
                        self.stats.warmup_bytes -= block.nbytes
                    self._refresh(block)
                    unpinned += 1
        return kept, unpinned

    def resident(self, hashes: Iterable[BlockHash], plan_id: str | None = None) -> int:
        """How many of ``hashes`` are cached now (with ``plan_id``: and pinned under that plan)."""
        with self._lock:
            blocks = (self._blocks.get(h) for h in hashes)
            return sum(1 for b in blocks if b is not None and (plan_id is None or b.plan_id == plan_id))

    def clear(self) -> None:
        with self._lock:
            for block in list(self._blocks.values()):
                self._policy.remove(block)
            self._tracked.clear()
            self._blocks.clear()
            self.stats.bytes_used = self.stats.warmup_bytes = self.stats.pinned_bytes = self.stats.blocks = 0
            self.stats.bytes_by_owner.clear()

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

    def _make_room(self, nbytes: int, source: BlockSource) -> bool:
        if source is BlockSource.WARMUP and self.stats.warmup_bytes + nbytes > self.warmup_budget:
            return False
        while self.stats.bytes_used + self.stats.running_bytes + nbytes > self.budget_bytes:
            victim = self._policy.victim(self._clock())
            if victim is None:
                return False
            self._evict(self._blocks[victim])
        return True

    def _evict(self, block: CachedBlock) -> None:
        now = self._clock()
        self._policy.remove(block)
        self._tracked.discard(block.block_hash)
        del self._blocks[block.block_hash]
        self._account(block, -1)
        self.stats.evictions += 1
        self.stats.evictions_by_owner[block.owner] = self.stats.evictions_by_owner.get(block.owner, 0) + 1
        if now - block.last_access > getattr(self._policy, "ttl_s", float("inf")):
            self.stats.expired_evictions += 1
        parent = self._blocks.get(block.parent)
        if parent is not None:
            parent.children -= 1
            self._refresh(parent)

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


def _block_tensor(layers: Sequence[tuple[torch.Tensor, torch.Tensor]], index: int, block_size: int) -> torch.Tensor:
    start, end = index * block_size, (index + 1) * block_size
    return torch.stack([torch.stack((k[0, :, start:end], v[0, :, start:end])) for k, v in layers])
