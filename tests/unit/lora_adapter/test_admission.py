"""Per-tenant admission (warmup_tools/lora_adapter/admission.py) through the scheduler on the fake engine: a flooding
tenant is refused at its share while another tenant is queued and served at once; the sidecar's probe is admitted
with every slot and the whole queue taken; a flood of unique tenants leaves nothing behind. Steps are driven by
hand (``scheduler.step()``): nothing here depends on threads or time."""

from __future__ import annotations

import pytest

from tests.unit.lora_adapter.fake_engine import FakeEngine
from tests.unit.lora_adapter.test_scheduler import RecordingSink, drain
from tests.unit.lora_adapter.test_scheduler_fake import assert_nothing_held, prompts, request
from warmup_tools.common.errors import ServerBusyError, TenantBusyError
from warmup_tools.common.records import PROBE_TENANT
from warmup_tools.common.wire import ErrorKind
from warmup_tools.lora_adapter.admission import PROBE_HELD, TenantShares
from warmup_tools.lora_adapter.scheduler import Scheduler
from warmup_tools.lora_adapter.settings import SchedulerConfig

#: Long generations: a flooder's sequences hold their slots for many steps.
LONG = 40


def flood(scheduler, tenant, count, max_tokens=LONG, seed=0):
    """Submit ``count`` requests of ``tenant``; the sinks of those taken and the errors of those refused."""
    sinks, refused = [], []
    for ids in prompts(count, seed=seed, shared=0):  # no shared prefix: no sequence waits for another's block
        sink = RecordingSink()
        try:
            scheduler.submit(request(ids, tenant=tenant, max_tokens=max_tokens, ignore_eos=True), sink)
        except (TenantBusyError, ServerBusyError) as exc:
            refused.append(exc)
        else:
            sinks.append(sink)
    return sinks, refused


def tenants_running(scheduler):
    return [s.request.tenant for s in scheduler.running]


def test_a_flooding_tenant_is_refused_at_its_share_while_another_tenant_is_still_queued():
    config = SchedulerConfig(max_num_seqs=4, max_queue=8, tenant_queue_share=0.5)
    scheduler = Scheduler(FakeEngine(), config)
    taken, refused = flood(scheduler, "flooder", 20)
    assert len(taken) == TenantShares.of(config).max_held == 4 + 4
    assert len(refused) == 12 and all(isinstance(e, TenantBusyError) for e in refused)
    assert refused[0].kind is ErrorKind.RATE_LIMITED and refused[0].code == "UNAVAILABLE"
    assert "this tenant" in str(refused[0]) and "lower your concurrency" in str(refused[0])
    other, none = flood(scheduler, "quiet", 1, max_tokens=2, seed=1)
    assert len(other) == 1 and not none
    assert scheduler.stats.tenant_refusals == 12
    drain(scheduler)
    assert all(not s.errors and len(s.tokens) == LONG for s in taken) and other[0].tokens


def test_the_instance_bound_still_holds_for_many_tenants_with_the_instance_error():
    scheduler = Scheduler(FakeEngine(), SchedulerConfig(max_num_seqs=2, max_queue=4, tenant_queue_share=0.5))
    held = [flood(scheduler, f"t{i}", 2, seed=i) for i in range(3)]  # 2 + 2 + 2 = max_num_seqs + max_queue
    assert all(len(taken) == 2 for taken, _ in held)
    with pytest.raises(ServerBusyError, match="server busy") as info:
        scheduler.submit(request(prompts(1)[0], tenant="t9"), RecordingSink())
    assert info.value.kind is ErrorKind.BUSY


