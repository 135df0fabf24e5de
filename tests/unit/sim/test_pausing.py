"""Pausing a server's process trees while bench peer measures another."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from warmup_tools.sim.bench.support.pausing import ServerURL, paused, process_tree


def state(pid: int) -> str:
    """The process's state letter from /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_paused_tree_is_stopped_inside_and_continued_after_children_included():
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
           "print('ok', flush=True); time.sleep(60)"
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "ok"  # the child is started
        tree = process_tree(parent.pid)
        assert tree[0] == parent.pid and len(tree) == 2
        with paused([parent.pid]) as stopped:
            assert sorted(stopped) == sorted(tree)
            assert {state(p) for p in tree} == {"T"}
        assert "T" not in {state(p) for p in tree}
    finally:
        for pid in reversed(process_tree(parent.pid)):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        parent.wait()


def test_the_tree_is_continued_when_the_measurement_fails_inside():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        try:
            with paused([sleeper.pid]):
                raise RuntimeError("a phase failed")
        except RuntimeError:
            pass
        assert state(sleeper.pid) != "T"
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_process_that_is_gone_is_left_out():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert process_tree(gone.pid) == []
    with paused([gone.pid]) as stopped:
        assert stopped == []


def test_a_server_url_is_its_url_and_carries_its_processes():
    url = ServerURL("http://127.0.0.1:9", [12, 0, 34])
    assert url == "http://127.0.0.1:9" and url.pids == (12, 34)
