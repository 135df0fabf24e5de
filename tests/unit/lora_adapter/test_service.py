"""One instance's service on the demo engine: adapters warmed beside live traffic, in chunks."""

from __future__ import annotations

import pytest

from tests.unit.lora_adapter.conftest import CollectingSink, serve_and_wait, start_service
from warmup_tools.control.registry import ControlRegistry
from warmup_tools.control.state import AdapterState
from warmup_tools.demo.prompts import SYSTEM_PROMPTS
from warmup_tools.kv.config import KVCacheConfig
from warmup_tools.lora_adapter.engines import make_engine
from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams
from warmup_tools.lora_adapter.service import LoraService
from warmup_tools.lora_adapter.settings import EngineConfig, SchedulerConfig, ServiceConfig


@pytest.fixture(scope="module")
def engine(demo_assets):
    # Only "support" at start; "sql" is under the root for the operator to add.
    return make_engine(EngineConfig(base_model=demo_assets.lm_dir, adapter_root=demo_assets.adapter_root,
                                   adapters=("support",), kv=KVCacheConfig(budget_bytes=64 << 20),
                                   num_threads=1))


def greedy_request(ids, adapter):
    return GenerateRequest(tuple(ids), adapter, "default", False, SamplingParams(max_tokens=8))


def greedy(service, ids, adapter):
    """Greedy tokens and cached tokens, served through the service (its scheduler)."""
    steps = serve_and_wait(service, greedy_request(ids, adapter))
    return [s.token_id for s in steps], steps[-1].cached_tokens


@pytest.mark.parametrize("budget", [64, 256])  # 256: more than the prompt, so one step
def test_an_added_adapter_is_warmed_in_steps_and_its_prompts_are_then_cached(engine, reference, tmp_path, budget):
    prompt = SYSTEM_PROMPTS["sql"] + f"User: list the tables (budget {budget})\nAssistant:"
    ids = engine.encode(prompt)
    assert 64 < len(ids) <= 256
    registry = ControlRegistry(tmp_path)
    # With no live traffic, warm-up takes whole steps: the step's token budget at a time.
    service = start_service(engine, ServiceConfig(control_dir=tmp_path, control_poll_s=0.05),
                            batching=SchedulerConfig(max_num_batched_tokens=budget))
    try:
        registry.add("sql", [prompt])
        registry.wait_until("sql", AdapterState.LIVE, instances=1, timeout_s=120)
        status = service.lifecycle.snapshot()["sql"]
        steps = -(-len(ids) // budget)
        assert f"{steps} steps" in status.detail, status.detail
        tokens, cached = greedy(service, ids, "sql")
        # Everything but the last token comes from the cache, whole blocks only.
        assert cached == (len(ids) - 1) // 16 * 16 > 0
    finally:
        registry.retire("sql")
        registry.wait_until("sql", AdapterState.RETIRED, instances=1, timeout_s=60)
        service.close()
    # The KV built chunk by chunk gives the output a cold prefill gives.
    assert tokens == reference.generate(greedy_request(ids, "sql")).tokens


def test_with_the_scheduler_an_added_adapter_loads_and_warms_inside_it(engine, reference, tmp_path):
    from warmup_tools.lora_adapter.scheduler import Scheduler

    prompt = SYSTEM_PROMPTS["sql"] + "User: list the tables (scheduled)\nAssistant:"
    ids = engine.encode(prompt)
    registry = ControlRegistry(tmp_path)
    scheduler = Scheduler(engine)
    scheduler.start()
    service = LoraService(engine, ServiceConfig(control_dir=tmp_path, control_poll_s=0.05), instance="test_0",
                          scheduler=scheduler)
    try:
        registry.add("sql", [prompt])
        registry.wait_until("sql", AdapterState.LIVE, instances=1, timeout_s=120)
        assert "warmed 1 prompts" in service.lifecycle.snapshot()["sql"].detail
        sink = CollectingSink()
        service.serve(greedy_request(ids, "sql"), sink)
        assert sink.done.wait(120)
        assert sink.steps[0].cached_tokens == (len(ids) - 1) // 16 * 16 > 0
    finally:
        registry.retire("sql")
        registry.wait_until("sql", AdapterState.RETIRED, instances=1, timeout_s=60)
        service.close()
    assert not engine.has_adapter("sql")  # unloaded on the scheduler's thread
    assert [s.token_id for s in sink.steps] == reference.generate(greedy_request(ids, "sql")).tokens


def test_an_instance_starts_and_converges_when_the_control_files_are_nested_100000_deep(engine, tmp_path):
    (tmp_path / "desired.json").write_bytes(b'{"adapters": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    (tmp_path / "plan.json").write_bytes(b"{" * 100_000)
    service = start_service(engine, ServiceConfig(control_dir=tmp_path, control_poll_s=0.05))  # no RecursionError
    try:
        assert service.reconciler.maybe_reconcile() is False  # the poll keeps working on the bad file
        tokens, _ = greedy(service, engine.encode("User: hello\nAssistant:"), "support")
        assert tokens
        (tmp_path / "desired.json").unlink()
        registry = ControlRegistry(tmp_path)
        registry.add("sql", [], live=True)
        registry.wait_until("sql", AdapterState.LIVE, instances=1, timeout_s=120)
    finally:
        service.close()
