"""The simulated engine (warmup_tools/lora_adapter/simulated.py): determinism through the real scheduler and
prefix cache, its time model, budgets in the profile's bytes, snapshots' verification, profiles and their fit.

No test waits on a wall clock: the engine's ``sleep`` and ``clock`` are injected.
"""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest

from tests.unit.lora_adapter.test_scheduler import RecordingSink, drain
from warmup_tools.common.errors import ConfigError, UnknownAdapterError
from warmup_tools.kv.config import KVCacheConfig
from warmup_tools.lora_adapter.profile import (
    DecodeCost,
    EngineProfile,
    PrefillCost,
    StepShape,
    load_profile,
    profile_names,
)
from warmup_tools.lora_adapter.profile_fit import fit_decode, fit_prefill
from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams
from warmup_tools.lora_adapter.runner import BatchRow
from warmup_tools.lora_adapter.scheduler import Scheduler
from warmup_tools.lora_adapter.settings import DEFAULT_BATCHING, ENGINE_KINDS, EngineConfig, LoraAdapterSettings
from warmup_tools.lora_adapter.simulated import SimulatedEngine

PROFILE = EngineProfile(
    name="test", hardware="none", model="none", source="made up for the tests", kv_bytes_per_token=1000,
    kv_capacity_tokens=10_000, prefill=PrefillCost(overhead_ms=20.0, ms_per_row=6.0, ms_per_token=0.5,
                                                               ms_per_token_context=3.0),
    decode=DecodeCost(base_ms=10.0, ms_per_row=2.0, ms_per_1k_context_tokens=4.0))


class FakeTime:
    """A clock that only moves when slept on (or by ``work`` seconds on each look, the forward's real work)."""

    def __init__(self, work: float = 0.0):
        self.now, self.work, self.slept = 0.0, work, []

    def clock(self) -> float:
        self.now += self.work
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def simulated(demo_assets, *, budget_bytes=16 * 1000 * 64, block_size=16, profile=PROFILE, speedup=1.0, time=None):
    time = time or FakeTime()
    config = EngineConfig(base_model=demo_assets.lm_dir, adapter_root=demo_assets.adapter_root, kind="simulated",
                          profile="h100-llama-3.1-8b", speedup=speedup,
                          kv=KVCacheConfig(budget_bytes=budget_bytes, block_size=block_size))
    return SimulatedEngine(config, profile=profile, sleep=time.sleep, clock=time.clock)


def request(engine, text, adapter="support", max_tokens=24, **sampling):
    sampling = SamplingParams(max_tokens=max_tokens, **sampling)
    return GenerateRequest(engine.encode(text), adapter, "acme", True, sampling)


def serve(engine, req):
    scheduler = Scheduler(engine, DEFAULT_BATCHING)
    sink = RecordingSink()
    scheduler.submit(req, sink)
    drain(scheduler)
    assert not sink.errors, sink.errors
    return sink


PROMPT = "You are a support agent for a billing product. Answer briefly and politely. " * 3 + "User: two charges?"


def test_the_engine_kinds_are_the_settings_choices():
    from warmup_tools.lora_adapter.engines import ENGINES

    assert tuple(ENGINES) == ENGINE_KINDS and EngineConfig.__dataclass_fields__["kind"].default == "real"


def test_the_same_prompt_gives_the_same_tokens_on_two_engines_and_cached_or_not(demo_assets):
    first, second = simulated(demo_assets), simulated(demo_assets)
    # NOTE: ignore_eos: the tokens depend on the adapter's fingerprint, and the demo adapter_config.json records the
    # absolute path of the assets, so where the checkout lies decides where an end-of-sequence token falls.
    req = request(first, PROMPT, ignore_eos=True)
    cold = serve(first, req)
    warm = serve(first, req)  # its prompt blocks are cached now
    other = serve(second, req)  # a fresh engine: nothing cached
    assert cold.steps[-1].cached_tokens == 0 and warm.steps[-1].cached_tokens >= 16
    assert cold.tokens == warm.tokens == other.tokens and cold.text == warm.text
    assert len(set(cold.tokens)) > 3  # not a constant
    # Another adapter (another identity in the function) gives other tokens.
    assert serve(second, request(second, PROMPT, adapter="legal")).tokens != cold.tokens


def test_a_sampled_request_is_reproducible_and_eos_ends_some_sequences(demo_assets):
    engine = simulated(demo_assets)
    req = request(engine, PROMPT, temperature=0.8, seed=7)
    assert serve(engine, req).tokens == serve(simulated(demo_assets), req).tokens
    rng = random.Random(1)
    reasons = []
    for _ in range(12):
        ids = tuple(rng.randrange(3, 4000) for _ in range(20))
        sink = serve(engine, GenerateRequest(ids, None, "acme", True, SamplingParams(max_tokens=200)))
        reasons.append(sink.steps[-1].finish_reason)
    assert "stop" in reasons  # EOS is reached now and then


