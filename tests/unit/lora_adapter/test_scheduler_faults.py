"""Faults inside the continuous-batching scheduler: one sequence's failure ends that sequence only, nothing
is left holding a slot or KV memory, and the loop waits instead of spinning (the demo LM, no timing).

The fault injections (a forward, a sampler or a step made to raise) are unit-test stand-ins for faults the
real parts do not show on demand; the denormal temperature and the fuzz test run the real sampler.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.unit.lora_adapter.test_scheduler import ADAPTERS, RecordingSink, drain, make_request
from warmup_tools.common.errors import InvalidInputError, RequestCancelledError, RequestError
from warmup_tools.demo.prompts import SYSTEM_PROMPTS
from warmup_tools.kv.prefix_cache import PrefixCache
from warmup_tools.lora_adapter import sampling as sampling_module
from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams
from warmup_tools.lora_adapter.scheduler import Scheduler
from warmup_tools.lora_adapter.settings import SchedulerConfig

#: How long a thread test waits for an outcome it expects; only a failing test ever waits this long.
OUTCOME_TIMEOUT_S = 120


def assert_nothing_held(scheduler, engine):
    """No slot, queue entry, single-flight claim, reserved KV byte or held cache block is left."""
    assert not scheduler.has_work()
    assert scheduler.running == [] and scheduler.waiting == []
    assert scheduler._inflight == {}
    cache = engine.prefix_cache
    assert cache.stats.running_bytes == 0
    assert all(block.ref_count == 0 for block in cache._blocks.values())
    assert engine.held_sequences() == 0  # no KV, logits or generator left in the engine
    assert scheduler.step().idle  # and a step finds nothing to do


def denormal(engine, text="Hello there"):
    """A sampled request whose temperature (1e-40, subnormal in float32) the sampler cannot use; built
    directly, as validation refuses it: this is the engine's own safety net."""
    return make_request(engine, text, None, max_tokens=6, temperature=1e-40, seed=3)


# ------------------------------------------------------------------------------- one sequence fails
def test_a_denormal_temperature_ends_only_its_sequences_with_invalid_arg_and_frees_their_slots(fresh_cache,
                                                                                                reference):
    engine = fresh_cache
    scheduler = Scheduler(engine, SchedulerConfig(max_num_seqs=2, max_queue=16))
    bad = [RecordingSink() for _ in range(6)]
    for sink in bad:
        scheduler.submit(denormal(engine), sink)
    good = make_request(engine, "Hello there", "support", max_tokens=6)
    served = RecordingSink()
    scheduler.submit(good, served)  # behind six bad ones, with two slots
    drain(scheduler)
    for sink in bad:
        assert not sink.steps and len(sink.errors) == 1
        assert isinstance(sink.errors[0], InvalidInputError) and sink.errors[0].code == "INVALID_ARG"
        assert "temperature" in str(sink.errors[0]) and "1e-40" not in str(sink.errors[0])
    assert not served.errors and served.tokens == reference.generate(good).tokens
    assert_nothing_held(scheduler, engine)


def test_an_exception_while_sampling_one_sequence_ends_it_with_internal_and_the_batch_goes_on(
        fresh_cache, reference, monkeypatch):
    engine = fresh_cache
    real = sampling_module.next_token

    def faulty(logits, params, generator, tokens=()):
        if params.seed == 666:
            raise ValueError("a fault inside the sampler")
        return real(logits, params, generator, tokens)

    monkeypatch.setattr(sampling_module, "next_token", faulty)
    scheduler = Scheduler(engine)
    requests = [make_request(engine, "Tell me a story", None, max_tokens=5, temperature=1.0, seed=seed)
                for seed in (1, 666, 2)]
    sinks = [RecordingSink() for _ in requests]
    for req, sink in zip(requests, sinks):
        scheduler.submit(req, sink)
    drain(scheduler)
    assert len(sinks[1].errors) == 1 and not isinstance(sinks[1].errors[0], RequestError)  # INTERNAL
    for index in (0, 2):
        assert not sinks[index].errors and sinks[index].tokens == reference.generate(requests[index]).tokens
    assert_nothing_held(scheduler, engine)


