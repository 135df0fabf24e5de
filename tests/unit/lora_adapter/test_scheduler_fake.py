"""The scheduler's own logic on an engine without a model (tests/unit/lora_adapter/fake_engine.py): batching,
chunked prefill, the prefix cache, preemption, cancellation and bounds, and a fuzz of many requests at once.

Each step is driven by hand (``scheduler.step()``), so nothing here depends on threads or time. The same
properties are checked against the real engine and the demo LM in test_scheduler.py and
test_scheduler_faults.py; here they run in milliseconds, so the fuzz can try far more mixes.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.lora_adapter.fake_engine import VOCAB, FakeEngine
from tests.unit.lora_adapter.test_scheduler import RecordingSink, drain
from warmup_tools.common.errors import RequestCancelledError, ServerBusyError
from warmup_tools.lora_adapter.engine_api import SequenceEngine
from warmup_tools.lora_adapter.hf import HfEngine
from warmup_tools.lora_adapter.packed import PackedEngine
from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams
from warmup_tools.lora_adapter.scheduler import Scheduler
from warmup_tools.lora_adapter.settings import SchedulerConfig
from warmup_tools.lora_adapter.simulated import SimulatedEngine

ADAPTERS = (None, "support", "legal", "sql")


def request(ids, adapter=None, max_tokens=8, tenant="acme", **sampling):
    return GenerateRequest(tuple(ids), adapter, tenant, True, SamplingParams(max_tokens=max_tokens, **sampling))


def alone(req, **engine_options):
    """The tokens ``req`` gets when it is the only request, on a fresh fake engine without a prefix cache."""
    engine = FakeEngine(budget_bytes=0, **engine_options)
    scheduler = Scheduler(engine, SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=4096))
    sink = RecordingSink()
    scheduler.submit(req, sink)
    drain(scheduler)
    assert not sink.errors
    return sink.tokens


def prompts(count, seed=0, shared=12):
    rng = random.Random(seed)
    prefix = [rng.randrange(2, VOCAB) for _ in range(shared)]
    return [prefix + [rng.randrange(2, VOCAB) for _ in range(rng.randrange(1, 40))] for _ in range(count)]


def assert_nothing_held(scheduler, engine):
    assert not scheduler.has_work() and scheduler.running == [] and scheduler.waiting == []
    assert scheduler._inflight == {}
    if engine.prefix_cache is not None:
        assert engine.prefix_cache.stats.running_bytes == 0
        assert all(block.ref_count == 0 for block in engine.prefix_cache._blocks.values())
    assert engine.held_sequences() == 0  # the engine forgot every sequence: no KV, logits or generator left


def test_the_fake_has_every_member_the_scheduler_uses_and_so_does_each_forward():
    members = {name for name in SequenceEngine.__dict__ if not name.startswith("_")}
    members |= set(SequenceEngine.__annotations__)
    assert members >= {"open", "load_prefix", "forward", "store_prefix", "sample", "release", "close",
                       "prefix_cache", "check_request", "kv_bytes_per_token"}
    assert not members & {"forward_batch", "device", "dtype"}  # tensors stay behind the interface
    fake = FakeEngine()
    assert all(hasattr(fake, name) for name in members)
    for forward in (PackedEngine, HfEngine, SimulatedEngine):
        methods = {name for name in members if callable(getattr(forward, name, None))}
        assert methods | {"prefix_cache", "eos_token_ids", "tokenizer", "kv_bytes_per_token", "mixed_rows"} >= members


def test_batched_output_equals_each_request_alone_with_chunked_prefill_and_a_shared_prefix():
    engine = FakeEngine(block_size=4)
    scheduler = Scheduler(engine, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16))
    requests = [request(ids, ADAPTERS[i % 4]) for i, ids in enumerate(prompts(10))]
    sinks = [RecordingSink() for _ in requests]
    for req, sink in zip(requests, sinks):
        scheduler.submit(req, sink)
    reports = drain(scheduler)
    for req, sink in zip(requests, sinks):
        assert not sink.errors and sink.tokens == alone(req)
    assert all(r.live_tokens <= 16 for r in reports) and max(r.batch_size for r in reports) == 4
    # The shared 12-token prefix (3 blocks) was computed once per scope and then served from the cache.
    assert any(sink.steps[-1].cached_tokens >= 12 for sink in sinks)
    assert_nothing_held(scheduler, engine)


def test_preemption_under_a_tiny_budget_leaves_every_output_unchanged():
    engine = FakeEngine(budget_bytes=60 * 2 * 2 * 1 * 3 * 4, block_size=4)  # about 60 tokens of KV
    scheduler = Scheduler(engine, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32))
    requests = [request(ids, ADAPTERS[i % 4], max_tokens=12) for i, ids in enumerate(prompts(6, seed=3))]
    sinks = [RecordingSink() for _ in requests]
    for req, sink in zip(requests, sinks):
        scheduler.submit(req, sink)
    drain(scheduler)
    assert scheduler.stats.preemptions > 0
    for req, sink in zip(requests, sinks):
        assert not sink.errors and sink.tokens == alone(req)
    assert_nothing_held(scheduler, engine)


def test_a_cancelled_request_ends_with_cancelled_and_frees_its_slot_and_memory():
    engine = FakeEngine()
    scheduler = Scheduler(engine, SchedulerConfig(max_num_seqs=1, cancel_check_s=0))
    first, second = RecordingSink(), RecordingSink()
    scheduler.submit(request(prompts(1)[0], max_tokens=50), first)
    scheduler.submit(request(prompts(1, seed=1)[0]), second)
    scheduler.step()
    scheduler.step()
    first.cancelled = True
    drain(scheduler)
    assert [type(e) for e in first.errors] == [RequestCancelledError] and not second.errors
    assert second.steps[-1].finished
    assert_nothing_held(scheduler, engine)


def test_beyond_the_queue_bound_a_request_is_refused_at_once():
    # NOTE: one tenant may fill the queue here (tenant_queue_share 1): the bound tested is the instance's.
    scheduler = Scheduler(FakeEngine(), SchedulerConfig(max_num_seqs=1, max_queue=2, tenant_queue_share=1))
    for ids in prompts(3):
        scheduler.submit(request(ids), RecordingSink())
    with pytest.raises(ServerBusyError):
        scheduler.submit(request(prompts(1)[0]), RecordingSink())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_every_request_gets_one_outcome_its_alone_output_and_nothing_is_held(data):
    block_size = data.draw(st.sampled_from([1, 2, 4, 16]))
    engine = FakeEngine(budget_bytes=data.draw(st.sampled_from([0, 400 * 48, 4000 * 48])), block_size=block_size)
    config = SchedulerConfig(max_num_seqs=data.draw(st.integers(1, 6)), max_queue=64, cancel_check_s=0,
                             max_num_batched_tokens=data.draw(st.integers(6, 64)))
    scheduler = Scheduler(engine, config)
    count = data.draw(st.integers(1, 12))
    shared = data.draw(st.integers(0, 20))
    cases = []
    for ids in prompts(count, seed=data.draw(st.integers(0, 10_000)), shared=shared):
        req = request(ids, data.draw(st.sampled_from(ADAPTERS)), max_tokens=data.draw(st.integers(1, 10)),
                      tenant=data.draw(st.sampled_from(["acme", "globex"])))
        sink = RecordingSink()
        scheduler.submit(req, sink)
        cases.append((req, sink, data.draw(st.booleans()) and data.draw(st.booleans())))  # a quarter cancel
    steps = 0
    while scheduler.has_work():
        for _req, sink, cancel in cases:
            if cancel and len(sink.steps) >= 1:
                sink.cancelled = True
        scheduler.step()
        steps += 1
        assert steps < 5000, "no progress"
    for req, sink, cancel in cases:
        finals = [s for s in sink.steps if s.finished]
        assert len(finals) + len(sink.errors) == 1, "every request ends exactly once"
        if not sink.errors:
            assert sink.tokens == alone(req)
        else:
            assert cancel and isinstance(sink.errors[0], RequestCancelledError)
    assert_nothing_held(scheduler, engine)


def test_a_client_is_asked_whether_it_cancelled_at_most_every_cancel_check_s():
    """Each is_cancelled() is a round trip to Triton: asked of one sequence at most every cancel_check_s (on
    the scheduler's clock, here a hand-moved one), and a cancellation is seen at the first look after it."""
    now = [0.0]
    asked = []

    class CountingSink(RecordingSink):
        def is_cancelled(self):
            asked.append(now[0])
            return self.cancelled

    scheduler = Scheduler(FakeEngine(), SchedulerConfig(cancel_check_s=0.05), clock=lambda: now[0])
    sink = CountingSink()
    scheduler.submit(request(prompts(1)[0], max_tokens=50), sink)
    for _ in range(5):
        scheduler.step()
    assert asked == [0.0] and len(sink.steps) == 5
    sink.cancelled = True
    now[0] = 0.04
    scheduler.step()
    assert asked == [0.0] and not sink.errors and len(sink.steps) == 6
    now[0] = 0.05
    scheduler.step()
    assert asked == [0.0, 0.05] and isinstance(sink.errors[0], RequestCancelledError) and len(sink.steps) == 6