def test_a_step_waits_the_modelled_time_less_the_real_work(demo_assets):
    time = FakeTime(work=0.001)
    engine = simulated(demo_assets, time=time, speedup=2.0)
    past = engine.compute_kv(None, list(range(3, 103)))  # 100 tokens of context
    rows = [BatchRow([5] * 30, 0, None, "support"), BatchRow([7] * 10, 100, past, None),
            BatchRow([9], 100, past, "legal"), BatchRow([9], 100, past, None)]
    # prefill: 40 tokens attending to 30*31/2 + 10*100 + 10*11/2 = 1520 keys; decode: 2 rows of 101 keys.
    expected_ms = (20.0 + 6.0 * 1 + 0.5 * 40 + 3.0 * 1.520) + (10.0 + 2.0 * 2 + 4.0 * 0.202)
    assert engine.step_seconds(rows) == pytest.approx(expected_ms / 1000)
    assert StepShape.of([(30, 0), (10, 100), (1, 100), (1, 100)]) == StepShape(2, 40, 1.52, 2, 0.202)
    outputs = engine.forward_batch(rows)
    assert len(outputs) == 4 and outputs[1].kv[0][0].shape == (1, 1, 110, 2)
    # Waited: the modelled time over the speed-up, less the 1 ms the clock saw pass during the forward.
    assert time.slept == [pytest.approx(expected_ms / 1000 / 2 - 0.001)]
    assert engine.modelled_seconds == pytest.approx(expected_ms / 1000) and engine.steps == 1
    # A step whose real work took longer than modelled waits nothing more.
    slow = FakeTime(work=10.0)
    simulated(demo_assets, time=slow).forward_batch(rows)
    assert slow.slept == []


def test_the_prefix_cache_counts_the_profiles_bytes_per_token(demo_assets):
    engine = simulated(demo_assets, budget_bytes=64 * 1000, block_size=16)  # 64 tokens of 1000 modelled bytes
    assert engine.kv_bytes_per_token == 1000 and engine.prefix_cache.block_bytes == 16_000
    ids = list(range(3, 3 + 64))
    kv = engine.compute_kv(None, ids)
    hashes, _ = engine.block_hashes(GenerateRequest(tuple(ids), None, "acme", True, SamplingParams()))
    cache = engine.prefix_cache
    assert cache.store(hashes, kv, tokens=ids) == 4  # a budget of 64 tokens' modelled bytes holds 64 tokens
    assert cache.stats.bytes_used == 64_000 == cache.budget_bytes
    # A running sequence's 16 tokens (reserved at the same bytes per token) take one block's room.
    assert cache.reserve(16 * engine.kv_bytes_per_token)
    assert cache.stats.evictions == 1 and len(cache) == 3


def test_a_simulated_engine_s_blocks_verify_against_its_own_compute_kv(demo_assets):
    engine = simulated(demo_assets)
    req = request(engine, PROMPT)
    serve(engine, req)
    hashes, _ = engine.block_hashes(req)
    match = engine.prefix_cache.match(hashes)
    loaded = engine.prefix_cache.load(match, engine.dtype)
    recomputed = engine.compute_kv("support", list(req.prompt_ids[:match.num_tokens]))
    assert match.num_tokens >= 16 and np.array_equal(loaded[0][0], recomputed[0][0])
    engine.prefix_cache.release(match)
    with pytest.raises(UnknownAdapterError):
        engine.compute_kv("nope", [5])


def test_adapters_are_discovered_and_fingerprinted_without_weights(demo_assets):
    engine = simulated(demo_assets)
    assert set(engine.adapters) == {"support", "legal", "sql"} and all(engine.adapter_fingerprints.values())
    engine.unload_adapter("sql")
    assert not engine.has_adapter("sql")
    engine.load_adapter("sql")
    assert engine.has_adapter("sql") and engine.scope("sql", "t").adapter_fingerprint


#: Each published GPU profile: KV bytes per token from the model's config (layers, KV heads, head_dim, 2 bytes),
#: the source's TTFT of a 256-token prompt, its ITL at one request and at its max-num-seqs (time-factor-under-load).
GPU_PROFILES = {
    "h100-llama-3.1-8b": ((32, 8, 128), 30 + 256 * 0.25, 12.0, (16, 24.0)),
    "h100x8-llama-3.1-70b": ((80, 8, 128), 80 + 256 * 0.5, 25.0, (64, 75.0)),
    "l40s-llama-3.2-3b": ((28, 8, 128), 20 + 256 * 0.35, 15.0, (4, 22.5)),
}


