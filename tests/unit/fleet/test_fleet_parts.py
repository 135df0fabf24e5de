"""The fleet's parts without a server: its settings, a child process that leaves nothing behind, the CLI's
settings and the replica's command line."""

from __future__ import annotations

import signal
import sys

import pytest

from warmup_tools.common.errors import ConfigError
from warmup_tools.fleet.process import Child, alive, descendants, started
from warmup_tools.fleet.replica import Replica
from warmup_tools.fleet.settings import ROUTER_POLICIES, FleetSettings
from warmup_tools.ops.cli import _parser, fleet_settings


def test_settings_refuse_what_smg_or_the_machine_cannot_do():
    assert FleetSettings().policy == "cache_aware" and "round_robin" in ROUTER_POLICIES
    for bad in ({"replicas": 0}, {"policy": "fastest"}, {"port": 70000}, {"port": 30001, "prometheus_port": 30001},
                {"warm_timeout_s": 0}):
        with pytest.raises(ConfigError):
            FleetSettings(**bad)


def test_flags_and_environment_reach_the_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("WARMUP_FLEET_LM_THREADS", "2")
    args = _parser().parse_args(["fleet", "--replicas", "3", "--policy", "prefix_hash", "--work-dir", str(tmp_path)])
    settings = fleet_settings(args)
    assert (settings.replicas, settings.policy, settings.lm_threads, settings.work_dir) == (3, "prefix_hash", 2,
                                                                                            tmp_path)


def test_a_child_and_everything_it_started_are_gone_after_stop(tmp_path):
    # A shell that starts a grandchild ignoring SIGTERM, then ignores SIGTERM itself: stop() must kill both.
    script = "trap '' TERM; sleep 600 & echo started; wait"
    child = Child("test", ["/bin/sh", "-c", script], {"PATH": "/usr/bin:/bin"}, tmp_path / "child.log")
    child.start()
    while "started" not in child.log_path.read_text():
        assert not child.exited()
    tree = list(descendants(child.pid))
    assert tree, "the grandchild is visible in /proc"
    assert child.stop(signal.SIGTERM, timeout_s=0.2) is False  # it ignored SIGTERM, so it was killed
    assert child.exited() and not any(alive(pid) for pid in tree)


def test_a_replica_is_the_sidecar_command_with_its_own_name_and_the_shared_folders(tmp_path):
    settings = FleetSettings(lm_threads=1)
    replica = Replica("r7", settings, tmp_path, tmp_path / "control", tmp_path / "snapshots")
    argv = replica.process.argv
    assert argv[:4] == [sys.executable, "-m", "warmup_tools", "sidecar"]
    args = _parser().parse_args(argv[3:])
    assert args.replica_name == "r7" and args.control_dir == tmp_path / "control"
    assert args.snapshot_dir == tmp_path / "snapshots" and replica.url.endswith(f":{args.front_port}")
    assert replica.process.env["WARMUP_LM_THREADS"] == "1"
    assert replica.process.env["WARMUP_FRONT_DRAIN_GRACE_S"] == str(settings.drain_grace_s)
    cold = Replica("r8", settings, tmp_path, tmp_path / "control", None, warm_gate=False)
    cold_args = _parser().parse_args(cold.process.argv[3:])
    assert cold_args.snapshot_dir is None and cold_args.coverage_threshold == 0
    assert args.fleet_log_dir is None and args.sidecar_config is None
    logged = Replica("r9", settings, tmp_path, tmp_path / "control", None, request_log_dir=tmp_path / "requests")
    assert _parser().parse_args(logged.process.argv[3:]).fleet_log_dir == tmp_path / "requests"


def test_the_fleet_s_sidecar_settings_reach_every_replica_s_sidecar(tmp_path):
    from warmup_tools.ops.cli import sidecar_config

    settings_file = tmp_path / "sidecar.json"
    settings_file.write_text('{"canary_judge": false, "probe_interval_s": 1.5}')
    replica = Replica("r1", FleetSettings(sidecar_config=settings_file), tmp_path, tmp_path / "control", None,
                      request_log_dir=tmp_path / "requests")
    config = sidecar_config(_parser().parse_args(replica.process.argv[3:]))
    assert (config.canary_judge, config.probe_interval_s) == (False, 1.5)
    assert config.fleet_log_dir == tmp_path / "requests"  # the fleet's folders are its own flags


def test_a_process_is_known_by_its_pid_and_start_time(tmp_path):
    """What stop() checks before a SIGKILL: a pid whose process exited and whose number came back to another
    program has another start time, so the other program is left alone."""
    import os
    import subprocess

    me = started(os.getpid())
    assert isinstance(me, int) and started(os.getpid()) == me
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert started(child.pid) is None  # gone (reaped): nothing of it to kill
