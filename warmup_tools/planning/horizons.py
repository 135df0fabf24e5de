"""Reuse horizons: how long a warmed prefix should stay pinned, learnt from the log's timestamps.

A planned block is pinned for a bounded time (its item's ``retention_s``), then it is an ordinary block of
the live eviction policy. The time is the prefix's *reuse horizon*: how long after one request that carries
the item's whole prefix the next one comes, read from the log as a high quantile
(``PlanOptions.retention_quantile``, 0.9) of the gaps between consecutive requests that carry it, bounded to
``[min_retention_s, max_retention_s]``. Within a category of requests the probability of reuse decays
exponentially with time (Alibaba, "KVCache in the wild", ATC'25), so categories get horizons of their own:

* ``shared``: a prefix that requests diverge after (a tenant's template or system prompt, opened by many
  different prompts);
* ``session``: a prefix whose requests are all one growing chain (each one's blocks open the next's: the
  turns of one conversation), or one prompt repeated.

An item with fewer than ``min_retention_gaps`` gaps takes its class's horizon (the gaps of every item of the
class pooled), then the pooled gaps of all items; with none at all (no item was asked twice), the shortest
pin, ``min_retention_s``: the log shows no reuse to wait for.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

import numpy as np

from warmup_tools.planning.analyse import PlanOptions, PromptStats, ScopeTraffic

#: The classes of prefix a horizon is learnt for (module docstring).
HORIZON_CLASSES = ("shared", "session")


@dataclasses.dataclass(frozen=True, slots=True)
class Horizon:
    """The retention of one item, the class it falls in, its own gaps, and where the figure came from
    (``item``: its own gaps; ``class``, ``all``: pooled gaps; ``none``: no reuse in the log)."""

    retention_s: float
    klass: str
    gaps: int
    source: str


class Horizons:
    """Reuse horizons of the leaves of one analysis' prefix trees (a leaf names an item's whole prefix).

    :meth:`prepare` reads the gaps of a set of items (the class pools come from them); :meth:`of` gives any
    leaf's horizon, its own gaps when it has enough, else its class's.
    """

    def __init__(self, options: PlanOptions) -> None:
        self.options = options
        self._gaps: dict[tuple[tuple[str, str], int], tuple[str, np.ndarray]] = {}
        self._pools: dict[str, np.ndarray] = {}
        self._all = np.zeros(0)

    def prepare(self, leaves: Iterable[tuple[ScopeTraffic, int, int]]) -> None:
        """Pool the gaps of ``(scope, leaf node, depth in blocks)`` per class (each leaf counted once)."""
        pooled: dict[str, list[np.ndarray]] = {k: [] for k in HORIZON_CLASSES}
        seen = set()
        for scope, leaf, depth in leaves:
            if (scope.key(), leaf) in seen:
                continue
            seen.add((scope.key(), leaf))
            klass, gaps = self._leaf(scope, leaf, depth)
            pooled[klass].append(gaps)
        self._pools = {k: np.concatenate(v) if v else np.zeros(0) for k, v in pooled.items()}
        self._all = np.concatenate(list(self._pools.values()))

    def of(self, scope: ScopeTraffic, leaf: int, depth: int) -> Horizon:
        klass, gaps = self._leaf(scope, leaf, depth)
        need = self.options.min_retention_gaps
        if len(gaps) >= need:
            return Horizon(self._bounded(gaps), klass, len(gaps), "item")
        pool = self._pools.get(klass, np.zeros(0))
        if len(pool) >= need:
            return Horizon(self._bounded(pool), klass, len(gaps), "class")
        if len(self._all) >= need:
            return Horizon(self._bounded(self._all), klass, len(gaps), "all")
        return Horizon(self.options.min_retention_s, klass, len(gaps), "none")

    def summary(self, horizons: Sequence[Horizon]) -> dict[str, Any]:
        """The plan's ``summary.horizons``: the rule, and per class its items, pooled gaps and horizon."""
        o = self.options
        classes = {}
        for klass in HORIZON_CLASSES:
            pool = self._pools.get(klass, np.zeros(0))
            mine = [h for h in horizons if h.klass == klass]
            classes[klass] = {
                "items": len(mine),
                "gaps": int(len(pool)),
                "horizon_s": round(self._bounded(pool), 1) if len(pool) >= o.min_retention_gaps else None,
                "median_gap_s": round(float(np.median(pool)), 1) if len(pool) else None,
                "items_own_horizon": sum(1 for h in mine if h.source == "item"),
            }
        return {"quantile": o.retention_quantile, "min_s": o.min_retention_s, "max_s": o.max_retention_s,
                "min_gaps": o.min_retention_gaps, "classes": classes,
                "from": {s: sum(1 for h in horizons if h.source == s) for s in ("item", "class", "all", "none")}}

    # ------------------------------------------------------------------------------------- helpers
    def _leaf(self, scope: ScopeTraffic, leaf: int, depth: int) -> tuple[str, np.ndarray]:
        key = (scope.key(), leaf)
        found = self._gaps.get(key)
        if found is None:
            carriers = [p for p in scope.prompts.values() if len(p.chain) >= depth and p.chain[depth - 1] == leaf]
            times = np.sort(np.fromiter((t for p in carriers for t in p.times), dtype=np.float64))
            found = self._gaps[key] = (_klass(carriers), np.diff(times))
        return found

    def _bounded(self, gaps: np.ndarray) -> float:
        o = self.options
        value = float(np.quantile(gaps, o.retention_quantile)) if len(gaps) else o.min_retention_s
        return min(max(value, o.min_retention_s), o.max_retention_s)


def _klass(carriers: Sequence[PromptStats]) -> str:
    """``session`` when the carriers are one growing chain: each one's usable blocks open the longest one's, and no
    two end at the same block (two prompts that differ only after their last full block are two requests of a
    template, not two turns); else ``shared``. Blocks, not tokens: a turn's last, partial block is completed
    differently by the next turn."""
    if len(carriers) <= 1:
        return "session"
    longest = max(carriers, key=lambda p: (len(p.chain), p.text)).chain
    depths = {len(p.chain) for p in carriers}
    if len(depths) < len(carriers) or any(longest[: len(p.chain)] != p.chain for p in carriers):
        return "shared"
    return "session"
