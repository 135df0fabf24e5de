"""Sizing the warm set by replay: how many prompt tokens a plan's warm set serves on held-out traffic.

The planner (:func:`warmup_tools.planning.select.build_plan`) splits the log in time, plans from the head
at several warm shares and replays the tail here, once per share, against the real
:class:`~warmup_tools.kv.prefix_cache.PrefixCache` built from the target's KV settings (budget, block size,
eviction, TTL, live reserve, storage) with a clock driven by the records' timestamps. Each replay starts
from an empty cache, as a replica that just started: the warm set is stored first (as warm-up blocks,
pinned under one plan, each item with its ``retention_s``), then every tail request in arrival order does
what the server's scheduler does for it (``lora_adapter/scheduler.py``):

* match its longest cached block prefix, at most ``(len(ids) - 1) // block_size`` blocks (the last prompt
  token is always computed), counting the matched tokens as served from cache;
* reserve its prompt's KV as a running sequence (blocks are evicted to make room);
* store its full blocks from the first one it missed, as live blocks of its tenant and adapter;
* release the match and the reservation.

Requests run one at a time (no batching, no concurrency), declared public prefixes are not modelled (every
block is its tenant's), and neither are outputs: the figure compares warm shares on the same traffic, it does
not predict a server's hit rate. Payloads are a few bytes; every block counts the plan's KV bytes per token
(``PrefixCache(bytes_per_token=)``, as the simulated engine), so the warm set and the live blocks compete for
the budget as they would on the server.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import torch

from warmup_tools.common.errors import ConfigError
from warmup_tools.kv.blocks import BlockSource
from warmup_tools.kv.config import KVCacheConfig
from warmup_tools.kv.hashing import CacheScope, block_hashes
from warmup_tools.kv.prefix_cache import PrefixCache
from warmup_tools.lora_adapter.serving import make_prefix_cache

#: The plan id the replayed warm set is pinned under.
REPLAY_PLAN_ID = "replay"
#: The base fingerprint of the replay's block hashes (they never meet a server's).
_REPLAY_BASE = "planner-replay"


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One tail request: its arrival (epoch seconds), scope and prompt token ids."""

    ts: float
    tenant: str
    adapter: str
    ids: Sequence[int]


@dataclasses.dataclass(frozen=True, slots=True)
class WarmItem:
    """One item of a candidate warm set (a plan item's scope, tokens and retention)."""

    tenant: str
    adapter: str
    token_ids: Sequence[int]
    retention_s: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayOutcome:
    """What one replay served: prompt tokens from cache, of all prompt tokens; blocks the warm set stored."""

    served_tokens: int
    prompt_tokens: int
    warmed_blocks: int
    requests: int
    #: Prompt tokens from cache of each tail request, in order.
    served_per_request: tuple[int, ...] = ()


def make_replay_cache(kv: KVCacheConfig, kv_bytes_per_token: int, clock: Callable[[], float]) -> PrefixCache:
    """The target's prefix cache, built as the server builds it from the same settings, counting
    ``kv_bytes_per_token`` per cached token; ``kv.budget_bytes`` must be > 0."""
    cache = make_prefix_cache(kv, bytes_per_token=kv_bytes_per_token, clock=clock)
    if cache is None:
        raise ConfigError("the replay needs a KV cache: kv_cache_bytes is 0")
    return cache


