"""``bench soak``'s judgements without a server: flatness, recovery windows and lost requests, bad requests."""

from __future__ import annotations

import math
import random

import pytest

from warmup_tools.sim.bench.soak import _bad_requests, format_summary, verdict_failures
from warmup_tools.sim.bench.support.soak_checks import (
    ANSWERED,
    CANCELLED,
    ECHOED,
    ERROR,
    FLAT,
    GROWING,
    HTTP_STATUS,
    HUNG,
    NO_DATA,
    OK,
    SUCCEEDED,
    UNCLEAR,
    WRONG_CLASS,
    BadKind,
    ProcSample,
    RequestRecord,
    SoakSettings,
    Tolerance,
    Window,
    account,
    flatness,
    judge_bad,
    pooled_slope,
    process_role,
)

MIB = 1 << 20


def _series(role, pid, start_s, end_s, level, per_10min=0.0, born_s=-60.0, noise=0.0, every=5.0, seed=0):
    rng = random.Random(seed)
    samples, t = [], start_s
    while t <= end_s:
        value = level + per_10min * (t - start_s) / 600 + rng.uniform(-noise, noise)
        samples.append(ProcSample(t, role, pid, t - born_s, int(value), int(value), int(value)))
        t += every
    return samples


# ------------------------------------------------------------------------------------------ flatness
def test_a_flat_noisy_series_is_flat_and_a_slow_leak_is_growing():
    flat = _series("tritonserver", 10, 0, 1800, 500 * MIB, noise=2 * MIB)
    row = flatness(flat, "tritonserver", "rss_bytes", 300, [])
    assert row.verdict == FLAT and abs(row.slope_per_10min) < 1 * MIB
    assert row.at_settle == pytest.approx(500 * MIB, abs=2 * MIB)
    # 20 MiB per 10 minutes on 500 MiB: above the tolerance (2% of the level = 10 MiB).
    leak = _series("tritonserver", 10, 0, 1800, 500 * MIB, per_10min=20 * MIB, noise=2 * MIB)
    row = flatness(leak, "tritonserver", "rss_bytes", 300, [])
    assert row.verdict == GROWING and row.slope_per_10min == pytest.approx(20 * MIB, rel=0.1)
    assert row.max_after >= 500 * MIB + 20 * MIB * 2.4


def test_a_falling_level_is_flat():
    falling = _series("sidecar", 3, 0, 1800, 80 * MIB, per_10min=-30 * MIB)
    assert flatness(falling, "sidecar", "rss_bytes", 300, []).verdict == FLAT


