"""The scheduler tests' engine over the demo LM (float32) with a KV prefix cache, the reference it is checked
against, and ways to serve a request through the scheduler."""

from __future__ import annotations

import pytest

from warmup_tools.kv.config import KVCacheConfig
from warmup_tools.kv.prefix_cache import PrefixCache
from warmup_tools.lora_adapter.engine_api import SequenceEngine
from warmup_tools.lora_adapter.engines import make_engine
from warmup_tools.lora_adapter.settings import EngineConfig


def demo_engine(demo_assets, budget_bytes: int) -> SequenceEngine:
    return make_engine(EngineConfig(base_model=demo_assets.lm_dir, adapter_root=demo_assets.adapter_root,
                                   dtype="float32", kv=KVCacheConfig(budget_bytes=budget_bytes)))


@pytest.fixture(scope="module")
def engine(demo_assets):
    """The engine the scheduler drives (a module that needs another one defines its own ``engine``)."""
    return demo_engine(demo_assets, 64 << 20)


@pytest.fixture(scope="session")
def reference(demo_assets):
    """What each request must produce: the demo LM and adapters through plain Hugging Face and peft, one
    request alone (tests/reference.py): ``reference.generate(request)`` is its ``(tokens, text)``."""
    from tests.reference import HfReference

    return HfReference(demo_assets.lm_dir, demo_assets.adapter_root)


@pytest.fixture()
def fresh_cache(engine):
    """A fresh prefix cache per test (so tests do not see each other's blocks); a test may replace it."""
    saved = engine.prefix_cache
    engine.prefix_cache = PrefixCache(64 << 20, 16)
    yield engine
    engine.prefix_cache = saved


def start_service(engine, config, *, instance="test_0", batching=None):
    """A LoraService over a started scheduler of its own (``service.close()`` stops it)."""
    from warmup_tools.lora_adapter.scheduler import Scheduler
    from warmup_tools.lora_adapter.service import LoraService
    from warmup_tools.lora_adapter.settings import DEFAULT_BATCHING

    scheduler = Scheduler(engine, batching or DEFAULT_BATCHING)
    scheduler.start()
    try:
        return LoraService(engine, config, instance=instance, scheduler=scheduler)
    except BaseException:
        scheduler.stop()
        raise


class CollectingSink:
    """A sequence sink that keeps every step and error and says when the request ended."""

    def __init__(self):
        import threading

        self.steps, self.errors, self.done = [], [], threading.Event()

    def send(self, step):
        self.steps.append(step)
        if step.finished:
            self.done.set()

    def fail(self, error):
        self.errors.append(error)
        self.done.set()

    def is_cancelled(self):
        return False

    def wait(self, timeout_s=300):
        assert self.done.wait(timeout_s), "the request did not end"
        if self.errors:
            raise self.errors[0]
        return self.steps


def serve(engine, request, config=None):
    """Serve one request through a scheduler of its own, stepped on this thread until it ends: its steps
    (the request's error, if it has one, is raised)."""
    from warmup_tools.lora_adapter.scheduler import Scheduler
    from warmup_tools.lora_adapter.settings import DEFAULT_BATCHING

    scheduler = Scheduler(engine, config or DEFAULT_BATCHING)
    sink = CollectingSink()
    scheduler.submit(request, sink)
    while scheduler.has_work():
        scheduler.step()
    return sink.wait(0)


def serve_and_wait(service, request):
    """Serve one request through the service (its scheduler) and return its steps."""
    sink = CollectingSink()
    service.serve(request, sink)
    return sink.wait()
