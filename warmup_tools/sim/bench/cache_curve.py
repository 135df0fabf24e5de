"""``python -m warmup_tools bench cache-curve``: the KV prefix cache's hit rate against its size on the shipped
public traces, beside the Mooncake paper's figures.

Each trace (:mod:`warmup_tools.sim.traces`) is replayed in arrival order, with no timing but the trace's clock,
through this project's :class:`~warmup_tools.kv.prefix_cache.PrefixCache` (the cache every engine uses), once per
capacity and eviction policy. A request's blocks (its 512-token hash ids, chained as the cache chains token blocks)
are matched, and counted as hits only up to its first missing block (a prefix cache reuses a prefix, never a block
after a gap); the rest are then stored, evicting as the policy says. The hit rate is the share of all the
requests' blocks that were hits; the bound is the same count with an unbounded cache
(:func:`~warmup_tools.sim.traces.prefix_reuse`).

The Mooncake paper (Qin et al., FAST'25, the copy in the trace's repository, ``FAST25-release/Mooncake-FAST25.pdf``)
gives two figures for these traces: Table 2's "cache ratio" (conversation 40%, synthetic 66%) and Figure 9, the
prefix cache hit rate against capacity in tokens, where a cache of 3M tokens reaches 41% (conversation) and 46%
(synthetic) of the trace's theoretical maximum. It says it "considers only the sequence of requests" and names
neither the eviction policy nor whether a rate counts blocks, tokens or requests; :data:`PAPER` holds its figures.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Annotated, Sequence, TextIO

import numpy as np

from warmup_tools.common.settings import arg
from warmup_tools.kv.arrays import kv_arrays
from warmup_tools.kv.blocks import BLOCK_EVICTION_POLICIES
from warmup_tools.kv.hashing import CacheScope, block_hashes
from warmup_tools.kv.prefix_cache import PrefixCache
from warmup_tools.sim.bench.support.tables import markdown
from warmup_tools.sim.traces import TRACES, TraceRequest, TraceScale, load_trace, prefix_reuse

#: The paper's figures per trace: Table 2's cache ratio, and Figure 9's share of the maximum at 3M tokens.
PAPER = {"conversation": (0.40, 0.41), "synthetic": (0.66, 0.46)}
#: The capacity Figure 9 marks (a node's local DRAM).
PAPER_CAPACITY = 3_000_000
_SCOPE = CacheScope("trace", "", "", "default")


@dataclasses.dataclass(frozen=True, slots=True)
class Point:
    trace: str
    policy: str
    capacity_tokens: int
    hit_rate: float


def run(assets_dir: Path, *, traces: Annotated[str, arg("traces, comma-separated")] = "conversation,synthetic",
        capacities: Annotated[str, arg("cache capacities in tokens, comma-separated")]
        = "100000,1000000,3000000,10000000,30000000,100000000",
        policies: Annotated[str, arg("eviction policies, comma-separated")] = "lru,lfu_ttl",
        out: TextIO = sys.stdout) -> list[Point]:
    """``assets_dir`` is not read: the traces carry no text and the cache no model."""
    names = [t.strip() for t in traces.split(",") if t.strip()]
    sizes = [int(float(c)) for c in capacities.split(",") if c.strip()]
    chosen = [p.strip() for p in policies.split(",") if p.strip()]
    unknown = [n for n in names if n not in TRACES] + [p for p in chosen if p not in BLOCK_EVICTION_POLICIES]
    if unknown or not sizes or min(sizes) < 1:
        raise ValueError(f"unknown trace or policy {unknown}, or no capacity of at least one token")
    points = []
    for name in names:
        block = TRACES[name].source_block
        requests = load_trace(name, TraceScale(block_tokens=block, max_input_tokens=1 << 30))
        bound = prefix_reuse(requests)
        for policy in chosen:
            for size in sizes:
                points.append(Point(name, policy, size, hit_rate(requests, size, block, policy)))
                out.write(f"{name} {policy} {size:,} tokens: {points[-1].hit_rate:.1%}\n")
                out.flush()
        out.write("\n" + report(name, bound, [p for p in points if p.trace == name], chosen, sizes) + "\n\n")
    return points


def hit_rate(requests: Sequence[TraceRequest], capacity_tokens: int, block_tokens: int, policy: str) -> float:
    """The share of the requests' blocks served from a prefix cache of ``capacity_tokens`` (module doc)."""
    now = [0.0]
    cache = PrefixCache(capacity_tokens, 1, live_reserve=0.0, eviction=policy, bytes_per_token=block_tokens,
                        arrays=kv_arrays("numpy"), clock=lambda: now[0])
    hits = total = 0
    for request in requests:
        now[0] = request.at_s
        # NOTE: one "token" per hash id in blocks of one: the cache chains them as it chains token blocks.
        hashes = block_hashes(request.hash_ids, 1, _SCOPE)
        match = cache.match(hashes)
        hits += len(match.hashes)
        total += len(hashes)
        cache.release(match)
        payload = np.zeros((1, 1, len(hashes), 1), dtype=np.float32)
        cache.store(hashes, [(payload, payload)], start_block=len(match.hashes), tokens=list(request.hash_ids))
    return hits / total if total else 0.0


def report(name: str, bound: float, points: Sequence[Point], policies: Sequence[str], sizes: Sequence[int]) -> str:
    """One trace's table: hit rate per capacity and policy, its share of the unbounded bound, the paper's."""
    ratio, at_3m = PAPER.get(name, (None, None))
    rows = []
    for size in sizes:
        cells = [f"{size:,}"]
        for policy in policies:
            rate = next(p.hit_rate for p in points if p.policy == policy and p.capacity_tokens == size)
            cells.append(f"{rate:.1%} ({rate / bound:.0%} of the bound)" if bound else f"{rate:.1%}")
        paper = f"{at_3m:.0%} of its maximum" if size == PAPER_CAPACITY and at_3m is not None else ""
        rows.append(cells + [paper])
    header = ["capacity (tokens)", *(f"{p}: hit rate" for p in policies), "paper, Figure 9"]
    paper_ratio = f"; the paper's Table 2 cache ratio {ratio:.0%}" if ratio is not None else ""
    return (f"{name}: unbounded prefix cache {bound:.1%} of the blocks{paper_ratio}\n"
            + markdown(header, rows))