def test_a_stub_replaced_at_another_level_is_judged_by_its_own_growth():
    # The first stub sits at 600 MiB; its replacement, born at 700 s, settles at 450 MiB: a step down that a
    # single line through both would read as a fall, and a step up as growth. Neither is a leak.
    first = _series("lora_adapter_0_0", 100, 0, 600, 600 * MIB)
    second = _series("lora_adapter_0_0", 200, 700, 1800, 450 * MIB, born_s=700)
    for samples in (first + second, [s for s in second] + [ProcSample(s.t_s, s.role, s.pid, s.age_s,
                                                                      s.rss_bytes // 2, s.fds, s.threads)
                                                           for s in first]):
        row = flatness(samples, "lora_adapter_0_0", "rss_bytes", 300, [Window(600, 650, 655)])
        assert row.verdict == FLAT and row.processes == 2, row
        assert abs(row.slope_per_10min) < 0.5 * MIB


def test_samples_of_young_processes_and_recovery_windows_do_not_count():
    # Growth only while a fresh process loads (its first 5 minutes) and inside a recovery window.
    samples = _series("lora_adapter_0_0", 1, 0, 1800, 500 * MIB)
    loading = [ProcSample(t, "lora_adapter_0_0", 2, t - 900, int(100 * MIB + (t - 900) * MIB), 20, 10)
               for t in range(900, 1200, 5)]
    window = Window(880, 1000, 1005)
    in_window = [ProcSample(t, "tritonserver", 9, 2000, 2000 * MIB, 400, 400) for t in range(885, 1000, 5)]
    steady = _series("tritonserver", 9, 0, 1800, 300 * MIB)
    assert flatness(samples + loading, "lora_adapter_0_0", "rss_bytes", 300, [window]).verdict == FLAT
    row = flatness(steady + in_window, "tritonserver", "rss_bytes", 300, [window])
    assert row.verdict == FLAT and row.max_after == 2000 * MIB


def test_too_few_settled_samples_is_said_so():
    short = _series("bench", 5, 0, 340, 90 * MIB)  # 40 s after the settle time
    row = flatness(short, "bench", "threads", 300, [])
    assert row.verdict == NO_DATA and row.slope_per_10min is None and row.at_settle is not None
    assert flatness([], "bench", "rss_bytes", 300, []).verdict == NO_DATA


def test_thread_and_file_tolerances_are_absolute():
    threads = _series("tritonserver", 9, 0, 1800, 120, per_10min=1.0)
    assert flatness(threads, "tritonserver", "threads", 300, []).verdict == FLAT
    threads = _series("tritonserver", 9, 0, 1800, 120, per_10min=3.0)
    assert flatness(threads, "tritonserver", "threads", 300, []).verdict == GROWING
    assert Tolerance(0.02, 8 * MIB).allowed(1000 * MIB) == pytest.approx(20 * MIB)


def test_pooled_slope_has_one_intercept_per_process():
    assert pooled_slope({1: [(0, 0), (10, 10)], 2: [(20, 100), (30, 110)]}) == pytest.approx(1.0)
    assert pooled_slope({1: [(5, 3)]}) is None


# ------------------------------------------------------------------------------------ recovery windows
def _record(kind="planned", start=0.0, end=1.0, outcome=OK, **kw):
    return RequestRecord(kind=kind, start_s=start, end_s=end, outcome=outcome, **kw)


def test_failures_overlapping_a_window_are_outage_failures_and_others_are_lost():
    window = Window.after_kill(100.0, 118.0, grace_s=5.0, run_end_s=360.0)
    assert window.end_s == 123.0
    records = [
        _record(start=90, end=104, outcome=ERROR, error="Stub process 'lora_adapter_0_0' is not healthy."),  # in flight
        _record(start=110, end=110.2, outcome=ERROR, error="unavailable"),        # during the reload
        _record(start=121, end=121.5, outcome=ERROR, error="late"),               # within the grace
        _record(start=124, end=125, outcome=ERROR, error="after the window"),     # lost
        _record(start=10, end=130, outcome=HUNG),                                 # overlaps: not lost
        _record(start=200, end=320, outcome=HUNG),                                # lost
        _record(kind="cancel", start=50, end=51, outcome=CANCELLED),
        _record(kind="direct", start=60, end=61, outcome=OK),
    ]
    result = account(records, [window], {})
    assert [r.start_s for r in result.lost] == [124, 200]
    assert len(result.outage_failures) == 4
    assert result.cancelled == 1 and result.ok == {"direct": 1}
    assert result.sent == {"planned": 6, "cancel": 1, "direct": 1} and result.good_sent == 8


def test_a_window_that_never_closed_runs_to_the_end():
    window = Window.after_kill(300.0, None, grace_s=5.0, run_end_s=360.0)
    assert window.end_s == 360.0
    assert not account([_record(start=340, end=341, outcome=ERROR)], [window], {}).lost


# ------------------------------------------------------------------------------------- bad requests
HTTP_KIND = BadKind("max_tokens 0", "http", "INVALID_ARG", "max_tokens")
GRPC_KIND = BadKind("tenant of 100,000 bytes", "grpc", "INVALID_ARG", "tenant_id' is not a valid name", "t" * 80)


def test_a_bad_request_must_get_its_class_and_a_clear_message():
    def bad(kind, **kw):
        return _record(kind="bad", bad_kind=kind.name, **kw)

    assert judge_bad(HTTP_KIND, bad(HTTP_KIND, outcome=ERROR, status=400,
                                    error="input 'max_tokens'=0 is out of range: use 1 to 512")) == ANSWERED
    assert judge_bad(HTTP_KIND, bad(HTTP_KIND, outcome=ERROR, status=500, error="max_tokens")) == WRONG_CLASS
    assert judge_bad(HTTP_KIND, bad(HTTP_KIND, outcome=ERROR, status=400, error="internal error")) == UNCLEAR
    assert judge_bad(HTTP_KIND, bad(HTTP_KIND, outcome=OK)) == SUCCEEDED
    assert judge_bad(HTTP_KIND, bad(HTTP_KIND, outcome=HUNG)) == HUNG
    # Over a gRPC stream there is no status: the message that only this error holds tells the class.
    assert judge_bad(GRPC_KIND, bad(GRPC_KIND, outcome=ERROR, status=None,
                                    error="input 'tenant_id' is not a valid name: use 1 to 64 ...")) == ANSWERED
    assert judge_bad(GRPC_KIND, bad(GRPC_KIND, outcome=ERROR,
                                    error="input 'tenant_id' is not a valid name: " + "t" * 200)) == ECHOED
    assert judge_bad(GRPC_KIND, bad(GRPC_KIND, outcome=ERROR, error="Stub process is not healthy")) == UNCLEAR


def test_bad_requests_are_judged_outside_windows_only():
    kinds = {HTTP_KIND.name: HTTP_KIND}
    window = Window(100, 110, 115)
    records = [
        _record(kind="bad", bad_kind=HTTP_KIND.name, start=105, end=106, outcome=ERROR, status=500, error="x"),
        _record(kind="bad", bad_kind=HTTP_KIND.name, start=200, end=201, outcome=OK),
        _record(kind="bad", bad_kind=HTTP_KIND.name, start=300, end=301, outcome=ERROR, status=400,
                error="max_tokens out of range"),
    ]
    result = account(records, [window], kinds)
    assert result.bad_in_window == 1 and result.bad_answered == {HTTP_KIND.name: 1}
    assert [(r.start_s, verdict) for r, verdict in result.bad_failed] == [(200, SUCCEEDED)]
    assert not result.lost  # bad requests are never lost requests


def test_the_bad_mix_has_distinct_kinds_of_known_classes_and_no_denormal():
    bad = _bad_requests()
    names = [kind.name for kind, _, _ in bad]
    assert len(names) == len(set(names)) >= 10
    for kind, payload, params in bad:
        assert kind.code in HTTP_STATUS and kind.transport in ("http", "grpc", "direct")
        assert kind.transport != "direct" or isinstance(payload, list)
        temperature = params.get("temperature")
        assert temperature is None or abs(temperature) >= 1.0  # clearly out of range, never a denormal
        if kind.secret:
            assert kind.secret in repr(payload) + repr(params)  # what must not be echoed is in the request


# -------------------------------------------------------------------------------------------- misc
def test_kill_times_fall_strictly_inside_the_run():
    def settings(duration, every):
        return SoakSettings(duration, every, 4, 0.05, 0.05, 0.1, 300, 5, 5, 16, 0)

    assert settings(1800, 600).kill_times() == [600, 1200]
    assert settings(360, 180).kill_times() == [180]
    assert settings(300, 600).kill_times() == []


def test_process_roles_come_from_the_command_line():
    stub = ["/tmp/x/backends/python/triton_python_backend_stub", "/repo/model_repository/lora_adapter/1/model.py",
            "triton_python_backend_shm_region_4a", "1048576", "1048576", "4242", "/usr/lib", "140", "lora_adapter_0_0",
            "DEFAULT"]
    assert process_role(stub) == "lora_adapter_0_0"
    assert process_role(stub[:2]) == "lora_adapter"
    assert process_role(["/opt/pytriton/tritonserver/bin/tritonserver", "--model-repository=/r"]) == "tritonserver"
    assert process_role(["/usr/bin/python3", "-m", "pytest"]) is None
    assert process_role([]) is None


def test_the_summary_states_the_verdicts():
    settings = SoakSettings(360, 180, 4, 0.05, 0.05, 0.1, 300, 5, 5, 16, 0)
    window = Window(180, 200, 205, 182)
    records = [_record(start=10, end=11), _record(start=250, end=251, outcome=ERROR, error="boom")]
    accounting = account(records, [window], {})
    rows = [flatness(_series("tritonserver", 9, 0, 340, 300 * MIB), "tritonserver", "rss_bytes", 300, [window])]
    text = format_summary(settings, accounting, [window], rows, {"running": 0.0, "waiting": 0.0}, [], [], [],
                          360.0, {})
    assert "Lost requests outside the recovery windows: 1" in text and "not enough data" in text
    assert "| 180.0 | 2.0 | 20.0 | 25.0 |" in text
    failures = verdict_failures(accounting, rows, {"running": 0.0, "waiting": math.nan}, [], [])
    assert failures[0].startswith("1 requests lost") and "held" in failures[1]


def test_a_kind_may_state_the_status_triton_answers_for_its_class():
    kind = BadKind("unknown adapter (HTTP)", "http", "NOT_FOUND", "unknown adapter", http_status=400)
    record = _record(kind="bad", bad_kind=kind.name, outcome=ERROR, status=400,
                     error="in ensemble 'ensemble', unknown adapter 'x': send the name of an adapter")
    assert judge_bad(kind, record) == ANSWERED
    assert judge_bad(BadKind(kind.name, "http", "NOT_FOUND", "unknown adapter"), record) == WRONG_CLASS