def test_the_shipped_profiles_load_and_the_gpu_ones_keep_their_sources():
    assert {"cpu-demo-lm", *GPU_PROFILES} <= set(profile_names())
    for name in profile_names():
        assert load_profile(name).name == name
    for name, ((layers, kv_heads, head_dim), ttft_256, itl_1, (seqs, itl_full)) in GPU_PROFILES.items():
        gpu = load_profile(name)
        assert gpu.kv_bytes_per_token == 2 * layers * kv_heads * head_dim * 2
        assert gpu.step_ms(StepShape.of([(256, 0)])) == pytest.approx(ttft_256)
        assert gpu.step_ms(StepShape.of([(1, 10)])) == pytest.approx(itl_1, abs=1e-3)
        assert gpu.step_ms(StepShape.of([(1, 10)] * seqs)) == pytest.approx(itl_full, abs=1e-3)
        figures = {f"{section}.{key}" for section in ("prefill", "decode") for key in gpu.to_json()[section]}
        assert figures | {"kv_bytes_per_token", "kv_capacity_tokens"} <= set(gpu.sources)


def test_a_gpu_profile_waits_its_time_and_a_cpu_profile_keeps_a_core_busy_for_it(demo_assets):
    assert load_profile("cpu-demo-lm").device == "cpu" and load_profile("h100-llama-3.1-8b").device == "gpu"
    rows = [BatchRow((1, 2, 3), 0, None, None)]
    for device, slept, occupied in (("gpu", 1, 0), ("cpu", 0, 1)):
        time, spent = FakeTime(), []
        engine = SimulatedEngine(simulated(demo_assets).config, profile=dataclasses.replace(PROFILE, device=device),
                                 sleep=time.sleep, clock=time.clock, occupy=spent.append)
        engine.forward_batch(rows)
        assert (len(time.slept), len(spent)) == (slept, occupied)
        assert (time.slept + spent)[0] == pytest.approx(PROFILE.step_ms(StepShape.of([(3, 0)])) / 1000)
    assert dataclasses.replace(PROFILE, device="cpu").to_json()["device"] == "cpu"


def test_keeping_a_core_busy_spends_this_threads_cpu_time():
    from time import thread_time

    from warmup_tools.lora_adapter.simulated import occupy_core

    started = thread_time()
    occupy_core(0.02)
    assert thread_time() - started >= 0.02  # however long the wall clock took (the machine may be busy)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("decode"), "missing key(s) decode"),
    (lambda d: d.update(extra=1), "unknown key(s) extra"),
    (lambda d: d["prefill"].update(ms_per_token=-1), "prefill.ms_per_token must be a finite number >= 0"),
    (lambda d: d["decode"].pop("ms_per_row"), "decode must hold exactly"),
    (lambda d: d.update(kv_bytes_per_token=0), "kv_bytes_per_token must be a whole number >= 1"),
    (lambda d: d.update(name=""), "name must be a non-empty text"),
    (lambda d: d.update(device="tpu"), "device must be one of gpu, cpu"),
])
def test_a_bad_profile_is_a_config_error_naming_the_file_and_the_field(tmp_path, change, message):
    data = load_profile("h100-llama-3.1-8b").to_json()
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="bad.json") as raised:
        load_profile(path)
    assert message in str(raised.value)


def test_an_unknown_profile_fails_the_settings_naming_the_shipped_ones(demo_assets, tmp_path):
    with pytest.raises(ConfigError, match="shipped profiles: .*h100-llama-3.1-8b"):
        EngineConfig(base_model=demo_assets.lm_dir, kind="simulated", profile="no-such-profile")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConfigError, match="not readable JSON"):
        EngineConfig(base_model=demo_assets.lm_dir, kind="simulated", profile=str(tmp_path / "broken.json"))
    EngineConfig(base_model=demo_assets.lm_dir, profile="no-such-profile")  # the real engine ignores it


def test_the_planner_sizes_plans_in_the_simulated_engines_bytes(demo_assets):
    settings = LoraAdapterSettings(engine=EngineConfig(base_model=demo_assets.lm_dir, kind="simulated",
                                                       profile="h100-llama-3.1-8b"))
    assert settings.kv_bytes_per_token() == 131072


def test_the_fit_recovers_a_simulated_engines_coefficients_measured_through_the_protocol(demo_assets):
    """profile-fit times whichever forward it is given through SequenceEngine (open, an untimed forward of each row's
    past, the timed step, close): on the simulated engine, whose forward takes exactly its profile's time (a clock
    that moves only when slept on), the fit returns that profile's coefficients."""
    from warmup_tools.lora_adapter.profile_fit import DECODE_BATCHES, PREFILL_BATCHES, measure

    time = FakeTime()
    engine = simulated(demo_assets, time=time)
    prefill_steps, decode_steps = measure(engine, repeats=1, clock=time.clock)
    assert [shape for shape, _ in prefill_steps] == [StepShape.of(batch) for batch in PREFILL_BATCHES]
    assert len(decode_steps) == len(DECODE_BATCHES) and engine.held_sequences() == 0
    prefill, prefill_report = fit_prefill(prefill_steps)
    decode, decode_report = fit_decode(decode_steps)
    for fitted, true in ((prefill, PROFILE.prefill), (decode, PROFILE.decode)):
        for name in fitted.__dataclass_fields__:
            assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=0.01), name
    assert prefill_report.max_rel_error < 0.01 and decode_report.max_rel_error < 0.01


