"""One instance's plan: hot set from its samples or plan.json, diffs that move pins, coverage and shortfalls."""

from __future__ import annotations

import dataclasses
import socket

import numpy as np
import pytest

from tests.unit.control.test_plan_control import make_plan
from tests.unit.lora_adapter.conftest import CollectingSink, serve_and_wait, start_service
from tests.waiting import wait_for
from warmup_tools.control.plan_control import PlanStatusBoard
from warmup_tools.control.plan_history import write_live_plan
from warmup_tools.demo.prompts import SYSTEM_PROMPTS
from warmup_tools.kv.blocks import BlockSource
from warmup_tools.kv.config import KVCacheConfig
from warmup_tools.lora_adapter.engines import make_engine
from warmup_tools.lora_adapter.live_plan import diff_hot_sets
from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams
from warmup_tools.lora_adapter.scheduler import Scheduler
from warmup_tools.lora_adapter.service import LoraService
from warmup_tools.lora_adapter.settings import EngineConfig, ServiceConfig

DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def engine(demo_assets):
    return make_engine(EngineConfig(base_model=demo_assets.lm_dir, adapter_root=demo_assets.adapter_root,
                                   adapters=("support", "sql"), kv=KVCacheConfig(budget_bytes=64 << 20),
                                   num_threads=1))


def prefix(engine, text, blocks):
    ids = engine.encode(text)
    assert len(ids) >= blocks * 16
    return list(ids[: blocks * 16])


def item(ids, adapter="support", tenant="acme"):
    return {"tenant": tenant, "adapter": adapter, "token_ids": ids}


def wait_status(board, plan_id, instance="inst_0"):
    def applied():
        status = board.read_all(host=socket.gethostname())[0].get(instance)
        return status if status is not None and status.plan_id == plan_id and status.state == "applied" else None

    return wait_for(applied, f"plan {plan_id} applied", detail=lambda: f": {board.read_all()}")


def serve_once(service, ids, adapter="support", tenant="acme"):
    return serve_and_wait(service, GenerateRequest(tuple(ids), adapter, tenant, False,
                                                   SamplingParams(max_tokens=2)))[0].cached_tokens


def test_diff_counts_added_kept_and_dropped_blocks_per_adapter():
    old = {"sql": {b"a", b"b"}, "base": {b"x"}}
    new = {"sql": {b"b", b"c", b"d"}, "support": {b"s"}}
    diff = diff_hot_sets(old, new)
    assert diff.added == {"sql": 2, "support": 1}
    assert diff.kept == {"sql": 1}
    assert diff.dropped == {"sql": 1, "base": 1}
    assert diff.summary() == "3 blocks added, 1 kept, 2 dropped"


def test_a_live_plan_change_warms_new_items_moves_pins_and_reports_coverage(engine, tmp_path):
    kept_ids = prefix(engine, SYSTEM_PROMPTS["support"], 6)
    dropped_ids = prefix(engine, SYSTEM_PROMPTS["legal"], 4)
    added_ids = prefix(engine, SYSTEM_PROMPTS["sql"], 5)
    first = make_plan([item(kept_ids), item(dropped_ids, adapter="")])
    second = make_plan([item(kept_ids), item(added_ids, adapter="sql", tenant="beta")])
    board = PlanStatusBoard(tmp_path)
    scheduler = Scheduler(engine)
    scheduler.start()
    service = LoraService(engine, ServiceConfig(control_dir=tmp_path, control_poll_s=0.05), instance="inst_0",
                          scheduler=scheduler)
    cache = engine.prefix_cache
    try:
        write_live_plan(tmp_path, first, by=("test", ""))
        status = wait_status(board, first.plan_id)
        assert status.source == "control"
        assert {n: (c.planned, c.resident) for n, c in status.adapters.items()} == {"support": (6, 6), "base": (4, 4),
                                                                               "sql": (0, 0)}  # nothing planned
        assert serve_once(service, kept_ids + [5, 6, 7]) == 6 * 16

        write_live_plan(tmp_path, second, by=("test", ""))
        status = wait_status(board, second.plan_id)
        assert {n: (c.planned, c.resident) for n, c in status.adapters.items()} == {"support": (6, 6), "sql": (5, 5)}
        assert "5 blocks added, 6 kept, 4 dropped" in status.detail
        kept = service.plan.hot["support"]
        assert all(cache.block(h).plan_id == second.plan_id for h in kept)
        dropped, _ = engine.block_hashes(GenerateRequest(tuple(dropped_ids), None, "acme", False,
                                                         SamplingParams(), source=BlockSource.WARMUP))
        assert all(cache.block(h) is None or cache.block(h).plan_id is None for h in dropped)
        # The new item is served from the cache without a restart, for its own tenant only.
        assert serve_once(service, added_ids + [9, 9], adapter="sql", tenant="beta") == 5 * 16
        assert serve_once(service, added_ids + [9, 9], adapter="sql", tenant="gamma") == 0
    finally:
        service.close()
        cache.activate_plan(None)


