"""Splitting the KV warm-up budget across adapters by measured need."""

from __future__ import annotations

import pytest

from warmup_tools.planning.arbitrate import AdapterNeed, _water_fill, arbitrate


def caps(shares):
    return {name: share.cap_blocks for name, share in shares.items()}


NEEDS = [AdapterNeed("big", rate=90.0, cold_rate=30.0, first_blocks=10, hot_blocks=100),
         AdapterNeed("small", rate=10.0, cold_rate=10.0, first_blocks=4, hot_blocks=20)]


def test_hot_sets_that_fit_are_held_whole():
    shares = arbitrate(NEEDS, total_blocks=500, per_adapter_blocks=500)
    assert caps(shares) == {"big": 100, "small": 20} and "fit" in shares["small"].reason


@pytest.mark.parametrize("total, expected", [
    (60, {"big": 51, "small": 9}),    # first blocks (14) first, then 46 by traffic 90:10 (41.4 / 4.6)
    (14, {"big": 10, "small": 4}),    # exactly the first blocks
    (8, {"big": 6, "small": 2}),      # first blocks by cold rate 30:10
    (110, {"big": 96, "small": 14}),  # 96 by traffic: 86.4 / 9.6
    (119, {"big": 100, "small": 19}),  # big is full at its hot set; small takes the rest
])
def test_a_budget_below_the_hot_sets_goes_first_to_first_blocks_then_by_traffic(total, expected):
    got = caps(arbitrate(NEEDS, total_blocks=total, per_adapter_blocks=total))
    assert got == expected and sum(got.values()) == total


def test_the_operator_bound_per_adapter_holds_and_the_rest_goes_elsewhere():
    got = caps(arbitrate(NEEDS, total_blocks=60, per_adapter_blocks=30))
    assert got == {"big": 30, "small": 20}


def test_fixed_gives_every_adapter_the_bound_and_unknown_modes_are_refused():
    assert caps(arbitrate(NEEDS, total_blocks=60, per_adapter_blocks=30, mode="fixed")) == {"big": 30, "small": 30}
    with pytest.raises(ValueError, match="measured, fixed"):
        arbitrate(NEEDS, 60, 60, mode="even")


def test_water_fill_is_whole_blocks_bounded_and_deterministic():
    assert _water_fill(10, {"a": 1.0, "b": 1.0, "c": 1.0}, {"a": 5, "b": 5, "c": 1}, {}) == {"a": 5, "b": 4, "c": 1}
    assert _water_fill(10, {"a": 0.0}, {"a": 5}, {}) == {"a": 0}
    assert _water_fill(3, {"a": 1.0}, {"a": 5}, {"a": 1}) == {"a": 4}
