"""The continuous-batching scheduler on the demo LM and adapters, driven step by step (no thread, no timing)."""

from __future__ import annotations

import dataclasses

import pytest

from warmup_tools.common.errors import RequestCancelledError, ServerBusyError, UnknownAdapterError
from warmup_tools.demo.prompts import SYSTEM_PROMPTS
from warmup_tools.kv.config import KVCacheConfig
from warmup_tools.kv.prefix_cache import PrefixCache
from warmup_tools.lora_adapter.engines import make_engine
from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams
from warmup_tools.lora_adapter.scheduler import Scheduler
from warmup_tools.lora_adapter.settings import EngineConfig, SchedulerConfig

ADAPTERS = (None, "support", "legal", "sql")


@dataclasses.dataclass
class RecordingSink:
    steps: list = dataclasses.field(default_factory=list)
    errors: list = dataclasses.field(default_factory=list)
    cancelled: bool = False

    def send(self, step):
        self.steps.append(step)

    def fail(self, error):
        self.errors.append(error)

    def is_cancelled(self):
        return self.cancelled

    @property
    def tokens(self):
        return [s.token_id for s in self.steps]

    @property
    def text(self):
        return "".join(s.text for s in self.steps)


def make_request(engine, text, adapter, max_tokens=12, tenant="acme", **sampling):
    sampling = SamplingParams(max_tokens=max_tokens, **sampling)
    return GenerateRequest(engine.encode(text), adapter, tenant, True, sampling)


def drain(scheduler, limit=2000):
    reports = []
    while scheduler.has_work():
        reports.append(scheduler.step())
        assert len(reports) < limit, "the scheduler made no progress"
    return reports


def mixed_requests(engine):
    """Four requests, base model and three adapters, prompts of very different lengths."""
    texts = [
        "Hello, who are you?",
        SYSTEM_PROMPTS["support"] + "User: my invoice shows two charges\nAssistant:",
        SYSTEM_PROMPTS["legal"][:150] + " Clause 3?",
        SYSTEM_PROMPTS["sql"] + SYSTEM_PROMPTS["sql"] + "User: orders per day?\nAssistant:",
    ]
    return [make_request(engine, text, adapter) for text, adapter in zip(texts, ADAPTERS)]


def test_batched_greedy_output_equals_each_request_alone(fresh_cache, reference):
    engine = fresh_cache
    scheduler = Scheduler(engine, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64))
    requests = mixed_requests(engine)
    sinks = [RecordingSink() for _ in requests]
    for req, sink in zip(requests, sinks):
        scheduler.submit(req, sink)
    reports = drain(scheduler)
    for req, sink in zip(requests, sinks):
        assert not sink.errors
        assert (sink.tokens, sink.text) == reference.generate(req)
        assert sink.steps[-1].finished and sink.steps[-1].output_tokens == len(sink.steps) == 12
    # Every step stayed in the token budget, and the long prompts were prefilled in chunks while
    # the short ones were already decoding.
    assert all(r.live_tokens <= 64 for r in reports)
    assert any(r.batch_size == 4 for r in reports)
    assert any(r.live_tokens > r.batch_size > 1 for r in reports)  # decode tokens and a prefill chunk together
    assert engine.prefix_cache.stats.running_bytes == 0


def test_one_step_mixes_adapters_and_the_base_model(fresh_cache):
    engine = fresh_cache
    scheduler = Scheduler(engine, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512))
    for req in mixed_requests(engine):
        scheduler.submit(req, RecordingSink())
    reports = drain(scheduler)
    assert any(set(r.adapters) == set(ADAPTERS) for r in reports)


def test_seeded_sampling_in_a_batch_is_reproducible(fresh_cache, reference):
    engine = fresh_cache
    scheduler = Scheduler(engine)
    sampled = make_request(engine, "Tell me a story", "support", max_tokens=16, temperature=1.0, top_p=0.9,
                           top_k=50, seed=7)
    sinks = [RecordingSink(), RecordingSink()]
    scheduler.submit(sampled, sinks[0])
    scheduler.submit(mixed_requests(engine)[1], sinks[1])
    drain(scheduler)
    assert sinks[0].tokens == reference.generate(sampled).tokens


