"""bench race's schedule, figures and table (the race against the project's own server: tests/integration/
test_bench_race.py)."""

from __future__ import annotations

import io

import pytest

from warmup_tools.common.errors import ConfigError
from warmup_tools.common.records import RequestRecord
from warmup_tools.sim.bench.race import RaceRun, Scheduled, Sent, format_race, replay, run, schedule, window


def record(ts: float, adapter: str = "") -> RequestRecord:
    return RequestRecord(ts=ts, tenant="t", adapter=adapter, prompt="hello")


def test_the_schedule_compresses_the_hours_into_the_replays_length_in_order():
    start = 1_000_000.0
    records = [record(start + 1800), record(start), record(start + 3600)]
    plan = schedule(records, start, hours=1.0, duration_s=120.0)
    assert [s.at_s for s in plan] == [0.0, 60.0, 120.0]
    assert [s.record.ts for s in plan] == sorted(r.ts for r in records)


@pytest.mark.parametrize(("hours", "duration_s"), [(0.0, 10.0), (1.0, 0.0), (-1.0, 5.0)])
def test_a_schedule_without_length_is_refused(hours, duration_s):
    with pytest.raises(ConfigError, match="must be > 0"):
        schedule([record(0.0)], 0.0, hours, duration_s)


def sent(at_s: float, ttft_ms: float, cached: int = 0, prompt: int = 100, error: str = "") -> Sent:
    return Sent(at_s, "", ttft_ms, cached, prompt, error)


def test_a_window_counts_cold_requests_cached_tokens_and_the_ttft_percentiles_of_the_answered_ones():
    w = window([sent(0, 10, cached=0), sent(1, 30, cached=50), sent(2, 20, cached=100), sent(3, 0, error="HTTP 500")])
    assert w.requests == 3 and w.cold == 1 and w.cold_share == pytest.approx(1 / 3)
    assert w.cached_share == pytest.approx(150 / 300)
    assert w.ttft_p50_ms == 20 and w.ttft_p99_ms == 30


def test_an_empty_window_has_no_figures():
    w = window([])
    assert w.requests == 0 and w.cold_share is None and w.cached_share is None and w.ttft_p99_ms is None


def test_a_run_splits_its_replay_at_the_first_window_and_its_jump_is_the_first_p99_over_the_rests():
    run_ = RaceRun("x", 3.0, [sent(0, 400), sent(59.9, 100), sent(60, 50), sent(100, 100)], first_s=60.0)
    assert run_.first.requests == 2 and run_.steady.requests == 2
    assert run_.first.ttft_p99_ms == 400 and run_.steady.ttft_p99_ms == 100
    assert run_.p99_jump == pytest.approx(4.0)


def test_a_run_without_a_steady_window_has_no_jump():
    assert RaceRun("x", 1.0, [sent(0, 10)], first_s=60.0).p99_jump is None


def test_the_table_has_a_row_per_run_and_the_projects_ratios_to_each_peer():
    runs = [RaceRun("this project (plan)", 20.0, [sent(0, 50, cached=80), sent(70, 40, cached=80)], 60.0),
            RaceRun("vLLM 0.32.0 (prefix caching)", 60.0, [sent(0, 200), sent(70, 40, cached=50)], 60.0),
            RaceRun("llama.cpp (prompt cache)", 2.0, [sent(0, 100), sent(70, 80, error="HTTP 503")], 60.0)]
    text = format_race(runs, first_s=60.0, traffic="real", duration_s=240.0, hours=1.0, max_tokens=8, threads=1)
    assert "| this project (plan) | 20 | 1 / 1 | 0.0% / 0.0% | 80.0% / 80.0% | 50 / 40 | 50 / 40 | 1.25 | 0 |" in text
    assert "| llama.cpp (prompt cache) | 2 | 1 / 0 | 100.0% / - | 0.0% / - | 100 / - | 100 / - | - | 1 |" in text
    # first window 50 / 200 = 0.25, the rest 40 / 40; against llama.cpp 50 / 100 and no steady figure.
    assert "| this project (plan) | 0.25 / 1.00 | 0.50 / - |" in text
    assert "| this project | vLLM 0.32.0 (prefix caching) | llama.cpp (prompt cache) |" in text


def test_the_project_alone_has_no_ratio_table():
    runs = [RaceRun("this project (plan)", 20.0, [sent(0, 50)], 60.0)]
    text = format_race(runs, first_s=60.0, traffic="real", duration_s=240.0, hours=1.0, max_tokens=8, threads=1)
    assert "this project / the peer" not in text


@pytest.mark.parametrize(("kwargs", "error", "message"),
                         [({"peers": "vllm,sglang"}, ValueError, "sglang: each must be one of vllm, llamacpp"),
                          ({"traffic": "yesterday"}, ConfigError, "traffic must be one of")])
def test_a_bad_choice_is_refused_before_anything_starts(tmp_path, kwargs, error, message):
    with pytest.raises(error, match=message):
        run(tmp_path, out=io.StringIO(), **kwargs)


def test_the_replay_sends_each_request_at_its_time_without_waiting_for_earlier_answers():
    """Open loop, on a fake clock: every send is submitted at its scheduled time, and the sleeps add up to the
    schedule (the answers come from a server that is not there: each fails with a transport error, counted)."""
    from warmup_tools.sim.bench.race import Endpoint, openai_body

    now = [0.0]
    slept = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    plan = [Scheduled(0.0, record(0.0)), Scheduled(2.5, record(1.0)), Scheduled(4.0, record(2.0))]
    answers = replay(Endpoint("http://127.0.0.1:9", openai_body), plan, max_tokens=1, clock=lambda: now[0],
                     sleep=sleep)
    assert slept == [2.5, 1.5]
    assert [a.at_s for a in answers] == [0.0, 2.5, 4.0]
    assert all(a.error for a in answers)


def test_a_llamacpp_slot_names_the_adapter_its_last_request_applied():
    from warmup_tools.sim.bench.race import slot_of

    adapters = ["legal", "sql", "support"]
    entry = {"id": 3, "n_prompt_tokens": 517,
             "params": {"lora": [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}, {"id": 2, "scale": 0.0}]}}
    assert (slot_of(entry, adapters).id, slot_of(entry, adapters).tokens, slot_of(entry, adapters).model) == (
        3, 517, "sql")
    assert slot_of({"id": 0, "params": {"lora": [{"id": 1, "scale": 0.0}]}}, adapters).model == "base"
    assert slot_of({"id": 1}, adapters).tokens == 0  # a slot that never served a request
    assert slot_of({"id": 2, "params": {"lora": [{"id": 7, "scale": 1.0}]}}, adapters).model == "base"


def test_every_answer_of_every_run_is_written_one_json_line_each(tmp_path):
    import json

    from warmup_tools.sim.bench.race import write_samples

    runs = [RaceRun("a", 1.0, [sent(0, 10, cached=16), sent(1, 0, error="HTTP 503")], 60.0),
            RaceRun("b", 2.0, [sent(0.5, 30)], 60.0)]
    write_samples(tmp_path / "s.jsonl", runs)
    lines = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [(x["run"], x["at_s"], x["ttft_ms"], x["cached_tokens"], x["error"]) for x in lines] == [
        ("a", 0, 10, 16, ""), ("a", 1, 0.0, 0, "HTTP 503"), ("b", 0.5, 30, 0, "")]
