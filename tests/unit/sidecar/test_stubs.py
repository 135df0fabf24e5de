"""A stub that exits or stops is seen in /proc and reloaded at once, not after a probe round."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from warmup_tools.sidecar.config import SidecarConfig
from warmup_tools.sidecar.monitor import Monitor
from warmup_tools.sidecar.stubs import StubFault, StubScanner

from .test_monitor import FakeTriton

MODELS = ("tokenizer_cache", "embedding_cache", "lora_adapter", "ensemble")


@pytest.fixture
def stub(tmp_path):
    """A child of this process laid out like a Python backend stub of lora_adapter (its argv, its model.py)."""
    model_py = tmp_path / "lora_adapter" / "1" / "model.py"
    model_py.parent.mkdir(parents=True)
    model_py.write_text("import time\ntime.sleep(600)\n")
    # NOTE: the stub's command line as the Python backend (r24.10, stub_launcher.cc) writes it: model.py, shm
    # region, default and growth sizes, parent pid, Python library dir, IPC handle, instance, runtime dir.
    argv = [str(tmp_path / "triton_python_backend_stub"), str(model_py), "triton_python_backend_shm_region_1",
            "1048576", "1048576", str(os.getpid()), "/usr/lib/python3.11", "2544", "lora_adapter_0_0",
            str(tmp_path / "backends" / "python")]
    proc = subprocess.Popen(argv, executable=sys.executable)
    yield proc
    proc.kill()
    proc.wait()


def test_the_scanner_names_the_model_of_a_stopped_and_of_an_exited_stub(stub):
    scanner = StubScanner(os.getpid(), MODELS)
    assert scanner.scan() == {}  # alive and running
    os.kill(stub.pid, signal.SIGSTOP)
    os.waitpid(stub.pid, os.WUNTRACED)  # returns once it is stopped
    stopped = scanner.scan()
    assert stopped == {"lora_adapter": StubFault(stub.pid, "lora_adapter_0_0", "stopped by a signal")}
    assert stopped["lora_adapter"].reason == f"its Python backend stub (pid {stub.pid}) stopped by a signal"
    assert scanner.scan() == {}  # reported once: the reload it starts is the monitor's to retry
    os.kill(stub.pid, signal.SIGCONT)
    os.waitpid(stub.pid, os.WCONTINUED)
    assert scanner.scan() == {}
    os.kill(stub.pid, signal.SIGKILL)
    os.waitid(os.P_PID, stub.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped: a zombie, as Triton leaves it
    exited = {"lora_adapter": StubFault(stub.pid, "lora_adapter_0_0", "exited")}
    assert scanner.scan() == exited
    # Triton reaps it only when the old instance goes, which a request in flight on it can put off: the
    # zombie left after the reload must not start another one.
    assert scanner.scan() == {} and StubScanner(os.getpid(), MODELS).scan() == {}
    assert StubScanner(os.getpid() + 10**6, MODELS).scan() == {}  # another server's children are not ours
    assert StubScanner(lambda: None, MODELS).scan() == {}  # no server running (a restart under way)


def _stub_child(tmp_path, name):
    """A stub-like child (argv as in the fixture above, ``name`` its instance argument) that exits with the code
    written to its stdin: ``(process, pid)``."""
    model_py = tmp_path / "lora_adapter" / "1" / "model.py"
    model_py.parent.mkdir(parents=True, exist_ok=True)
    model_py.write_text("import sys\nsys.exit(int(sys.stdin.readline()))\n")
    argv = [str(tmp_path / "triton_python_backend_stub"), str(model_py), "triton_python_backend_shm_region_2",
            "1048576", "1048576", str(os.getpid()), "/usr/lib/python3.11", "2545", name,
            str(tmp_path / "backends" / "python")]
    return subprocess.Popen(argv, executable=sys.executable, stdin=subprocess.PIPE, text=True)


@pytest.mark.parametrize(("code", "faulted"), [(0, False), (1, True)])
def test_a_stub_that_triton_finalized_is_no_death(tmp_path, code, faulted):
    # NOTE: Triton 2.51 finalizes a stub at an unload (and the auto-complete stub at each load): it returns 0,
    # and Triton reaps it at once, but a scan can fall in between. A stub whose parent is gone exits 1.
    proc = _stub_child(tmp_path, "lora_adapter_0_0")
    try:
        scanner = StubScanner(os.getpid(), MODELS)
        assert scanner.scan() == {}  # alive: known from now on
        proc.stdin.write(f"{code}\n")
        proc.stdin.flush()
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped yet
        expected = {"lora_adapter": StubFault(proc.pid, "lora_adapter_0_0", "exited")} if faulted else {}
        assert scanner.scan() == expected
        assert scanner.scan() == {}
    finally:
        proc.kill()
        proc.wait()


def test_the_auto_complete_stub_is_not_watched(tmp_path):
    # The stub Triton runs for a model's auto-complete is named after the model (stub_launcher.cc): it never
    # serves, whatever ends it (killed, here: what Triton does when the auto-complete fails).
    proc = _stub_child(tmp_path, "lora_adapter")
    try:
        scanner = StubScanner(os.getpid(), MODELS)
        assert scanner.scan() == {}
        proc.kill()
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        assert scanner.scan() == {}
    finally:
        proc.kill()
        proc.wait()


def test_a_stub_fault_reloads_the_model_before_any_probe():
    triton = FakeTriton()
    probes = []
    faults: dict[str, StubFault] = {}
    monitor = Monitor(SidecarConfig(), lambda m: probes.append(m) or triton.probe(m), triton.server_ready, triton,
                      stub_faults=lambda: dict(faults))
    monitor.run_once()
    assert monitor.readiness().ready and len(probes) == len(MODELS)
    faults["lora_adapter"] = StubFault(7, "lora_adapter_0_0", "exited")
    probes.clear()
    monitor.run_once()
    assert triton.calls[0] == ("reload", "lora_adapter") and probes == []
    assert not monitor.readiness().ready  # until a probe passes after the reload


def test_the_monitor_does_not_wait_for_the_next_round_to_reload_a_dead_stub():
    triton = FakeTriton()
    reloaded = threading.Event()
    real_reload = triton.reload
    triton.reload = lambda model, timeout_s=None: (real_reload(model, timeout_s), reloaded.set())
    faults: dict[str, StubFault] = {}
    # NOTE: an hour between probe rounds: only the stub watch can start the reload within the test's bound.
    monitor = Monitor(SidecarConfig(probe_interval_s=3600, stub_check_interval_s=0.01), triton.probe,
                      triton.server_ready, triton, stub_faults=lambda: dict(faults))
    monitor.start()
    try:
        faults["lora_adapter"] = StubFault(7, "lora_adapter_0_0", "exited")
        assert reloaded.wait(60)
        assert ("reload", "lora_adapter") in triton.calls
    finally:
        monitor.stop()