def test_a_failed_batched_forward_is_retried_row_by_row_so_only_the_failing_row_ends(fresh_cache, reference,
                                                                                      monkeypatch):
    engine = fresh_cache
    forward = engine.forward
    calls = []

    def faulty(rows):
        calls.append(len(rows))
        if any(row.adapter == "sql" for row in rows):
            raise RuntimeError("a fault in the sql rows' forward")
        return forward(rows)

    monkeypatch.setattr(engine, "forward", faulty)
    scheduler = Scheduler(engine, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    requests = [make_request(engine, "Hello, who are you?", adapter, max_tokens=4) for adapter in ADAPTERS]
    sinks = [RecordingSink() for _ in requests]
    for req, sink in zip(requests, sinks):
        scheduler.submit(req, sink)
    drain(scheduler)
    assert calls[:5] == [4, 1, 1, 1, 1]  # the batch, then each row alone
    for req, sink in zip(requests, sinks):
        if req.adapter == "sql":
            assert not sink.steps and len(sink.errors) == 1 and not isinstance(sink.errors[0], RequestError)
        else:
            assert not sink.errors and sink.tokens == reference.generate(req).tokens
    assert_nothing_held(scheduler, engine)


def test_a_forward_that_always_fails_ends_every_sequence_with_one_error(fresh_cache, monkeypatch):
    engine = fresh_cache

    def broken(rows):
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(engine, "forward", broken)
    scheduler = Scheduler(engine)
    sinks = [RecordingSink() for _ in range(3)]
    for sink, text in zip(sinks, ("Hello", "Hello there", "Hi")):
        scheduler.submit(make_request(engine, text, None, max_tokens=4), sink)
    done = scheduler.submit_warm("sql", engine.encode(SYSTEM_PROMPTS["sql"]))
    drain(scheduler)
    for sink in sinks:
        assert not sink.steps and len(sink.errors) == 1
    with pytest.raises(RuntimeError, match="the device is gone"):
        done.result(timeout=0)
    assert_nothing_held(scheduler, engine)


def test_a_live_request_does_not_wait_for_a_warm_prompt_computing_its_prefix(fresh_cache, reference):
    engine = fresh_cache
    scheduler = Scheduler(engine, SchedulerConfig(max_num_batched_tokens=32, warm_chunk_tokens=16),
                          clock=lambda: 0.0)
    warm_ids = engine.encode(SYSTEM_PROMPTS["sql"])
    done = scheduler.submit_warm("sql", warm_ids)
    scheduler.step()  # the warm prompt holds the claim on its next uncached block
    live = GenerateRequest(warm_ids + (5,), "sql", "default", True, SamplingParams(max_tokens=3))
    sink = RecordingSink()
    scheduler.submit(live, sink)
    drain(scheduler)  # NOTE: before, each waited for the other and every step was empty, forever
    assert not sink.errors and sink.tokens == reference.generate(live).tokens
    assert done.result(timeout=0) > 0
    assert_nothing_held(scheduler, engine)


# ------------------------------------------------------------------------------------ the thread
@dataclasses.dataclass
class EventSink(RecordingSink):
    """A sink whose final response (the last token or an error) sets an event the test waits on."""

    final: threading.Event = dataclasses.field(default_factory=threading.Event)
    finals: int = 0

    def send(self, step):
        super().send(step)
        if step.finished:
            self.finals += 1
            self.final.set()

    def fail(self, error):
        super().fail(error)
        self.finals += 1
        self.final.set()


def busy_waits(seen: queue.Queue):
    """Each ``stats.steps`` at which the thread blocked on its condition while holding work."""
    while True:
        steps, busy = seen.get(timeout=OUTCOME_TIMEOUT_S)
        if busy:
            yield steps


def test_a_step_that_changes_nothing_is_idle_and_the_thread_blocks_instead_of_spinning(fresh_cache, monkeypatch):
    engine = fresh_cache
    seen: queue.Queue = queue.Queue()
    scheduler = Scheduler(engine, on_wait=lambda s: seen.put((s.stats.steps, s.has_work())))
    monkeypatch.setattr(scheduler, "_try_admit", lambda seq: False)  # a request that can never be admitted
    stuck = EventSink()
    scheduler.submit(make_request(engine, "Hello", None), stuck)
    scheduler.start()
    try:
        waits = busy_waits(seen)
        # Step 1 takes the request in, step 2 changes nothing: the thread then blocks, holding the request.
        assert next(waits) == 2
        scheduler.call(lambda: None).result(timeout=OUTCOME_TIMEOUT_S)  # wakes it: one step runs the call,
        assert next(waits) == 4  # the next changes nothing again, and it blocks again
    finally:
        scheduler.stop()
    assert stuck.final.is_set() and stuck.errors[0].code == "UNAVAILABLE"


def test_through_the_thread_sixteen_denormal_requests_end_with_errors_then_an_ordinary_one_is_served(
        fresh_cache, reference):
    engine = fresh_cache
    seen: queue.Queue = queue.Queue()
    scheduler = Scheduler(engine, SchedulerConfig(max_num_seqs=4, max_queue=16, tenant_queue_share=1),  # one tenant
                          on_wait=lambda s: seen.put((s.stats.steps, s.has_work())))
    scheduler.start()
    try:
        bad = [EventSink() for _ in range(16)]
        for sink in bad:
            scheduler.submit(denormal(engine), sink)
        for sink in bad:
            assert sink.final.wait(OUTCOME_TIMEOUT_S)
            assert sink.finals == 1 and sink.errors[0].code == "INVALID_ARG"
        good = make_request(engine, "Hello there", "legal", max_tokens=5)
        served = EventSink()
        scheduler.submit(good, served)
        assert served.final.wait(OUTCOME_TIMEOUT_S)
        assert not served.errors and served.tokens == reference.generate(good).tokens
        # The thread goes back to waiting with nothing held (a wait with no work: not spinning on a sequence).
        while True:
            steps, busy = seen.get(timeout=OUTCOME_TIMEOUT_S)
            if not busy and steps == scheduler.stats.steps:
                break
    finally:
        scheduler.stop()
    assert engine.prefix_cache.stats.running_bytes == 0


def test_a_step_that_raises_outside_any_sequence_ends_what_it_held_and_the_thread_serves_on(
        fresh_cache, reference, monkeypatch):
    engine = fresh_cache
    scheduler = Scheduler(engine)
    plan = scheduler._plan
    faults = [RuntimeError("a fault in the scheduler's own planning")]

    def faulty_plan():
        if faults:
            raise faults.pop()
        return plan()

    monkeypatch.setattr(scheduler, "_plan", faulty_plan)
    held = [EventSink(), EventSink()]
    for sink in held:
        scheduler.submit(make_request(engine, "Hello", None, max_tokens=4), sink)
    scheduler.start()
    try:
        for sink in held:
            assert sink.final.wait(OUTCOME_TIMEOUT_S)
            assert sink.finals == 1 and not isinstance(sink.errors[0], RequestError)  # INTERNAL
        later = make_request(engine, "Hello", None, max_tokens=4)
        served = EventSink()
        scheduler.submit(later, served)
        assert served.final.wait(OUTCOME_TIMEOUT_S)
        assert not served.errors and served.tokens == reference.generate(later).tokens
    finally:
        scheduler.stop()
    assert engine.prefix_cache.stats.running_bytes == 0


# ------------------------------------------------------------------------------------------ fuzz
@dataclasses.dataclass
class FuzzSink(RecordingSink):
    """Cancels itself once it has ``cancel_after`` tokens (None: never)."""

    cancel_after: int | None = None

    def is_cancelled(self):
        return self.cancel_after is not None and len(self.steps) >= self.cancel_after


#: Values that once broke, or could break, sampling: subnormal, tiny, huge, infinite, NaN, negative (the
#: first ones first: hypothesis draws early entries more often).
EDGE_FLOATS = (1e-40, 5e-324, 1e-38, math.nan, 0.0, 1e-30, 1e-3, 0.0099, 0.01, 0.7, 1.0, 100.0, 1e38, 1e300,
               math.inf, -math.inf, -1.0, -0.0)
FLOATS = st.one_of(st.sampled_from(EDGE_FLOATS), st.sampled_from(EDGE_FLOATS), st.floats(width=32), st.floats())
PREFIX = 48  # a shared prompt start, so that requests meet in the prefix cache and in single flight


@st.composite
def fuzz_requests(draw, vocab_size, context_length):
    """One request as the scheduler receives it (unvalidated), when it arrives, and when its client cancels."""
    ids = st.integers(0, vocab_size - 1)
    # Mostly servable shapes (so that sampling, batching and the cache are exercised), some refused ones.
    shape = draw(st.sampled_from(["short"] * 5 + ["shared"] * 4 + ["empty", "oversize", "out_of_vocab", "no_tokens",
                                                                   "unknown_adapter"]))
    if shape == "shared":
        prompt = [7] * draw(st.integers(1, PREFIX)) + draw(st.lists(ids, max_size=8))
    elif shape == "empty":
        prompt = []
    elif shape == "oversize":
        prompt = [7] * (context_length + 1)
    elif shape == "out_of_vocab":
        prompt = [1, draw(st.sampled_from([-1, vocab_size, 2**40]))]
    else:
        prompt = draw(st.lists(ids, min_size=1, max_size=24))
    sampling = SamplingParams(
        max_tokens=draw(st.sampled_from([-1, 0])) if shape == "no_tokens" else draw(st.integers(1, 5)),
        temperature=draw(FLOATS),
        top_p=draw(FLOATS),
        top_k=draw(st.one_of(st.integers(-3, 3), st.sampled_from([50, vocab_size, 2**31 - 1]))),
        seed=draw(st.integers(0, 2**64 - 1)))
    adapter = "unknown-adapter" if shape == "unknown_adapter" else draw(st.sampled_from(ADAPTERS))
    tenant = draw(st.sampled_from(["acme", "globex"]))
    request = GenerateRequest(tuple(prompt), adapter, tenant, draw(st.booleans()), sampling)
    cancel_after = draw(st.one_of(st.none(), st.none(), st.integers(0, 3)))
    arrives = draw(st.integers(0, 3))  # the step before which it is submitted
    return request, cancel_after, arrives


@settings(max_examples=30, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(data=st.data())
def test_fuzz_every_request_gets_exactly_one_final_response_and_nothing_is_held_after(engine, data):
    requests = data.draw(st.lists(fuzz_requests(engine.vocab_size, engine.context_length), min_size=1,
                                  max_size=4), label="requests")
    # Room for a few short requests only, or plenty: the small budgets preempt and refuse.
    budget_tokens = data.draw(st.sampled_from([40, 4096, 96]), label="kv budget (tokens)")
    warm = data.draw(st.one_of(st.none(), st.integers(1, PREFIX)), label="warm prompt (tokens)")
    saved = engine.prefix_cache
    engine.prefix_cache = PrefixCache(budget_tokens * engine.kv_bytes_per_token, 16)
    try:
        scheduler = Scheduler(engine, SchedulerConfig(max_num_seqs=2, max_queue=8, max_num_batched_tokens=32,
                                                      warm_chunk_tokens=16), clock=lambda: 0.0)
        outcomes = []  # (sink or the error submit raised)
        warm_done = None
        for step_no in range(3000):
            for request, cancel_after, arrives in requests:
                if arrives == step_no:
                    sink = FuzzSink(cancel_after=cancel_after)
                    try:
                        scheduler.submit(request, sink)
                    except RequestError as exc:  # refused up front: that is its one final response
                        outcomes.append(exc)
                    else:
                        outcomes.append(sink)
            if warm is not None and step_no == 1:
                warm_done = scheduler.submit_warm("sql", (7,) * warm, "acme")
            if step_no > 3 and not scheduler.has_work():
                break
            scheduler.step()
        else:
            pytest.fail("the scheduler made no progress in 3000 steps")
        assert len(outcomes) == len(requests)
        for outcome in outcomes:
            if isinstance(outcome, RequestError):
                event(f"refused: {type(outcome).__name__}")
                continue
            event(f"error: {type(outcome.errors[0]).__name__}" if outcome.errors else "served")
            finals = sum(step.finished for step in outcome.steps) + len(outcome.errors)
            assert finals == 1, outcome
            assert not outcome.steps or not outcome.steps[-1].finished or not outcome.errors
            for error in outcome.errors:
                # Every error is the request's own (its code), none is INTERNAL: the real parts did not fail.
                assert isinstance(error, RequestError), repr(error)
                if isinstance(error, RequestCancelledError):
                    assert outcome.cancel_after is not None
        if warm_done is not None:
            assert warm_done.done()
            event("warm prompt: " + ("warmed" if warm_done.exception() is None else "refused"))
        if scheduler.stats.preemptions:
            event("preempted")
        assert_nothing_held(scheduler, engine)
    finally:
        engine.prefix_cache = saved