def test_prefix_cache_cached_tokens_are_exact_and_a_shared_prefix_is_computed_once(fresh_cache, reference):
    engine = fresh_cache
    scheduler = Scheduler(engine, SchedulerConfig(max_num_batched_tokens=64))
    system = SYSTEM_PROMPTS["legal"]
    first, second = (make_request(engine, system + q, "legal") for q in ("User: who signs?", "User: when due?"))
    sinks = [RecordingSink(), RecordingSink()]
    scheduler.submit(first, sinks[0])
    scheduler.submit(second, sinks[1])  # same uncached prefix: waits for the first to compute it
    drain(scheduler)
    common = next(i for i, (a, b) in enumerate(zip(first.prompt_ids, second.prompt_ids)) if a != b)
    assert sinks[0].steps[0].cached_tokens == 0
    assert sinks[1].steps[0].cached_tokens == common // 16 * 16 > 0
    assert [s.tokens for s in sinks] == [reference.generate(first).tokens, reference.generate(second).tokens]


def test_preemption_under_a_tiny_budget_leaves_outputs_unchanged_and_raises_no_error(fresh_cache, reference):
    engine = fresh_cache
    requests = mixed_requests(engine)
    longest = max(len(r.prompt_ids) for r in requests) + 12
    # Room for the longest request and a little more: running all four at once must preempt.
    engine.prefix_cache = PrefixCache(int(longest * 1.5) * engine.kv_bytes_per_token, 16)
    scheduler = Scheduler(engine, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256))
    sinks = [RecordingSink() for _ in requests]
    for req, sink in zip(requests, sinks):
        scheduler.submit(req, sink)
    drain(scheduler, limit=5000)
    assert scheduler.stats.preemptions > 0
    for req, sink in zip(requests, sinks):
        assert not sink.errors
        assert sink.tokens == reference.generate(req).tokens
    assert engine.prefix_cache.stats.running_bytes == 0
    cache = engine.prefix_cache
    assert cache.stats.bytes_used <= cache.budget_bytes


def test_cancellation_frees_the_slot_and_the_memory(fresh_cache):
    engine = fresh_cache
    scheduler = Scheduler(engine, SchedulerConfig(max_num_seqs=1, max_queue=4, cancel_check_s=0))
    keep, cancel = RecordingSink(), RecordingSink()
    scheduler.submit(make_request(engine, "Cancel me please", None, max_tokens=50), cancel)
    scheduler.submit(make_request(engine, "Keep me", "sql", max_tokens=4), keep)
    for _ in range(3):
        scheduler.step()
    assert len(cancel.steps) == 3 and not keep.steps  # one slot: the second waits
    held = engine.prefix_cache.stats.running_bytes
    assert held >= len(cancel.steps) * engine.kv_bytes_per_token
    cancel.cancelled = True
    scheduler.step()
    assert isinstance(cancel.errors[0], RequestCancelledError)
    assert [s.request.prompt_ids for s in scheduler.running] == [engine.encode("Keep me")]
    drain(scheduler)
    assert len(cancel.steps) == 3 and len(keep.steps) == 4
    assert engine.prefix_cache.stats.running_bytes == 0


def test_the_observer_sees_the_counts_fall_when_the_last_sequence_is_cancelled(fresh_cache):
    engine = fresh_cache
    seen = []
    scheduler = Scheduler(engine, SchedulerConfig(cancel_check_s=0), observer=lambda report, sched: seen.append(
        (report.batch_size, sched.stats.running, sched.stats.waiting)))
    sink = RecordingSink()
    scheduler.submit(make_request(engine, "Cancel me please", None, max_tokens=50), sink)
    scheduler.step()
    assert seen[-1][1:] == (1, 0)
    sink.cancelled = True
    scheduler.step()  # no forward: the only sequence leaves
    assert seen[-1] == (0, 0, 0)
    count = len(seen)
    scheduler.step()  # nothing changed: not observed again
    assert len(seen) == count


def test_a_failed_send_drops_the_sequence(fresh_cache):
    engine = fresh_cache
    scheduler = Scheduler(engine)

    class GoneSink(RecordingSink):
        def send(self, step):
            raise ConnectionError("client went away")

    scheduler.submit(make_request(engine, "Hello", None, max_tokens=8), GoneSink())
    drain(scheduler)
    assert scheduler.stats.output_tokens == {"": 1}
    assert engine.prefix_cache.stats.running_bytes == 0


