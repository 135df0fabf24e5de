import numpy as np

from warmup_tools.caches import ENTRY_OVERHEAD_BYTES, LRUCache


def test_lru_stays_within_budget_under_a_flood_of_unique_keys():
    cache = LRUCache(budget_bytes=64 * 1024)
    for i in range(10_000):
        cache.put(f"prompt-{i}", np.zeros(100, dtype=np.int32))
        assert cache.stats.bytes_used <= cache.budget_bytes
    assert cache.stats.evictions > 0
    assert len(cache) == cache.stats.entries < 10_000


def test_lru_evicts_least_recently_used_and_counts_hits():
    entry = 400 + ENTRY_OVERHEAD_BYTES
    cache = LRUCache(budget_bytes=3 * entry)
    for key in "abc":
        cache.put(key, np.zeros(100, dtype=np.int32))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("d", np.zeros(100, dtype=np.int32))
    assert "b" not in cache and "a" in cache and "d" in cache
    assert cache.stats.hits == 1


def test_value_larger_than_budget_is_not_stored():
    cache = LRUCache(budget_bytes=100)
    assert cache.put("big", np.zeros(1000, dtype=np.int32)) is False
    assert len(cache) == 0 and cache.stats.bytes_used == 0
