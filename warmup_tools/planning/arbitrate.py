"""How the KV warm-up budget is split across adapters when it cannot hold every adapter's hot set.

An adapter's **hot set** is every block of its scopes' prefix trees that at least ``min_block_requests``
logged requests carry (what the planner would warm with no budget limit). When the hot sets fit the
budget, every adapter may take its whole hot set. When they do not, each adapter's cap follows its
measured need, in two stages (each a water-fill: shares in proportion to a weight, none above what the
adapter can use, what one cannot use going to the others):

1. **Cold share.** The budget first goes to first blocks, in proportion to the adapter's *cold rate*
   (the decayed request rate through its first blocks that enough requests carry: the requests only a
   warm-up keeps from starting cold), up to the bytes of those first blocks.
2. **Traffic against capacity.** What is left goes in proportion to the adapter's request rate, up to
   its hot set (an adapter never holds budget it cannot use).

Each adapter's cap is also bounded by ``kv_bytes_per_adapter`` (the operator's bound). ``fixed`` (the
split before arbitration) gives every adapter ``kv_bytes_per_adapter`` and lets the hottest blocks
anywhere take the total. Pure: the planner feeds it the analysis; unit tests feed it needs directly.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping

#: ``PlanOptions.arbitration`` values.
ARBITRATION = ("measured", "fixed")


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterNeed:
    """What the logs say one adapter needs, in blocks and decayed requests per hour."""

    adapter: str
    #: Decayed request rate of the adapter (every request, one-off prompts included).
    rate: float
    #: Decayed rate through its first blocks that ``min_block_requests`` requests carry.
    cold_rate: float
    #: Those first blocks, and every block of its hot set.
    first_blocks: int
    hot_blocks: int


@dataclasses.dataclass(frozen=True, slots=True)
class Share:
    """One adapter's cap and why."""

    adapter: str
    cap_blocks: int
    reason: str


def arbitrate(needs: Iterable[AdapterNeed], total_blocks: int, per_adapter_blocks: int,
              mode: str = "measured") -> dict[str, Share]:
    """Each adapter's cap in blocks (module docstring)."""
    needs = sorted(needs, key=lambda n: n.adapter)
    if mode == "fixed":
        return {n.adapter: Share(n.adapter, per_adapter_blocks, "fixed: every adapter up to kv_bytes_per_adapter")
                for n in needs}
    if mode != "measured":
        raise ValueError(f"arbitration must be one of {', '.join(ARBITRATION)}, not {mode!r}")
    limit = {n.adapter: min(n.hot_blocks, per_adapter_blocks) for n in needs}
    if sum(limit.values()) <= total_blocks:
        return {n.adapter: Share(n.adapter, limit[n.adapter], f"whole hot set ({n.hot_blocks} blocks): the hot sets "
                                 "fit the budget") for n in needs}
    first = _water_fill(total_blocks, {n.adapter: n.cold_rate for n in needs},
                        {n.adapter: min(n.first_blocks, limit[n.adapter]) for n in needs}, {})
    caps = _water_fill(total_blocks - sum(first.values()), {n.adapter: n.rate for n in needs}, limit, first)
    rate = sum(n.rate for n in needs) or 1.0
    cold = sum(n.cold_rate for n in needs) or 1.0
    return {n.adapter: Share(n.adapter, caps[n.adapter], (
        f"{n.rate / rate:.0%} of requests, {n.cold_rate / cold:.0%} of those only a warm-up keeps warm; "
        f"{first[n.adapter]} of its {n.first_blocks} first blocks, then {caps[n.adapter] - first[n.adapter]} "
        f"more of its {n.hot_blocks}-block hot set by traffic")) for n in needs}


def shares_json(shares: Mapping[str, Share], needs: Iterable[AdapterNeed], used_blocks: Mapping[str, int],
                block_bytes: int, total_blocks: int, mode: str) -> dict[str, object]:
    """The plan's ``summary.arbitration`` entry: per adapter its share of the budget and why."""
    by_name = {n.adapter: n for n in needs}
    hot = sum(n.hot_blocks for n in by_name.values())
    return {
        "mode": mode,
        "budget_bytes": total_blocks * block_bytes,
        "hot_sets_bytes": hot * block_bytes,
        "fits": hot <= total_blocks,
        "adapters": {name or "base": {
            "share": round(share.cap_blocks / total_blocks, 4) if total_blocks else 0.0,
            "cap_bytes": share.cap_blocks * block_bytes,
            "used_bytes": used_blocks.get(name, 0) * block_bytes,
            "hot_set_bytes": by_name[name].hot_blocks * block_bytes,
            "requests_per_hour": round(by_name[name].rate, 3),
            "cold_requests_per_hour": round(by_name[name].cold_rate, 3),
            "reason": share.reason,
        } for name, share in sorted(shares.items())},
    }


def _water_fill(amount: int, weights: Mapping[str, float], caps: Mapping[str, int],
                base: Mapping[str, int]) -> dict[str, int]:
    """``base`` plus ``amount`` blocks split in proportion to ``weights``, none above its cap (what one
    cannot take goes to the others); whole blocks, the remainder to the largest fractions (ties by name)."""
    out = {name: base.get(name, 0) for name in caps}
    while amount > 0:
        open_ = [n for n in caps if out[n] < caps[n] and weights.get(n, 0) > 0]
        if not open_:
            break
        weight = sum(weights[n] for n in open_)
        ideal = {n: min(caps[n] - out[n], amount * weights[n] / weight) for n in open_}
        given = {n: int(v) for n, v in ideal.items()}
        left = amount - sum(given.values())
        for n in sorted(open_, key=lambda n: (-(ideal[n] - given[n]), n)):
            if left <= 0:
                break
            if given[n] < caps[n] - out[n]:
                given[n] += 1
                left -= 1
        if not sum(given.values()):
            break
        for n, g in given.items():
            out[n] += g
        amount -= sum(given.values())
    return out
