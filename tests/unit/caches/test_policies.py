import numpy as np

from warmup_tools.caches.policies.settings import EvictionSettings
from warmup_tools.caches.store import ENTRY_OVERHEAD_BYTES, LocalCache
from warmup_tools.tokenizer_cache.settings import TokenizerConfig


def test_lru_stays_within_budget_under_a_flood_of_unique_keys():
    cache = LocalCache(64 * 1024, "lru")
    for i in range(10_000):
        cache.put(f"prompt-{i}", np.zeros(100, dtype=np.int32))
        assert cache.stats.bytes_used <= cache.budget_bytes
    assert cache.stats.evictions > 0
    assert len(cache) == cache.stats.entries < 10_000


def test_lru_evicts_least_recently_used_and_counts_hits():
    entry = 400 + 1 + ENTRY_OVERHEAD_BYTES  # value, one-letter key, overhead
    cache = LocalCache(3 * entry, "lru")
    for key in "abc":
        cache.put(key, np.zeros(100, dtype=np.int32))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("d", np.zeros(100, dtype=np.int32))
    assert "b" not in cache and "a" in cache and "d" in cache
    assert cache.stats.hits == 1


def test_value_larger_than_budget_is_not_stored():
    cache = LocalCache(100, "lru")
    assert cache.put("big", np.zeros(1000, dtype=np.int32)) is False
    assert len(cache) == 0 and cache.stats.bytes_used == 0


def test_segmented_lru_keeps_entries_that_are_hit_again_through_a_burst_of_one_offs():
    entry = 400 + 8 + ENTRY_OVERHEAD_BYTES  # keys of at most 8 characters
    cache = LocalCache(10 * entry, "slru")
    for key in ("hot1", "hot2"):
        cache.put(key, np.zeros(100, dtype=np.int32))
        cache.get(key)  # hit again: protected
    for i in range(1000):
        cache.put(f"once-{i}", np.zeros(100, dtype=np.int32))
        assert cache.stats.bytes_used <= cache.budget_bytes
    assert "hot1" in cache and "hot2" in cache
    assert len(cache) == 10


def test_decayed_lfu_evicts_cold_entries_and_forgets_old_heat():
    now = [0.0]
    entry = 400 + 9 + ENTRY_OVERHEAD_BYTES  # keys of at most 9 characters
    cache = LocalCache(20 * entry, "decayed_lfu", EvictionSettings(half_life_s=10, sample_size=20),
                       clock=lambda: now[0])
    cache.put("hot", np.zeros(100, dtype=np.int32))
    for _ in range(50):
        cache.get("hot")
    for i in range(500):
        cache.put(f"cold-{i}", np.zeros(100, dtype=np.int32))
        assert cache.stats.bytes_used <= cache.budget_bytes
    assert "hot" in cache
    now[0] = 1000.0  # a hundred half-lives later its heat is gone
    for i in range(500, 1000):
        cache.put(f"cold-{i}", np.zeros(100, dtype=np.int32))
        cache.get(f"cold-{i}")
    assert "hot" not in cache


def test_tokenizer_service_gives_full_tokenisation_ids_through_templates(demo_assets):
    from warmup_tools.demo.prompts import SYSTEM_PROMPTS
    from warmup_tools.tokenizer_cache.service import TokenizerService

    service = TokenizerService(TokenizerConfig(demo_assets.lm_dir))
    template = SYSTEM_PROMPTS["legal"]
    assert service.register_template(template)
    for question in ("Clause 7?", " indemnity and 30 days", "\\nUser: hello", "é中文🙂"):
        text = template + question
        ids, source = service.encode(text, "acme")
        assert source == "computed"
        assert ids.tolist() == service.tokenizer.encode(text, add_special_tokens=True)
    assert service.templates.stats.hits >= 1
    assert service.encode(template + "Clause 7?", "acme")[1] == "local"
    assert service.encode(template + "Clause 7?", "globex")[1] == "computed"  # tenants never share


def test_keys_count_in_the_budget_a_flood_of_huge_tenant_ids_stays_within_it():
    """2,000 entries keyed by a 256 KiB client-chosen tenant id: the budget bounds keys, not only values."""
    budget = 4 << 20
    for cache in (LocalCache(budget, "lru"), LocalCache(budget, "slru"), LocalCache(budget, "decayed_lfu")):
        for i in range(2000):
            cache.put((f"{i:06d}" + "t" * (256 << 10), b"digest"), np.zeros(4, dtype=np.int32))
            assert cache.stats.bytes_used <= budget
        assert len(cache) <= budget // (256 << 10)