def test_a_tenant_behind_a_flood_gets_a_slot_at_the_next_step_and_ends_long_before_the_flood():
    scheduler = Scheduler(FakeEngine(), SchedulerConfig(max_num_seqs=4, max_queue=16, tenant_slot_share=0.75))
    taken, _ = flood(scheduler, "flooder", 12)
    for _ in range(3):
        scheduler.step()
    assert tenants_running(scheduler) == ["flooder"] * 4
    quiet = RecordingSink()
    scheduler.submit(request(prompts(1, seed=5)[0], tenant="quiet", max_tokens=3), quiet)
    scheduler.step()
    # The flooder ran more than its share (3 of 4 slots) while another tenant waited: it yielded one slot.
    assert tenants_running(scheduler).count("quiet") == 1 and tenants_running(scheduler).count("flooder") == 3
    assert scheduler.stats.fair_preemptions == 1
    steps = 1
    while not (quiet.steps and quiet.steps[-1].finished):
        scheduler.step()
        steps += 1
        assert steps < 20, "the quiet tenant waited for the flood"
    assert tenants_running(scheduler).count("flooder") == 3  # at its share: it yields nothing more
    drain(scheduler)
    assert not quiet.errors and len(quiet.tokens) == 3
    assert all(not s.errors and len(s.tokens) == LONG for s in taken)  # preempted ones end as if never preempted


def test_free_slots_go_to_the_tenant_that_runs_the_fewest_not_to_the_oldest_request():
    scheduler = Scheduler(FakeEngine(), SchedulerConfig(max_num_seqs=2, max_queue=16, tenant_slot_share=1))
    flood(scheduler, "a", 6, max_tokens=2)
    flood(scheduler, "b", 2, max_tokens=2, seed=1)
    scheduler.step()
    # Both slots would go to a's oldest requests in one FIFO; fairly, one each.
    assert sorted(tenants_running(scheduler)) == ["a", "b"]


def test_with_tenant_slot_share_1_a_tenant_never_yields_a_running_slot():
    scheduler = Scheduler(FakeEngine(), SchedulerConfig(max_num_seqs=2, max_queue=8, tenant_slot_share=1))
    flood(scheduler, "flooder", 4)
    scheduler.step()
    flood(scheduler, "quiet", 1, seed=1)
    scheduler.step()
    assert tenants_running(scheduler) == ["flooder", "flooder"] and scheduler.stats.fair_preemptions == 0


def probe_request():
    return request([1, 2, 3, 4], tenant=PROBE_TENANT, max_tokens=1)


def test_the_probe_is_admitted_with_every_slot_and_the_whole_queue_taken_and_answers_in_its_first_step():
    config = SchedulerConfig(max_num_seqs=2, max_queue=4, tenant_queue_share=1)
    scheduler = Scheduler(FakeEngine(), config)
    flood(scheduler, "flooder", 6)
    scheduler.step()
    with pytest.raises(ServerBusyError):  # the instance is full for every tenant
        scheduler.submit(request(prompts(1)[0], tenant="someone"), RecordingSink())
    probe = RecordingSink()
    scheduler.submit(probe_request(), probe)
    report = scheduler.step()
    assert probe.steps and probe.steps[-1].finished and not probe.errors
    assert report.batch_size == config.max_num_seqs + 1  # beside the tenants' slots, not in one of them
    drain(scheduler)


def test_the_probe_goes_first_in_a_step_budget_that_decodes_fill():
    config = SchedulerConfig(max_num_seqs=4, max_queue=0, max_num_batched_tokens=4)
    scheduler = Scheduler(FakeEngine(), config)
    flood(scheduler, "flooder", 4)
    while any(s.remaining > 1 for s in scheduler.running) or not scheduler.running:
        scheduler.step()  # until every flooder sequence decodes: the budget is all decode tokens
    probe = RecordingSink()
    scheduler.submit(probe_request(), probe)
    scheduler.step()
    assert probe.steps and probe.steps[-1].finished
    drain(scheduler)


def test_probes_are_bounded_and_a_tenant_cannot_use_the_probe_slot():
    scheduler = Scheduler(FakeEngine(), SchedulerConfig(max_num_seqs=1, max_queue=2, tenant_queue_share=1))
    for _ in range(PROBE_HELD):
        scheduler.submit(probe_request(), RecordingSink())
    with pytest.raises(ServerBusyError):
        scheduler.submit(probe_request(), RecordingSink())
    flood(scheduler, "flooder", 3)
    while scheduler.has_work():
        report = scheduler.step()
        # At most one probe in the reserved slot, and one flooder sequence in the only tenant slot.
        assert report.batch_size <= 2 and tenants_running(scheduler).count("flooder") <= 1
        assert sum(t == PROBE_TENANT for t in tenants_running(scheduler)) <= 1