def test_the_fit_recovers_known_coefficients_from_synthetic_timings():
    rng = random.Random(3)
    # Sizes spread like the fit's own steps (log-uniform, 8 to 1024 tokens), so the overhead is visible.
    prefill_steps = [StepShape.of([(int(2 ** rng.uniform(3, 10)), rng.choice((0, 0, 256, 1024)))
                                   for _ in range(rng.randrange(1, 9))]) for _ in range(40)]
    decode_steps = [StepShape.of([(1, rng.randrange(1, 2048))] * rng.randrange(1, 17)) for _ in range(30)]

    def noisy(steps):  # 0.5% noise
        return [(s, PROFILE.step_ms(s) * (1 + rng.uniform(-0.005, 0.005))) for s in steps]

    prefill, prefill_report = fit_prefill(noisy(prefill_steps))
    decode, decode_report = fit_decode(noisy(decode_steps))
    for fitted, true in ((prefill, PROFILE.prefill), (decode, PROFILE.decode)):
        for name in fitted.__dataclass_fields__:
            assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=0.1), name
    assert prefill_report.rms_rel_error < 0.02 and decode_report.max_rel_error < 0.03
    # A coefficient the data say is negative is held at 0, not returned negative.
    flat = [(StepShape.of([(1, c)] * r), 5.0 + 1.0 * r - 0.001 * c) for r in (1, 4, 8) for c in (10, 500, 1000)]
    assert fit_decode(flat)[0].ms_per_1k_context_tokens == 0.0


def test_a_simulated_replicas_processes_import_neither_torch_nor_transformers(demo_assets, tmp_path):
    """What every Python process of a simulated replica imports (the three stubs' model.py imports, the sidecar and
    its front), and what a simulated engine does at run time: load the tokenizer, serve a request through the
    scheduler and prefix cache, write a KV snapshot and read it back; torch and transformers stay out."""
    import os
    import re
    import subprocess
    import sys

    from warmup_tools.server.config import REPO_ROOT

    modules = sorted({m for path in (REPO_ROOT / "model_repository").glob("*/1/model.py")
                      for m in re.findall(r"^from (warmup_tools[\w.]*) import", path.read_text(), re.M)})
    modules += ["warmup_tools.ops.cli.serving", "warmup_tools.sidecar.app", "warmup_tools.front.app"]
    script = f"""
import importlib, sys
from pathlib import Path
for name in {modules!r}:
    importlib.import_module(name)
from tests.unit.lora_adapter.test_scheduler import RecordingSink, drain
from warmup_tools.kv.config import KVCacheConfig
from warmup_tools.kv.snapshot import write_snapshot
from warmup_tools.kv.snapshot_verify import read_snapshot
from warmup_tools.lora_adapter.engines import make_engine
from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams
from warmup_tools.lora_adapter.scheduler import Scheduler
from warmup_tools.lora_adapter.settings import DEFAULT_BATCHING, EngineConfig
from warmup_tools.lora_adapter.snapshot_restore import engine_identity
engine = make_engine(EngineConfig(base_model=Path({str(demo_assets.lm_dir)!r}),
                                  adapter_root=Path({str(demo_assets.adapter_root)!r}), kind="simulated",
                                  speedup=1000.0, kv=KVCacheConfig(budget_bytes=1 << 30, block_size=16)))
scheduler, sink = Scheduler(engine, DEFAULT_BATCHING), RecordingSink()
ids = engine.encode("You are a support agent. " * 8 + "User: two charges?")
scheduler.submit(GenerateRequest(ids, "support", "acme", True, SamplingParams(max_tokens=4, temperature=0.7)), sink)
drain(scheduler)
assert not sink.errors and sink.steps[-1].finished, sink.errors
blocks = engine.prefix_cache.snapshot_blocks(1 << 30)
info = write_snapshot(Path({str(tmp_path)!r}), "s", engine_identity(engine), dict(engine.adapter_fingerprints),
                      blocks, created=1.0, arrays=engine.prefix_cache.arrays)
read = read_snapshot(info.manifest, engine_identity(engine), max_payload_bytes=1 << 30,
                     arrays=engine.prefix_cache.arrays)
assert len(read.blocks) == len(blocks) > 0
print(sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr[-2000:]
