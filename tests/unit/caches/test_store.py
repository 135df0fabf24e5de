"""The local cache is one store and a policy chosen by name: a new policy is one class and one registry line."""

from collections import OrderedDict

import numpy as np
import pytest

from warmup_tools.caches.policies import EVICTION_POLICIES
from warmup_tools.caches.store import ENTRY_OVERHEAD_BYTES, LocalCache
from warmup_tools.common.errors import ConfigError
from warmup_tools.embedding_cache.settings import EmbeddingCacheSettings
from warmup_tools.tokenizer_cache.settings import TokenizerCacheSettings
from warmup_tools.triton.params import ModelParameters


class FirstInFirstOut:
    """A policy written for this test: the oldest insert goes first, hits change nothing."""

    def __init__(self, budget_bytes, settings):
        self._order = OrderedDict()

    def on_insert(self, key, size, now):
        self._order[key] = None

    def on_access(self, key, now):
        pass

    def on_remove(self, key):
        del self._order[key]

    def victim(self, now):
        return next(iter(self._order))


def test_a_new_policy_is_one_class_and_one_registry_line(monkeypatch):
    monkeypatch.setitem(EVICTION_POLICIES, "fifo", FirstInFirstOut)  # the one line
    entry = 400 + 1 + ENTRY_OVERHEAD_BYTES
    cache = LocalCache(3 * entry, "fifo")
    for key in "abc":
        cache.put(key, np.zeros(100, dtype=np.int32))
    assert cache.get("a") is not None  # a hit does not save the oldest insert
    cache.put("d", np.zeros(100, dtype=np.int32))
    assert "a" not in cache and all(k in cache for k in "bcd")
    assert cache.stats.evictions == 1 and cache.stats.hits == 1 and cache.stats.entries == 3
    for i in range(1000):  # the store keeps the budget whatever the policy
        cache.put(f"flood-{i}", np.zeros(100, dtype=np.int32))
        assert cache.stats.bytes_used <= cache.budget_bytes


@pytest.mark.parametrize("eviction", sorted(EVICTION_POLICIES))
def test_every_policy_keeps_the_budget_through_replacements_hits_and_drops(eviction):
    cache = LocalCache(16 << 10, eviction)
    for i in range(2000):
        cache.put(f"k{i % 300}", np.zeros(i % 50 + 1, dtype=np.int32))  # keys come back with other sizes
        cache.get(f"k{(i * 7) % 300}")
        assert cache.stats.bytes_used <= cache.budget_bytes
    assert len(cache) == cache.stats.entries and cache.stats.evictions > 0
    cache.put("last", np.zeros(10, dtype=np.int32))
    used = cache.stats.bytes_used
    assert cache.evict("last") and "last" not in cache and not cache.evict("last")
    assert cache.stats.bytes_used == used - (40 + 4 + ENTRY_OVERHEAD_BYTES) and len(cache) == cache.stats.entries
    while len(cache):  # the policy forgets a dropped key: it never names it as a victim
        cache.put("big", np.zeros(4000, dtype=np.int32))
        cache.evict("big")


def test_an_unknown_policy_is_refused_naming_the_known_ones():
    with pytest.raises(ConfigError, match="known: lru, slru, decayed_lfu"):
        LocalCache(1024, "arc")


def params(model, **values):
    return ModelParameters({"name": model, "parameters": {k: {"string_value": str(v)} for k, v in values.items()}})


def test_each_cache_model_reads_its_eviction_and_knobs_absent_ones_keeping_their_defaults(tmp_path):
    tok = TokenizerCacheSettings.from_parameters(params("tokenizer_cache", tokenizer_path=tmp_path))
    emb = EmbeddingCacheSettings.from_parameters(params("embedding_cache", embedder_path=tmp_path))
    assert (tok.tokenizer.eviction, emb.embedder.eviction) == ("slru", "decayed_lfu")
    assert tok.tokenizer.policy.protected_share == 0.8 and emb.embedder.policy.half_life_s == 600
    given = TokenizerCacheSettings.from_parameters(params("tokenizer_cache", tokenizer_path=tmp_path,
                                                          eviction="lru", slru_protected_share="0.5"))
    assert given.tokenizer.eviction == "lru" and given.tokenizer.policy.protected_share == 0.5
    with pytest.raises(ConfigError, match="parameter eviction must be one of lru, slru, decayed_lfu, not 'arc'"):
        EmbeddingCacheSettings.from_parameters(params("embedding_cache", embedder_path=tmp_path, eviction="arc"))
    with pytest.raises(ConfigError, match="lfu_half_life_s must be > 0"):
        EmbeddingCacheSettings.from_parameters(params("embedding_cache", embedder_path=tmp_path, lfu_half_life_s=0))