def test_beyond_the_queue_bound_a_request_is_refused_at_once_with_unavailable(fresh_cache):
    engine = fresh_cache
    scheduler = Scheduler(engine, SchedulerConfig(max_num_seqs=2, max_queue=1))
    for _ in range(3):
        scheduler.submit(make_request(engine, "Hello", None), RecordingSink())
    with pytest.raises(ServerBusyError, match="busy") as info:
        scheduler.submit(make_request(engine, "Hello", None), RecordingSink())
    assert info.value.code == "UNAVAILABLE"
    with pytest.raises(UnknownAdapterError):
        scheduler.submit(make_request(engine, "Hello", "nope"), RecordingSink())


def test_warm_up_stays_out_of_live_prefills_and_takes_small_chunks_while_live_traffic_flows(fresh_cache, reference):
    engine = fresh_cache
    budget, chunk = 64, 16
    now = [0.0]  # NOTE: a fake clock: "live traffic is recent" is decided by it, not by machine speed
    scheduler = Scheduler(engine, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget,
                                                  warm_chunk_tokens=chunk, live_quiet_s=0.5), clock=lambda: now[0])
    live = make_request(engine, SYSTEM_PROMPTS["support"] + "User: hi\nAssistant:", "support", max_tokens=20)
    sink = RecordingSink()
    scheduler.submit(live, sink)
    warm_ids = engine.encode(SYSTEM_PROMPTS["sql"])
    done = scheduler.submit_warm("sql", warm_ids, plan_id="plan-w")
    reports = drain(scheduler)
    assert done.result(timeout=0) > 1  # warmed in several chunks
    for report in reports:
        assert report.live_tokens + report.warm_tokens <= budget
        if report.live_tokens > 1:  # a live prefill: warm-up stays out of its step
            assert report.warm_tokens == 0
        assert report.warm_tokens <= chunk  # live traffic is recent (the clock never moved)
    assert any(r.live_tokens == budget for r in reports)
    assert any(r.live_tokens == 1 and r.warm_tokens == chunk for r in reports)
    assert sink.tokens == reference.generate(live).tokens
    # The warm prompt's blocks are cached and pinned under the plan: a live request for it hits them.
    assert engine.prefix_cache.active_plan == "plan-w" and engine.prefix_cache.stats.pinned_bytes > 0
    again = RecordingSink()
    scheduler.submit(GenerateRequest(warm_ids, "sql", "default", True, SamplingParams(max_tokens=2)), again)
    drain(scheduler)
    assert again.steps[0].cached_tokens == (len(warm_ids) - 1) // 16 * 16
    assert again.steps[0].planned_tokens == again.steps[0].cached_tokens  # all of it from the plan's pins
    # Quiet for live_quiet_s: warm-up takes whole steps.
    now[0] = 1.0
    scheduler.submit_warm("legal", engine.encode(SYSTEM_PROMPTS["legal"]))
    assert any(r.warm_tokens == budget for r in drain(scheduler))


def test_adapter_unload_runs_between_steps_and_ends_its_sequences(demo_assets):
    engine = make_engine(EngineConfig(base_model=demo_assets.lm_dir, adapter_root=demo_assets.adapter_root,
                                     adapters=("support", "sql"), dtype="float32",
                                     kv=KVCacheConfig(budget_bytes=8 << 20)))
    scheduler = Scheduler(engine)
    gone, other = RecordingSink(), RecordingSink()
    scheduler.submit(make_request(engine, "Hello", "sql", max_tokens=8), gone)
    scheduler.submit(make_request(engine, "Hello", "support", max_tokens=8), other)
    scheduler.step()
    unloaded = scheduler.unload_adapter("sql")
    assert not unloaded.done()  # queued for between steps, not run from this thread
    drain(scheduler)
    unloaded.result(timeout=0)
    assert not engine.has_adapter("sql")
    assert len(gone.steps) == 1 and "retired" in str(gone.errors[0])
    assert len(other.steps) == 8 and not other.errors
    loaded = scheduler.load_adapter("sql")
    drain(scheduler)
    loaded.result(timeout=0)
    assert engine.has_adapter("sql")