def replay(kv: KVCacheConfig, kv_bytes_per_token: int, warm: Sequence[WarmItem], tail: Sequence[ReplayRequest], *,
           start: float) -> ReplayOutcome:
    """Warm ``warm`` at ``start``, then serve ``tail`` (sorted by arrival) as the module docstring says."""
    now = [start]
    cache = make_replay_cache(kv, kv_bytes_per_token, lambda: now[0])
    bs = cache.block_size
    payload = _Payload()
    warmed = 0
    for item in warm:
        hashes = block_hashes(item.token_ids, bs, _scope(item.tenant, item.adapter))
        usable = hashes[: max(len(item.token_ids) - 1, 0) // bs]
        match = cache.match(usable, item.tenant)
        running = len(item.token_ids) * kv_bytes_per_token
        reserved = cache.reserve(running)
        # NOTE: a warm prompt stores every block from the first (stored_blocks = 0 for warm-up), which pins
        # the blocks an earlier item already cached.
        warmed += cache.store(hashes, payload.layers(len(item.token_ids)), source=BlockSource.WARMUP,
                              plan_id=REPLAY_PLAN_ID, owner=item.adapter, tenant=item.tenant,
                              retention_s=item.retention_s)
        cache.release(match)
        if reserved:
            cache.unreserve(running)
    served = total = 0
    per_request = []
    for request in tail:
        now[0] = max(now[0], request.ts)
        ids = request.ids
        hashes = block_hashes(ids, bs, _scope(request.tenant, request.adapter))
        usable = min(len(hashes), max(len(ids) - 1, 0) // bs)
        match = cache.match(hashes[:usable], request.tenant)
        served += match.num_tokens
        per_request.append(match.num_tokens)
        total += len(ids)
        running = len(ids) * kv_bytes_per_token
        reserved = cache.reserve(running)
        cache.store(hashes, payload.layers(len(ids)), start_block=len(match), source=BlockSource.LIVE,
                    owner=request.adapter, tenant=request.tenant)
        cache.release(match)
        if reserved:
            cache.unreserve(running)
    return ReplayOutcome(served, total, warmed, len(tail), tuple(per_request))


#: A request goes to the replica whose cached blocks cover at least this share of its prompt's blocks (smg's
#: ``cache_aware`` default ``cache_threshold``), else to the replica that took the fewest requests.
AFFINITY_THRESHOLD = 0.5


def route(requests: Sequence[ReplayRequest], replicas: int, block_size: int) -> list[list[ReplayRequest]]:
    """``requests`` split across ``replicas`` that all warm the same plan, as a prefix-affine router (smg's
    ``cache_aware``) splits them: a request goes to the replica that took the deepest block chain it carries,
    when that covers :data:`AFFINITY_THRESHOLD` of its blocks, else to the replica with the fewest requests
    (ties: the first). A deterministic model of the router: each replica sees its own sessions, a share of the
    traffic, and that is what a plan warmed on every replica is replayed against (each replica's share against
    a cache of its own; :func:`replay_fleet`)."""
    if replicas <= 1:
        return [list(requests)]
    owner: dict[bytes, int] = {}
    shares: list[list[ReplayRequest]] = [[] for _ in range(replicas)]
    for request in requests:
        hashes = block_hashes(request.ids, block_size, _scope(request.tenant, request.adapter))
        depth, target = 0, None
        for index, block_hash in enumerate(hashes):
            holder = owner.get(block_hash)
            if holder is None:
                break
            depth, target = index + 1, holder
        if target is None or depth < AFFINITY_THRESHOLD * len(hashes):
            target = min(range(replicas), key=lambda r: (len(shares[r]), r))
        shares[target].append(request)
        for block_hash in hashes:
            owner.setdefault(block_hash, target)
    return shares


def replay_fleet(kv: KVCacheConfig, kv_bytes_per_token: int, warm: Sequence[WarmItem],
                 shares: Sequence[Sequence[ReplayRequest]], *, start: float) -> ReplayOutcome:
    """:func:`replay` of each replica's share (:func:`route`) against a cache of its own, every one warmed with
    ``warm``; the totals (``warmed_blocks``: one replica's)."""
    outcomes = [replay(kv, kv_bytes_per_token, warm, share, start=start) for share in shares]
    return ReplayOutcome(sum(o.served_tokens for o in outcomes), sum(o.prompt_tokens for o in outcomes),
                         max((o.warmed_blocks for o in outcomes), default=0), sum(o.requests for o in outcomes))


def choose_share(served: Mapping[float, int]) -> float:
    """The share that served the most tokens; ties go to the smaller share (less pinned for the same gain)."""
    return min(served, key=lambda share: (-served[share], share))


# ---------------------------------------------------------------------------------------------- helpers
def _scope(tenant: str, adapter: str) -> CacheScope:
    return CacheScope(_REPLAY_BASE, adapter, "", tenant)


class _Payload:
    """Per-layer KV of one token's worth of bytes per position: what ``PrefixCache.store`` slices into blocks
    (its modelled ``bytes_per_token`` is what counts against the budget)."""

    def __init__(self) -> None:
        self._zeros = torch.zeros(1, 1, 0, 1, dtype=torch.float16)

    def layers(self, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._zeros.shape[2] < tokens:
            self._zeros = torch.zeros(1, 1, max(tokens, 2 * self._zeros.shape[2]), 1, dtype=torch.float16)
        view = self._zeros[:, :, :tokens]
        return [(view, view)]
