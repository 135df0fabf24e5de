from warmup_tools.caches.policies.lru import LRUPolicy
from warmup_tools.tokenizer_cache.service import TokenizerService
from warmup_tools.tokenizer_cache.settings import TokenizerConfig


def test_the_local_tier_is_built_from_the_settings_eviction(demo_assets):
    assert TokenizerService(TokenizerConfig(demo_assets.lm_dir)).local.eviction == "slru"
    service = TokenizerService(TokenizerConfig(demo_assets.lm_dir, cache_bytes=4096, eviction="lru"))
    assert isinstance(service.local.policy, LRUPolicy) and service.local.budget_bytes == 4096
    for i in range(100):  # a flood of unique prompts stays within cache_bytes
        service.encode(f"prompt number {i} " * 5, "acme")
        assert service.local.stats.bytes_used <= 4096
    assert service.local.stats.evictions > 0
