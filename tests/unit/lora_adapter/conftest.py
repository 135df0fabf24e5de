"""The scheduler tests' engines over the demo LM (float32): one with a KV prefix cache, one without."""

from __future__ import annotations

import pytest

from warmup_tools.kv.config import KVCacheConfig
from warmup_tools.kv.prefix_cache import PrefixCache
from warmup_tools.lora_adapter.engine import LoraEngine
from warmup_tools.lora_adapter.settings import EngineConfig


def demo_engine(demo_assets, budget_bytes: int) -> LoraEngine:
    return LoraEngine(EngineConfig(base_model=demo_assets.lm_dir, adapter_root=demo_assets.adapter_root,
                                   dtype="float32", kv=KVCacheConfig(budget_bytes=budget_bytes)))


@pytest.fixture(scope="module")
def engine(demo_assets):
    """The engine the scheduler drives (a module that needs another one defines its own ``engine``)."""
    return demo_engine(demo_assets, 64 << 20)


@pytest.fixture(scope="module")
def plain(demo_assets):
    """The same model without a cache, serving one request at a time: what each request must produce."""
    return demo_engine(demo_assets, 0)


@pytest.fixture()
def fresh_cache(engine):
    """A fresh prefix cache per test (so tests do not see each other's blocks); a test may replace it."""
    saved = engine.prefix_cache
    engine.prefix_cache = PrefixCache(64 << 20, 16)
    yield engine
    engine.prefix_cache = saved