def test_warm_up_gives_its_memory_way_to_live_sequences(fresh_cache, reference):
    engine = fresh_cache
    warm_ids = engine.encode(SYSTEM_PROMPTS["sql"] + SYSTEM_PROMPTS["legal"])
    # Room for the warm prompt alone, not for it and the live request together.
    engine.prefix_cache = PrefixCache((len(warm_ids) + 5) * engine.kv_bytes_per_token, 16)
    scheduler = Scheduler(engine, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16), clock=lambda: 0.0)
    # Long enough that its KV outgrows what the warm prompt leaves free.
    live = make_request(engine, "Hello there", "support", max_tokens=64)
    sink = RecordingSink()
    scheduler.submit(live, sink)
    done = scheduler.submit_warm("sql", warm_ids)
    drain(scheduler, limit=5000)
    assert not sink.errors and sink.tokens == reference.generate(live).tokens
    assert scheduler.stats.warm_restarts > 0  # the warm prompt gave its KV up...
    assert scheduler.stats.preemptions == 0  # ...and no live sequence was preempted for it
    assert done.result(timeout=0) > 0
    assert engine.prefix_cache.stats.running_bytes == 0


def test_a_warm_prompt_that_fits_only_by_ending_another_items_pins_fails_and_leaves_them(fresh_cache):
    """Two plan items, the second too big for what the first's pins leave (a warm prompt holds its running KV and
    the copies of the blocks it stored): the second fails with KVBudgetError (the plan's shortfall), the first
    keeps every pin, and the scheduler keeps no memory."""
    from warmup_tools.common.errors import KVBudgetError

    engine = fresh_cache
    per_block = 16 * engine.kv_bytes_per_token
    engine.prefix_cache = cache = PrefixCache(12 * per_block, 16, warm_share=1.0, live_reserve=0.0)
    scheduler = Scheduler(engine, SchedulerConfig(max_num_batched_tokens=64), clock=lambda: 0.0)
    first = tuple(100 + i for i in range(5 * 16 + 1))
    done = scheduler.submit_warm(None, first, plan_id="plan-big")
    drain(scheduler)
    assert done.result(timeout=0) > 0 and cache.stats.blocks == 5 and cache.stats.pinned_bytes == cache.stats.bytes_used
    first_blocks = engine.block_hashes(GenerateRequest(first, None, "default", False, SamplingParams(max_tokens=1)))[0]
    refused = scheduler.submit_warm(None, tuple(300 + i for i in range(5 * 16 + 1)), plan_id="plan-big")
    drain(scheduler)
    with pytest.raises(KVBudgetError):
        refused.result(timeout=0)
    assert cache.covered(first_blocks, "plan-big") == 5 and cache.resident(first_blocks, "plan-big") == 5
    assert cache.pin_report()["released_blocks"] == 0 and cache.stats.running_bytes == 0


def test_warm_up_rests_after_each_chunk_so_it_keeps_within_warm_share(fresh_cache, monkeypatch):
    engine = fresh_cache
    now = [0.0]
    forward = engine.forward

    def slow_forward(*args, **kwargs):  # NOTE: a fake clock: every forward "takes" 0.1 s
        now[0] += 0.1
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine, "forward", slow_forward)
    scheduler = Scheduler(engine, SchedulerConfig(warm_chunk_tokens=16, warm_share=0.25, live_quiet_s=5.0),
                          clock=lambda: now[0])
    live = RecordingSink()
    scheduler.submit(make_request(engine, "Hi", "support", max_tokens=1), live)
    scheduler.step()  # the live request: traffic is now recent
    scheduler.submit_warm("sql", engine.encode(SYSTEM_PROMPTS["sql"]))
    first = scheduler.step()
    assert first.warm_tokens == 16
    # share 0.25: a 0.1 s chunk is followed by 0.3 s of rest.
    assert scheduler.step().warm_tokens == 0
    now[0] += 0.29
    assert scheduler.step().warm_tokens == 0
    now[0] += 0.02
    assert scheduler.step().warm_tokens == 16


def test_ignore_eos_generates_max_tokens_past_an_end_of_sequence_token(engine, monkeypatch):
    from tests.unit.lora_adapter.conftest import serve

    request = make_request(engine, "Translate to SQL: every order of May", "sql", max_tokens=6)
    first = serve(engine, request)[0].token_id
    # The model's first greedy token is made an end-of-sequence token: a request stops at it unless it ignores it.
    monkeypatch.setattr(engine.model, "eos_token_ids", frozenset({first}))  # the loaded model's
    stopped = serve(engine, request)
    assert len(stopped) == 1 and stopped[0].finished and stopped[0].finish_reason == "stop" and not stopped[0].text
    kept = serve(engine, make_request(engine, "Translate to SQL: every order of May", "sql", max_tokens=6,
                                      ignore_eos=True))
    assert [s.output_tokens for s in kept] == [1, 2, 3, 4, 5, 6]
    assert kept[0].token_id == first and kept[-1].finish_reason == "length"
