import subprocess
import sys

import pytest
import torch

from warmup_tools.kv.blocks import BlockSource
from warmup_tools.kv.hashing import NONE_HASH, CacheScope, block_hashes, hash_block_tokens
from warmup_tools.kv.prefix_cache import PrefixCache

BS = 4
SCOPE = CacheScope(base_fingerprint="base-1", adapter="support", adapter_fingerprint="a1", tenant="acme")
LAYERS, HEADS, DIM = 2, 1, 3


def kv_for(tokens):
    """Per-layer KV whose values encode (layer, token id), so a loaded block can be checked."""
    t = torch.tensor(tokens, dtype=torch.float32)
    layers = []
    for layer in range(LAYERS):
        k = (t * 10 + layer).view(1, 1, -1, 1).expand(1, HEADS, -1, DIM).clone()
        layers.append((k, -k))
    return layers


def block_bytes():
    return LAYERS * 2 * HEADS * BS * DIM * 4


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_hashes_are_chained_scoped_and_stable_across_processes():
    tokens = list(range(10))
    hashes = block_hashes(tokens, BS, SCOPE)
    assert len(hashes) == 2  # the trailing partial block has no hash
    assert hashes[0] == hash_block_tokens(NONE_HASH, tokens[:4], SCOPE.extra_keys())
    assert hashes[1] == hash_block_tokens(hashes[0], tokens[4:8], SCOPE.extra_keys())
    # Same second block after a different first block: a different name.
    assert block_hashes([9, 9, 9, 9] + tokens[4:8], BS, SCOPE)[1] != hashes[1]
    for other in (CacheScope("base-1", "legal", "a1", "acme"), CacheScope("base-1", "support", "a2", "acme"),
                  CacheScope("base-1", "support", "a1", "other"), CacheScope("base-2", "support", "a1", "acme")):
        assert block_hashes(tokens, BS, other)[0] != hashes[0]
    code = ("from warmup_tools.kv.hashing import CacheScope, block_hashes;"
            "print(block_hashes(list(range(10)), 4, CacheScope('base-1','support','a1','acme'))[1].hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout.strip()
    assert out == hashes[1].hex()


def test_longest_prefix_match_and_exact_kv_round_trip():
    cache = PrefixCache(budget_bytes=10 * block_bytes(), block_size=BS)
    tokens = list(range(1, 13))
    hashes = block_hashes(tokens, BS, SCOPE)
    assert cache.store(hashes, kv_for(tokens)) == 3
    query = tokens[:8] + [99, 98, 97, 96]
    match = cache.match(block_hashes(query, BS, SCOPE))
    assert match.num_tokens == 8
    keys, values = cache.load(match, torch.float32)[1]
    assert keys.shape == (1, HEADS, 8, DIM)
    assert torch.equal(keys[0, 0, :, 0], torch.tensor(tokens[:8], dtype=torch.float32) * 10 + 1)
    assert torch.equal(values, -keys)
    cache.release(match)
    assert cache.stats.hit_blocks == 2 and cache.stats.query_blocks == 3


def test_tenant_and_adapter_isolation():
    cache = PrefixCache(budget_bytes=10 * block_bytes(), block_size=BS)
    tokens = list(range(8))
    cache.store(block_hashes(tokens, BS, SCOPE), kv_for(tokens), source=BlockSource.WARMUP)
    for other in (CacheScope("base-1", "support", "a1", "globex"), CacheScope("base-1", "legal", "l1", "acme"),
                  CacheScope("base-1", "support", "a1-changed", "acme")):
        assert cache.match(block_hashes(tokens, BS, other)).num_tokens == 0
    assert cache.match(block_hashes(tokens, BS, SCOPE)).num_tokens == 8


def test_flood_of_unique_prompts_stays_within_budget():
    budget = 50 * block_bytes()
    cache = PrefixCache(budget_bytes=budget, block_size=BS)
    for i in range(10_000):
        tokens = [i, i + 1, i + 2, i + 3, 7, 7, 7, 7]
        match = cache.match(block_hashes(tokens, BS, SCOPE))
        cache.store(block_hashes(tokens, BS, SCOPE), kv_for(tokens), start_block=len(match))
        cache.release(match)
        assert cache.stats.bytes_used <= budget
    assert cache.stats.evictions > 9_000
    assert len(cache) == cache.stats.blocks <= 50


def test_pinned_warmup_blocks_survive_live_floods_until_the_plan_changes():
    budget = 20 * block_bytes()
    cache = PrefixCache(budget_bytes=budget, block_size=BS, live_reserve=0.15)
    hot = list(range(100, 108))
    hot_hashes = block_hashes(hot, BS, SCOPE)
    assert cache.store(hot_hashes, kv_for(hot), source=BlockSource.WARMUP, plan_id="plan-a") == 2
    for i in range(500):
        tokens = [i] * 8
        cache.store(block_hashes(tokens, BS, SCOPE), kv_for(tokens))
    assert all(h in cache for h in hot_hashes)
    assert cache.stats.pinned_bytes == 2 * block_bytes()
    cache.activate_plan("plan-b")
    assert cache.stats.pinned_bytes == 0
    for i in range(500, 1000):
        tokens = [i] * 8
        cache.store(block_hashes(tokens, BS, SCOPE), kv_for(tokens))
    assert not any(h in cache for h in hot_hashes)


def test_warmup_cannot_take_the_live_reserve():
    budget = 20 * block_bytes()
    cache = PrefixCache(budget_bytes=budget, block_size=BS, live_reserve=0.15, warm_share=1.0)
    tokens = list(range(4 * 30))
    stored = cache.store(block_hashes(tokens, BS, SCOPE), kv_for(tokens), source=BlockSource.WARMUP, plan_id="p")
    assert stored == 17  # floor(0.85 * 20)
    assert cache.stats.warmup_bytes <= cache.warmup_budget
    live = [5000 + i for i in range(12)]
    assert cache.store(block_hashes(live, BS, SCOPE), kv_for(live)) == 3  # live traffic still has room


def test_pinning_live_blocks_counts_against_the_warmup_cap():
    """The issue's reproduction: 10 live blocks pinned by a warm-up store against a cap of 8."""
    cache = PrefixCache(budget_bytes=10 * block_bytes(), block_size=BS, live_reserve=0.2, warm_share=1.0)
    assert cache.warmup_budget == 8 * block_bytes()
    tokens = list(range(4 * 10))
    hashes = block_hashes(tokens, BS, SCOPE)
    assert cache.store(hashes, kv_for(tokens)) == 10  # live traffic cached them first
    cache.store(hashes, kv_for(tokens), source=BlockSource.WARMUP, plan_id="plan-a")
    assert cache.stats.pinned_bytes == cache.stats.warmup_bytes == 8 * block_bytes()
    assert cache.stats.rejected_blocks == 2  # the two beyond the cap were refused, and counted
    # The live reserve is intact: new live blocks still find room (by evicting the unpinned ones).
    live = [9000 + i for i in range(8)]
    assert cache.store(block_hashes(live, BS, SCOPE), kv_for(live)) == 2


def test_blocks_in_use_are_never_evicted():
    cache = PrefixCache(budget_bytes=2 * block_bytes(), block_size=BS)
    tokens = list(range(8))
    hashes = block_hashes(tokens, BS, SCOPE)
    cache.store(hashes, kv_for(tokens))
    match = cache.match(hashes)
    other = list(range(50, 58))
    assert cache.store(block_hashes(other, BS, SCOPE), kv_for(other)) == 0
    assert all(h in cache for h in hashes)
    cache.release(match)
    assert cache.store(block_hashes(other, BS, SCOPE), kv_for(other)) == 2


def test_lfu_with_ttl_keeps_hot_blocks_and_expires_idle_ones():
    clock = Clock()
    cache = PrefixCache(budget_bytes=3 * block_bytes(), block_size=BS, ttl_s=100, clock=clock)
    hot, warm, cold = [1] * 4, [2] * 4, [3] * 4
    for tokens in (hot, warm, cold):
        cache.store(block_hashes(tokens, BS, SCOPE), kv_for(tokens))
    for _ in range(5):
        cache.release(cache.match(block_hashes(hot, BS, SCOPE)))
    cache.release(cache.match(block_hashes(warm, BS, SCOPE)))
    clock.now = 10
    new = [4] * 4
    cache.store(block_hashes(new, BS, SCOPE), kv_for(new))
    assert block_hashes(cold, BS, SCOPE)[0] not in cache  # least frequently used goes first
    assert block_hashes(hot, BS, SCOPE)[0] in cache
    # After the TTL, the once-hot block is idle and goes before the recently used ones.
    clock.now = 200
    cache.release(cache.match(block_hashes(warm, BS, SCOPE)))
    cache.release(cache.match(block_hashes(new, BS, SCOPE)))
    newer = [5] * 4
    cache.store(block_hashes(newer, BS, SCOPE), kv_for(newer))
    assert block_hashes(hot, BS, SCOPE)[0] not in cache
    assert cache.stats.expired_evictions == 1


def test_parents_are_not_evicted_before_their_children():
    cache = PrefixCache(budget_bytes=3 * block_bytes(), block_size=BS, eviction="lru")
    chain = list(range(12))
    hashes = block_hashes(chain, BS, SCOPE)
    cache.store(hashes, kv_for(chain))
    other = [90] * 4
    cache.store(block_hashes(other, BS, SCOPE), kv_for(other))
    # The leaf of the chain went, not its root: the remaining prefix still matches.
    assert hashes[0] in cache and hashes[1] in cache and hashes[2] not in cache
    assert cache.match(hashes).num_tokens == 8


def test_int8_storage_is_close_and_smaller():
    fp = PrefixCache(budget_bytes=1 << 20, block_size=BS)
    q8 = PrefixCache(budget_bytes=1 << 20, block_size=BS, storage="int8")
    torch.manual_seed(0)
    layers = [(torch.randn(1, HEADS, 8, DIM), torch.randn(1, HEADS, 8, DIM)) for _ in range(LAYERS)]
    hashes = block_hashes(list(range(8)), BS, SCOPE)
    fp.store(hashes, layers)
    q8.store(hashes, layers)
    assert q8.stats.bytes_used < fp.stats.bytes_used / 2
    restored = q8.load(q8.match(hashes), torch.float32)
    for (k, v), (rk, rv) in zip(layers, restored):
        assert torch.allclose(k, rk, atol=0.03) and torch.allclose(v, rv, atol=0.03)


def test_unknown_policy_or_storage_is_refused():
    with pytest.raises(ValueError, match="eviction"):
        PrefixCache(1024, eviction="fifo")
    with pytest.raises(ValueError, match="storage"):
        PrefixCache(1024, storage="fp4")


def test_public_blocks_are_shared_and_chain_into_per_tenant_blocks():
    tokens = list(range(16))
    other = CacheScope(base_fingerprint="base-1", adapter="support", adapter_fingerprint="a1", tenant="globex")
    a, b = block_hashes(tokens, BS, SCOPE, public_blocks=2), block_hashes(tokens, BS, other, public_blocks=2)
    assert a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]
    assert block_hashes(tokens, BS, SCOPE)[0] != a[0]  # a public block is not the tenant's private one
    assert block_hashes(tokens, BS, SCOPE, public_blocks=0) == block_hashes(tokens, BS, SCOPE)


def test_a_block_written_for_one_tenant_is_never_matched_for_another():
    """Defence in depth: even under the same hash (as if scopes collided), the block's tenant is checked."""
    cache = PrefixCache(budget_bytes=10 * block_bytes(), block_size=BS)
    tokens = list(range(12))
    hashes = block_hashes(tokens, BS, SCOPE)
    cache.store(hashes, kv_for(tokens), tenant="acme", public_blocks=1)
    assert cache.match(hashes, "acme").num_tokens == 12
    assert cache.match(hashes, "globex").num_tokens == 4  # the public first block only
    assert cache.stats.cross_tenant_hits == 1
    assert cache.match(hashes).num_tokens == 12  # no tenant given: no check (in-process tools)
