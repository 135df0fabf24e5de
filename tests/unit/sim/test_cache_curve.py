"""bench cache-curve: hits counted up to a request's first missing block, the unbounded cache at the trie's bound,
capacity in tokens, and the table beside the paper's figures."""

from __future__ import annotations

import pytest

from warmup_tools.sim.bench.cache_curve import Point, hit_rate, report
from warmup_tools.sim.traces import TraceRequest, prefix_reuse


def request(at_s, *ids):
    return TraceRequest(at_s, tuple(ids), 512 * len(ids), 1)


REQUESTS = [request(0, 1, 2, 3), request(1, 1, 2, 4), request(2, 9, 2, 3), request(3, 1, 2, 3, 5)]


@pytest.mark.parametrize("policy", ["lru", "lfu_ttl"])
def test_an_unbounded_cache_serves_what_an_earlier_request_carried_after_the_same_prefix(policy):
    # 1,2 of the second; none of the third (9 differs, so its 2,3 are another prefix); 1,2,3 of the fourth.
    assert hit_rate(REQUESTS, 1 << 30, 512, policy) == pytest.approx(5 / 13) == pytest.approx(prefix_reuse(REQUESTS))


def test_a_hit_counts_only_up_to_the_first_missing_block():
    # Room for 3 blocks of 512 tokens: after the third request [9, 2, 3] (3 blocks) the cache holds only those, so
    # the fourth request misses its first block and its later blocks count nothing, cached or not.
    rate = hit_rate(REQUESTS, 3 * 512, 512, "lru")
    assert rate == pytest.approx(2 / 13)
    assert hit_rate(REQUESTS, 511, 512, "lru") == 0.0  # no room for one block


def test_the_table_sets_each_capacity_beside_the_bound_and_the_papers_figure():
    points = [Point("conversation", "lru", 3_000_000, 0.12), Point("conversation", "lru", 100_000_000, 0.366)]
    text = report("conversation", 0.366, points, ["lru"], [3_000_000, 100_000_000])
    assert "the paper's Table 2 cache ratio 40%" in text
    assert "| 3,000,000 | 12.0% (33% of the bound) | 41% of its maximum |" in text
    assert "| 100,000,000 | 36.6% (100% of the bound) |  |" in text
