"""The command line: benchmark flags from each benchmark's run(), the plan commands, the sidecar's settings."""

from __future__ import annotations

import importlib
import inspect

import pytest

from warmup_tools.ops.cli import _parser, bench_options
from warmup_tools.ops.cli.bench import BENCHES


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_every_bench_flag_binds_to_its_run_function(name):
    module = importlib.import_module(f"warmup_tools.sim.bench.{name.replace('-', '_')}")
    parser = _parser()
    bench = parser._subparsers._group_actions[0].choices["bench"]
    sub = bench._subparsers._group_actions[0].choices[name]
    flags = [a for a in sub._actions if a.dest not in ("help", "assets_dir")]
    assert flags, "each benchmark has flags of its own"
    given = []
    for action in flags:  # every flag given: each reaches run() as the keyword of that name
        if action.nargs == 0:
            given.append(action.option_strings[0])
        else:
            value = action.choices[0] if action.choices else "1" if action.metavar in ("N", "X", "A,B") else "x"
            given += [action.option_strings[0], value]
    args = parser.parse_args(["bench", name, *given])
    options = bench_options(args)
    assert set(options) == {a.dest for a in flags}
    inspect.signature(module.run).bind(args.assets_dir, **options)
    assert bench_options(parser.parse_args(["bench", name])) == {}, "run()'s own defaults apply"