def test_a_flood_of_unique_tenants_is_bounded_and_leaves_no_entry_behind():
    engine = FakeEngine()
    config = SchedulerConfig(max_num_seqs=2, max_queue=6)
    scheduler = Scheduler(engine, config)
    taken, refused = [], []
    for i in range(200):
        sinks, errors = flood(scheduler, f"tenant-{i:04d}", 1, max_tokens=2, seed=i)
        taken += sinks
        refused += errors
        if i % 10 == 0:
            scheduler.step()
        assert len(scheduler._held) <= config.max_num_seqs + config.max_queue
        assert len(scheduler._waiting.tenants()) <= config.max_queue
    assert refused and all(isinstance(e, ServerBusyError) for e in refused)
    drain(scheduler)
    assert all(not s.errors for s in taken)
    assert scheduler._held == {} and scheduler._waiting.tenants() == []
    assert_nothing_held(scheduler, engine)


def test_held_counts_return_to_zero_however_requests_end():
    engine = FakeEngine()
    scheduler = Scheduler(engine, SchedulerConfig(max_num_seqs=2, max_queue=8, cancel_check_s=0))
    sinks, _ = flood(scheduler, "acme", 6, max_tokens=4)
    scheduler.step()
    sinks[0].cancelled = True  # running
    sinks[5].cancelled = True  # waiting
    drain(scheduler)
    assert scheduler._held == {}
    flood(scheduler, "acme", 3)
    scheduler.stop()  # the rest end with UNAVAILABLE
    assert scheduler._held == {}


def test_a_warm_prompt_is_admitted_while_every_tenant_slot_is_taken():
    scheduler = Scheduler(FakeEngine(), SchedulerConfig(max_num_seqs=2, max_queue=4, live_quiet_s=0))
    taken, _ = flood(scheduler, "flooder", 2, max_tokens=LONG)  # both slots, nothing waiting
    scheduler.step()
    done = scheduler.submit_warm(None, tuple(prompts(1, seed=9, shared=0)[0]))
    while not done.done() and scheduler.running:
        scheduler.step()
    assert done.done() and done.exception() is None
    assert all(not s.steps[-1].finished for s in taken)  # warmed beside the running tenants, not after them
    drain(scheduler)


def test_at_stop_every_request_a_flood_left_gets_exactly_one_final_response_and_nothing_stays_held():
    # Triton unloads a decoupled model only once each request it holds got its FINAL response: whatever a flood
    # left (running, waiting, preempted for a waiting tenant, the probe, just submitted) ends once, and is freed.
    engine = FakeEngine()
    scheduler = Scheduler(engine, SchedulerConfig(max_num_seqs=4, max_queue=16, tenant_slot_share=0.5))
    taken, refused = flood(scheduler, "flooder", 30)
    assert refused
    for _ in range(3):
        scheduler.step()
    quiet, _ = flood(scheduler, "quiet", 2, seed=7)
    scheduler.step()
    assert scheduler.stats.fair_preemptions >= 1
    preempted = [s for s in scheduler.waiting if s.output_tokens]
    assert preempted, "a sequence that sent tokens waits to be recomputed"
    probe = RecordingSink()
    scheduler.submit(probe_request(), probe)
    late, _ = flood(scheduler, "late", 2, seed=9)  # still in the inbox
    scheduler.stop()
    for sink in [*taken, *quiet, probe, *late]:
        ends = sum(s.finished for s in sink.steps) + len(sink.errors)
        assert ends == 1, (len(sink.steps), sink.errors)
        assert not sink.steps or not sink.steps[-1].finished or not sink.errors
        assert all(e.kind is ErrorKind.UNAVAILABLE for e in sink.errors)
    assert scheduler._held == {}
    assert_nothing_held(scheduler, engine)
    with pytest.raises(Exception, match="shutting down"):
        scheduler.submit(request(prompts(1)[0], tenant="after"), RecordingSink())