def test_samples_with_a_plan_id_make_the_hot_set_until_a_live_plan_is_applied(engine, tmp_path):
    ids = prefix(engine, SYSTEM_PROMPTS["legal"], 3)
    service = start_service(engine, ServiceConfig(control_dir=None), instance="inst_0")
    try:
        sample = GenerateRequest(tuple(ids), None, "default", False, SamplingParams(max_tokens=1),
                                 source=BlockSource.WARMUP, plan_id="stanza-plan")
        serve_and_wait(service, sample)
        status = service.plan.status()
        assert (status.plan_id, status.source) == ("stanza-plan", "samples")
        assert status.adapters["base"].planned == 3 and status.adapters["base"].coverage == 1.0
        live = make_plan([item(prefix(engine, SYSTEM_PROMPTS["support"], 2))])
        from warmup_tools.control.plan_control import LivePlan

        service.plan.apply(LivePlan.parse(live.to_json().encode()))
        # A sample of another plan (a reload with older stanzas) no longer pins or changes the hot set.
        assert service.plan.note_warmup(sample).plan_id is None
        assert service.plan.status().plan_id == live.plan_id
    finally:
        service.close()
        engine.prefix_cache.activate_plan(None)


def test_a_sample_in_flight_during_a_live_plan_change_leaves_the_new_plan_pinned_and_covered(engine):
    """A model_warmup sample of plan A, noted before plan B is applied and run after it (a sample in
    flight while the control folder's plan lands), must not move the cache back to A or unpin B."""
    from warmup_tools.control.plan_control import LivePlan

    service = start_service(engine, ServiceConfig(control_dir=None), instance="inst_0")
    cache = engine.prefix_cache
    try:
        sample = GenerateRequest(tuple(prefix(engine, SYSTEM_PROMPTS["legal"], 3)), None, "default", False,
                                 SamplingParams(max_tokens=1), source=BlockSource.WARMUP, plan_id="stanza-plan")
        in_flight = service.plan.note_warmup(sample)  # noted while the samples' plan is the only one
        assert in_flight.plan_id == "stanza-plan"
        live = LivePlan.parse(make_plan([item(prefix(engine, SYSTEM_PROMPTS["support"], 2))]).to_json().encode())
        service.plan.apply(live)
        hot = service.plan.hot["support"]
        assert cache.resident(hot, live.plan_id) == len(hot) == 2
        sink = CollectingSink()  # the sample's prefill and store, after the plan change (noted already)
        service.scheduler.submit(in_flight, sink)
        sink.wait()

        assert cache.active_plan == live.plan_id
        assert cache.resident(hot, live.plan_id) == len(hot)  # the live plan's pins are intact
        coverage = service.plan.status().adapters
        assert {n: (c.planned, c.resident) for n, c in coverage.items()} == {"support": (2, 2), "sql": (0, 0)}
        assert cache.stats.stale_plan_blocks == 3
        # Coverage counts what is pinned, not merely cached: unpinned, the same blocks are not covered.
        cache.move_plan(live.plan_id, set())
        assert service.plan.coverage()["support"].resident == 0 and cache.resident(hot) == 2
    finally:
        service.close()
        cache.clear()
        cache.activate_plan(None)


def test_a_plan_the_warm_up_budget_cannot_hold_says_so(engine, tmp_path):
    block = 16 * engine.kv_bytes_per_token
    small = make_engine(dataclasses.replace(engine.config, adapters=("support",),
                                           kv=KVCacheConfig(budget_bytes=10 * block, live_reserve=0.5)))
    ids = prefix(small, SYSTEM_PROMPTS["support"], 8)
    service = start_service(small, ServiceConfig(control_dir=None), instance="inst_0")
    try:
        from warmup_tools.control.plan_control import LivePlan

        plan = make_plan([item(ids)])
        service.plan.apply(LivePlan.parse(plan.to_json().encode()))
        coverage = service.plan.status().adapters["support"]
        # Half of a ten-block budget is the warm-up share: about five blocks (block metadata counts too).
        assert coverage.planned == 8 and 0 < coverage.resident <= 5
        assert f"{8 - coverage.resident} of 8 planned blocks do not fit the warm-up budget" in coverage.shortfall
    finally:
        service.close()


