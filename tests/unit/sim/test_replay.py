"""bench replay's floor and report, without a server (the replay itself is the benchmark)."""

from __future__ import annotations

import pytest

from warmup_tools.common.records import RequestRecord
from warmup_tools.sim.bench.replay import table, write_report
from warmup_tools.sim.bench.support.workload import Served, figures, floor

SYSTEM = "I want you to act as a patient maths tutor who explains every step of a proof with a simple example. "


@pytest.fixture(scope="module")
def tokenizer(demo_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_assets.lm_dir)


def rec(ts, prompt, tenant="acme", adapter=""):
    return RequestRecord(ts=ts, tenant=tenant, adapter=adapter, prompt=prompt)


def test_the_floor_reuses_day1_blocks_of_the_same_scope_and_earlier_replayed_ones(tokenizer):
    day1 = [rec(0, SYSTEM + "What is a prime number?")]
    novel = "Write a short poem about the sea at night, with a rhyme in every second line of it. " * 2
    replayed = [
        rec(10, SYSTEM + "Prove that there are infinitely many primes."),  # shares the system prompt's blocks
        rec(11, SYSTEM + "Prove it again.", tenant="globex"),  # another tenant: nothing to reuse
        rec(12, SYSTEM + "Prove it again.", adapter="legal"),  # another adapter: nothing either
        rec(13, novel),  # never seen
        rec(14, novel),  # seen by the request before
    ]
    best = floor(day1, replayed, tokenizer, 16)
    system_blocks = (len(tokenizer.encode(SYSTEM, add_special_tokens=True)) - 1) // 16
    assert [s.cold for s in best] == [False, True, True, True, False]
    assert best[0].cached_tokens >= (system_blocks - 1) * 16 and best[0].cached_tokens % 16 == 0
    novel_tokens = len(tokenizer.encode(novel, add_special_tokens=True))
    assert best[4].cached_tokens == (novel_tokens - 1) // 16 * 16  # all usable blocks; the last token is prefilled
    assert [s.prompt_tokens for s in best] == [len(tokenizer.encode(r.prompt, add_special_tokens=True))
                                               for r in replayed]
    f = figures("floor", best)
    assert (f.requests, f.cold) == (5, 3)
    assert f.cached_share == pytest.approx(sum(s.cached_tokens for s in best) / sum(s.prompt_tokens for s in best))


def test_the_report_has_both_plots_and_a_summary(tmp_path):
    served = [Served(100.0 + i * 60, i % 3 == 0, 10.0 + i, 16 * (i % 3 != 0), 40) for i in range(30)]
    best = [Served(s.ts, False, 0.0, 32, 40) for s in served]
    rows = [(1, figures("without plan", served), figures("with plan", served[::-1]), figures("floor", best))]
    write_report(tmp_path / "report", "real", 100.0, rows, served, served, best)
    for name in ("ttft.png", "cold_share.png"):
        assert (tmp_path / "report" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "| first 1 h | floor | 30 | 0 | 0.0% | 80.0% |" in summary and "![TTFT distribution](ttft.png)" in summary
    assert "takes 0% of the possible cold-share reduction" in table(rows, {})


def test_misses_name_the_requests_a_plan_leaves_cold_that_the_floor_serves(tokenizer):
    from warmup_tools.common.plan import Plan
    from warmup_tools.sim.bench.replay import misses

    def app(ts, question, tenant="acme"):
        return RequestRecord(ts=ts, tenant=tenant, adapter="", prompt=SYSTEM + question, template="tutor")

    raw = "How many moons does Jupiter have, and which of them is the largest one by far?"
    day1 = [app(0, "What is a prime number?"), app(1, "What is a square?"), rec(2, raw)]
    system = tokenizer.encode(SYSTEM, add_special_tokens=True)
    item = {"kind": "kv_prefix", "tenant": "acme", "adapter": "", "token_ids": system[:32]}
    plan = Plan(plan_id="p", created="", block_size=16, tokenizer_fingerprint="t", budgets={"kv_bytes_total": 1 << 20},
                settings={}, summary={"items": 1, "kv_bytes": 1 << 16}, items=[item], embedding_items=[],
                tokenizer_templates=[], clusters=[])
    replayed = [app(10, "What is a cube?"), rec(11, raw), rec(12, "Hi"), app(13, "What is a prime number?", "globex")]
    lines = misses(day1, replayed, plan, tokenizer, 16).splitlines()
    assert "plan 3 cold" in lines[0] and "floor 2 cold" in lines[0]
    assert [line.split(maxsplit=1) for line in lines[2:5]] == [
        ["1", "cold at the floor too (application call): first block new on day 2"],
        ["1", "cold at the floor too (raw call): no full block"],
        ["1", "cold with the plan, warm at the floor (raw call): first block carried by 1 day-1 request"]]
    assert "raw call, first missing block carried by 1 day-1 request" in lines[-1]


def test_the_cold_start_rows_count_day_twos_time_and_each_adapters_first_request():
    from warmup_tools.sim.bench.replay import cold_start

    start = 1_000_000.0
    records = [RequestRecord(ts=start + t, prompt="p", adapter=a) for t, a in ((0, ""), (20, "sql"), (400, "sql"))]
    planned = [Served(r.ts, False, 50.0, 8, 10) for r in records]
    without = [Served(r.ts, True, 100.0, 0, 10) for r in records]
    text = cold_start(records, planned, without, start)
    assert "| fleet start | first 60 s | 2 / 2 | 50 / 100 | 1.00 / 1.00 | 0 / 0 | 80.0% / 0.0% | 0.50 |" in text
    assert "| an adapter goes live | first 60 s | 1 / 1 |" in text, "sql's first request at 20 s"
    assert "| a replica joins | first 60 s | no replica joined |" in text and "(measured ms)" in text