def test_a_server_command_line_imports_no_benchmark_and_no_torch():
    """The sidecar and the front parse their command line with the same parser as ``bench``: only a benchmark the
    command line names is imported for its flags (some import torch, about 200 MB a process)."""
    import subprocess
    import sys

    code = ("import sys; from warmup_tools.ops.cli import parser; p = parser(['sidecar', '--help']); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('warmup_tools.sim.bench.')))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"
    code = ("import sys; from warmup_tools.ops.cli import parser; p = parser(['bench', 'fidelity']); "
            "print(sorted(m for m in sys.modules if m.startswith('warmup_tools.sim.bench.') and m.count('.') == 3))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "['warmup_tools.sim.bench.fidelity', " \
        "'warmup_tools.sim.bench.support']", "the benchmark named and the benchmarks' support package, no other"


def test_duration_flags_parse_and_refuse_nonsense(capsys):
    from warmup_tools.common.settings import parse_duration

    assert [parse_duration(t) for t in ("90s", "30m", "6h", "2d", "120")] == [90, 1800, 21600, 172800, 120]
    for bad in ("", "h", "-1h", "0", "six hours", "nanh"):
        with pytest.raises(ValueError, match="not a duration"):
            parse_duration(bad)
    with pytest.raises(SystemExit):
        _parser().parse_args(["bench", "soak", "--duration", "six hours"])
    assert "'six hours' is not a duration such as 30m, 6h or 2d" in capsys.readouterr().err


def test_plan_over_a_window_of_rotated_logs_against_the_previous_plan(tmp_path, demo_assets, monkeypatch, capsys):
    """``plan --since`` reads only the window, from a folder of rotated logs; ``--previous`` reports changes."""
    from warmup_tools.common.jsonl import write_json_lines
    from warmup_tools.common.plan import Plan
    from warmup_tools.common.records import RequestRecord
    from warmup_tools.ops.cli import main

    monkeypatch.setenv("WARMUP_ASSETS_DIR", str(demo_assets.root))
    now = 1_700_000_000.0
    old = "I want you to act as a travel guide for a small coastal town, suggesting walks and museums.\n"
    new = "I want you to act as a patient maths tutor who explains every step of a proof with an example.\n"

    def records(prompt, start, n):
        return [RequestRecord(ts=start + i, tenant="acme", prompt=prompt + f"Question number {i} please.").to_json()
                for i in range(n)]

    logs = tmp_path / "logs"
    logs.mkdir()
    write_json_lines(logs / "requests.jsonl.1", records(old, now - 2 * 86400, 20))
    write_json_lines(logs / "requests.jsonl", records(new, now - 3600, 20))
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    assert main(["plan", str(logs), "--out", str(first), "--no-progress", "--now", str(now)]) == 0
    assert main(["plan", str(logs), "--out", str(second), "--no-progress", "--now", str(now), "--since", "6h",
                 "--previous", str(first)]) == 0
    out = capsys.readouterr()
    assert "20 of 40 records in the last 6 h" in out.err
    texts = lambda path: sorted("tutor" in i["text"] for i in Plan.load(path).items)  # noqa: E731
    assert texts(first) == [False, True] and texts(second) == [True]
    changes = Plan.load(second).summary["changes"]
    assert (changes["kept"], changes["dropped"]) == (1, 1) and "travel guide" in changes["dropped_items"][0]["text"]
    assert f"against plan {Plan.load(first).plan_id}: 0 items added, 1 kept, 1 dropped" in out.out


def test_sidecar_flags_and_config_file_feed_one_config(tmp_path):
    import json

    from warmup_tools.common.errors import ConfigError
    from warmup_tools.ops.cli import sidecar_config

    file = tmp_path / "sidecar.json"
    file.write_text(json.dumps({"probe_interval_s": 5, "failures_to_recover": 4}))
    args = _parser().parse_args(["sidecar", "--sidecar-config", str(file), "--sidecar-port", "9090",
                                 "--probe-interval-s", "0.5"])
    config = sidecar_config(args)
    assert (config.port, config.probe_interval_s, config.failures_to_recover) == (9090, 0.5, 4)
    file.write_text(json.dumps({"probe_intervall_s": 5}))
    with pytest.raises(ConfigError, match="unknown key"):
        sidecar_config(args)


def test_plan_help_names_every_plan_action(capsys):
    from warmup_tools.ops.cli import PLAN_ACTIONS

    with pytest.raises(SystemExit):
        _parser().parse_args(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for action in PLAN_ACTIONS:
        assert f"plan {action}" in text, action


@pytest.mark.parametrize("name", [".", "..", "r1/..", "r1."])
def test_a_replica_name_that_is_no_single_safe_path_component_is_refused_where_it_enters(tmp_path, capsys, name):
    from warmup_tools.ops.cli import main

    plan = tmp_path / "missing-plan.json"  # the name is refused before anything else is read
    assert main(["plan", "canary", str(plan), "--replica", name, "--control-dir", str(tmp_path)]) == 2
    assert f"the replica name {name!r} cannot name a folder or file" in capsys.readouterr().err
    assert main(["sidecar", "--replica-name", name, "--control-dir", str(tmp_path)]) == 2
    assert f"the replica name {name!r} cannot name a folder or file" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_profile_fit_writes_a_profile_the_simulated_engine_loads(tmp_path, demo_assets, capsys):
    from warmup_tools.lora_adapter.profile import load_profile
    from warmup_tools.ops.cli import main

    out = tmp_path / "fitted.json"
    assert main(["profile-fit", "--assets-dir", str(demo_assets.root), "--out", str(out), "--repeats", "1",
                 "--name", "test-fit", "--hardware", "this machine"]) == 0
    profile = load_profile(out)
    assert (profile.name, profile.hardware) == ("test-fit", "this machine")
    assert profile.fit["command"] == "python -m warmup_tools profile-fit --threads 1 --repeats 1"
    assert profile.fit["prefill_points"] == profile.fit["decode_points"] == 15
    assert f"wrote {out}" in capsys.readouterr().out


def test_a_benchmark_stopped_by_sigterm_unwinds_as_on_ctrl_c():
    import os
    import signal

    from warmup_tools.ops.cli.bench import stop_on_sigterm

    previous = signal.getsignal(signal.SIGTERM)
    unwound = []
    try:
        stop_on_sigterm()
        try:
            try:
                os.kill(os.getpid(), signal.SIGTERM)  # handled before the next statement of this thread
                unwound.append("not interrupted")
            finally:
                unwound.append("finally")
        except KeyboardInterrupt as stopped:
            unwound.append(str(stopped))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert unwound == ["finally", f"signal {int(signal.SIGTERM)}"]
