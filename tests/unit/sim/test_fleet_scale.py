"""bench fleet-scale's arithmetic: a replica's KV budget from the profile and the trace's blocks, the figures of
a run from its answers, the table; and bench fidelity's comparison. The fleets themselves run in
tests/integration/test_fleet_scale.py."""

from __future__ import annotations

import math

from warmup_tools.lora_adapter.profile import load_profile
from warmup_tools.sim.bench.fidelity import Served, percentile, report
from warmup_tools.sim.bench.fleet_scale import (
    Item,
    Workload,
    summarise,
    table,
)
from warmup_tools.sim.bench.support.sending import Answer
from warmup_tools.sim.bench.support.simulated import replica_kv_tokens, simulated_environment


def test_a_replicas_kv_budget_is_the_profiles_device_in_the_traces_blocks():
    engine = load_profile("h100-llama-3.1-8b")
    # 439,453 tokens of 512-token blocks on the device: 858 blocks, each 16 tokens after the length scale
    assert replica_kv_tokens(engine, 16, "conversation") == engine.kv_capacity_tokens * 16 // 512 == 13732
    assert replica_kv_tokens(engine, 32, "conversation") == 2 * 13732 + 1
    env = simulated_environment("h100-llama-3.1-8b", 4.0, 13732 * engine.kv_bytes_per_token)
    assert env == {"WARMUP_ENGINE": "simulated", "WARMUP_ENGINE_PROFILE": "h100-llama-3.1-8b",
                   "WARMUP_ENGINE_SPEEDUP": "4.0", "WARMUP_KV_CACHE_BYTES": str(13732 * 131072)}


def test_a_runs_figures_count_cached_tokens_over_prompt_tokens_and_leave_failures_out():
    answers = [Answer(10.0, 5.0, 30, 100), Answer(20.0, 5.0, 0, 100), Answer(700.0, 5.0, 100, 100),
               Answer(30.0, 0.0, 0, 0, "HTTP 503: draining")]
    row = summarise("2 x cache_aware", 2, answers, [100.0, 300.0, 200.0], window_s=600, per_replica="2/1",
                    kv_use="50%/40%")
    assert (row.requests, row.failed) == (4, 1)
    assert math.isclose(row.cached_share, 130 / 300) and math.isclose(row.early_cached_share, 30 / 200)
    assert math.isclose(row.cold_share, 1 / 3)
    assert (row.ttft_p50_ms, row.ttft_p99_ms) == (200.0, 300.0)
    text = table([row, summarise("oracle", 1, answers[:1], [], 600, "1", "")])
    assert "| 2 x cache_aware | 4 (1) | 43.3% | 15.0% | 33.3% | 200 | 300 | 2/1 | 50%/40% |" in text
    assert "| oracle | 1 (0) | 30.0% | 30.0% | 0.0% | - | - | 1 |  |" in text, "no modelled TTFT: a dash"


def test_the_replayed_items_stop_at_the_replay_and_the_scale_out_goes_on():
    items = [Item(float(s), "p", 1) for s in (0, 50, 119, 120, 200)]
    load = Workload(items, 120.0, [], None, None, [], 1, "")  # type: ignore[arg-type]
    assert [i.at_s for i in load.replayed] == [0, 50, 119]


def test_fidelity_compares_percentiles_within_the_tolerance_and_cached_tokens_per_request():
    real = [Served(100.0 + i, 10.0, 16 * (i % 3)) for i in range(20)]
    simulated = [Served(110.0 + i, 10.5, 16 * (i % 3)) for i in range(19)] + [Served(0.0, None, 0, "HTTP 500")]
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([5.0], 0.9) == 5.0
    text = report(real, simulated, "cpu-demo-lm")
    assert "| TTFT p50 | 109.5 | 119.0 | 1.09 | yes |" in text
    assert "| ITL p90 | 10.0 | 10.5 | 1.05 | yes |" in text
    assert "0 of 19 requests differ" in text
    worse = [Served(s.ttft_ms * 1.3, s.itl_ms, s.cached_tokens + 1) for s in real]
    text = report(real, worse, "cpu-demo-lm")
    assert "| 1.30 | no |" in text and "20 of 20 requests differ" in text


def test_a_protocol_runs_figures_each_joiners_first_window_against_the_fleets_steady_share():
    from warmup_tools.sim.bench.fleet_scale import JOINER_WINDOW_S, JoinerWindow, protocol_result, protocols_table
    from warmup_tools.sim.bench.support.cold_start import Sample

    answers = [Answer(0.0, 10.0, 30, 100), Answer(1.0, 10.0, 0, 100),
               Answer(2.0, 0.0, 0, 0, "boom", 503, "unavailable", "grpc://127.0.0.1:5")]
    replay_s = 1200.0
    samples = {
        "r1": [Sample(10.0, 50.0, 0, 100), Sample(400.0, 60.0, 50, 100), Sample(700.0, 70.0, 50, 100)],
        "r2": [Sample(610.0, 80.0, 90, 100), Sample(610.0 + JOINER_WINDOW_S, 90.0, 0, 100)],
        "r3": [Sample(620.0, 300.0, 0, 100), Sample(630.0, 200.0, 10, 100)],
    }
    result = protocol_result("grpc", answers, samples, ("r2", "r3"), 600.0, replay_s, "table", "3/2/2")
    assert (result.requests, result.failed, result.cached_share) == (3, 1, 0.15)
    # The warmed joiner's first window: its one request at 610 s (the next one is past the window).
    assert result.warmed == JoinerWindow(1, 0.9, 80.0)
    assert result.cold.requests == 2 and result.cold.share == 0.05 and 200.0 < result.cold.ttft_p99_ms <= 300.0
    # Steady: after 300 s, both joiners' first windows left out: r1's 400 and 700 s, r2's second.
    assert math.isclose(result.steady_share, 100 / 300)
    assert result.ttft_p50_ms == 80.0
    table_text = protocols_table([result], oracle_share=0.3)
    assert "| grpc | 3 (1) | 15.0% | 50% |" in table_text and "90.0% / 80 (1)" in table_text
    alone = protocol_result("http", answers[:1], {"r1": samples["r1"]}, (None, None), None, replay_s, "", "3")
    assert alone.warmed == alone.cold == JoinerWindow() and "| - (0) | - (0) |" in protocols_table([alone], 0.0)
