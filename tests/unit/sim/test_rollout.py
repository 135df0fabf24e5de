"""``bench rollout``'s bookkeeping: the replay's clock, each side's cold share by window, and the goals."""

from __future__ import annotations

from warmup_tools.common.jsonl import write_json_lines
from warmup_tools.common.records import RequestRecord
from warmup_tools.sim.bench.rollout import ReplayClock, Trial, cold_by_side, goals


def test_the_replay_clock_is_held_at_the_moment_the_replay_stopped():
    now = [100.0]
    clock = ReplayClock(lambda: now[0])
    with clock.hold() as stopped:
        now[0] = 160.0  # a plan made and warmed meanwhile
        assert clock() == stopped == 100.0
    assert clock() == 160.0 and clock.held is None


def test_each_side_s_requests_are_counted_in_the_window_of_the_request_sent_before_them(tmp_path):
    def log(path, *entries):
        write_json_lines(path, [RequestRecord(ts=ts, tenant="t", prompt_tokens=64, cached_tokens=cached).to_json()
                                for ts, cached in entries])

    # Requests sent at wall 10, 20, 30, 40: simulated minutes 0, 5, 10, 15.
    sent_wall, sent_min = [10.0, 20.0, 30.0, 40.0], [0.0, 5.0, 10.0, 15.0]
    log(tmp_path / "r1" / "requests-a.jsonl", (10.5, 0), (20.5, 48), (30.5, 0))
    log(tmp_path / "r1" / "requests-b.jsonl", (40.5, 0))
    log(tmp_path / "r2" / "requests-a.jsonl", (5.0, 0), (20.5, 48), (40.5, 48))  # 5.0: before any request sent
    logs = {"r1": sorted((tmp_path / "r1").glob("*.jsonl")), "r2": sorted((tmp_path / "r2").glob("*.jsonl"))}
    counts = cold_by_side(logs, sent_wall, sent_min, {"before": (0.0, 10.0), "after": (10.0, 20.0)})
    assert counts == {"before": {"r1": (1, 2), "r2": (0, 1)}, "after": {"r1": (2, 2), "r2": (0, 1)}}


def test_the_goals_are_a_promoted_re_plan_and_a_bad_plan_rolled_back_within_five_minutes():
    good = Trial("good", 30.0, "p1", ended_min=41.0, verdict="promote")
    bad = Trial("bad", 90.0, "p2", ended_min=94.5, verdict="rollback")
    assert [line.endswith(": met") for line in goals([good, bad])] == [True, True]
    slow = Trial("bad", 90.0, "p2", ended_min=95.5, verdict="rollback")
    rolled = Trial("good", 30.0, "p1", ended_min=31.0, verdict="rollback")
    lines = goals([rolled, slow])
    assert all(line.endswith("**not met**") for line in lines) and "after 5.5 simulated min" in lines[1]
    assert goals([Trial("good", 30.0, "p1")]) == ["good: no verdict (goal: promote): **not met**"]


def test_the_benchs_warm_up_may_fill_the_cache_but_the_live_reserve(tmp_path):
    from warmup_tools.kv.config import KVCacheConfig
    from warmup_tools.sim.bench.rollout import let_warm_up_fill
    (tmp_path / "config.pbtxt").write_text('name: "lora_adapter"\n', encoding="utf-8")
    let_warm_up_fill(tmp_path)
    share = 1.0 - KVCacheConfig().live_reserve
    assert (tmp_path / "config.pbtxt").read_text().splitlines()[1:] == [
        f'parameters {{ key: "kv_warm_share" value: {{ string_value: "{share:g}" }} }}']