def test_plan_items_outside_the_vocabulary_or_the_context_are_left_out_and_counted(engine, tmp_path):
    good = prefix(engine, SYSTEM_PROMPTS["support"], 2)
    out_of_vocab = good[:16] + [engine.vocab_size] + good[17:]
    too_long = (good * (engine.context_length // len(good) + 1))[: engine.context_length]
    warmed = []
    service = start_service(engine, ServiceConfig(control_dir=None), instance="inst_0")
    real_warm = service.plan._warm
    service.plan._warm = lambda adapter, tenant, ids, retention: (warmed.append(tuple(ids)),
                                                                  real_warm(adapter, tenant, ids, retention))
    try:
        from warmup_tools.control.plan_control import LivePlan

        plan = make_plan([item(good), item(out_of_vocab), item(too_long)])
        service.plan.apply(LivePlan.parse(plan.to_json().encode()))
        status = service.plan.status()
        # Only the good item is planned and warmed; the other two never reach the engine.
        assert {n: (c.planned, c.resident) for n, c in status.adapters.items()} == {"support": (2, 2), "sql": (0, 0)}
        assert warmed == [tuple(good)]
        assert status.detail.endswith("; 2 items outside the model's vocabulary or context")
    finally:
        service.close()
        engine.prefix_cache.activate_plan(None)


def test_an_items_retention_reaches_the_cache_and_a_pin_that_ended_stays_covered_and_is_not_warmed_again(engine):
    """Item A is pinned for 0.05 s (its plan item's retention_s), item B for the cache's default: once A's pins
    expire, coverage still counts them (readiness does not fall when pins end by design), the status carries the
    live check, and applying the same plan again warms nothing."""
    from warmup_tools.control.plan_control import LivePlan

    own = make_engine(dataclasses.replace(engine.config, adapters=("support",),
                                          kv=KVCacheConfig(budget_bytes=64 << 20)))
    short_ids, long_ids = prefix(own, SYSTEM_PROMPTS["support"], 3), prefix(own, SYSTEM_PROMPTS["legal"], 2)
    plan = LivePlan.parse(make_plan([{**item(short_ids), "retention_s": 0.05},
                                     item(long_ids, adapter="")]).to_json().encode())
    assert [i.retention_s for i in plan.items] == [float(np.float32(0.05)), None]
    service = start_service(own, ServiceConfig(control_dir=None), instance="inst_0")
    cache = own.prefix_cache
    warmed = []
    real_warm = service.plan._warm
    service.plan._warm = lambda *args: (warmed.append(args[2:]), real_warm(*args))
    try:
        service.plan.apply(plan)
        assert sorted(warmed) == sorted([(tuple(short_ids), float(np.float32(0.05))), (tuple(long_ids), None)])
        short, long = service.plan.hot["support"], service.plan.hot["base"]
        wait_for(lambda: cache.resident(short, plan.plan_id) == 0, "item A's pins to expire")
        assert cache.resident(long, plan.plan_id) == 2  # the cache's kv_pin_retention_s: still pinned
        assert cache.resident(short) == 3  # cached still: ordinary blocks of the eviction policy now

        status = service.plan.status()
        assert {n: (c.planned, c.resident) for n, c in status.adapters.items()} == {"support": (3, 3), "base": (2, 2)}
        pins = status.pins
        assert (pins.plan_id, pins.state, pins.pinned_blocks, pins.expired_blocks) == (plan.plan_id, "pinned", 2, 3)
        assert (pins.adapters["support"].expired_blocks, pins.adapters["base"].pinned_blocks) == (3, 2)
        assert service.plan.pins_now == pins

        warmed.clear()
        service.plan.apply(plan)  # the same plan again: nothing to warm, A is not pinned again
        assert warmed == [] and cache.resident(short, plan.plan_id) == 0
        assert service.plan.coverage()["support"].resident == 3
    finally:
        service.close()
