"""The running parts of ``bench soak``: the stack (``warmup_tools sidecar`` in a child process), its
processes and their samples, the stub's killer and the ``/ready`` watch."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, TextIO

from warmup_tools.common.errors import ServerError
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.server.process import free_port
from warmup_tools.sim.bench.support.servers import ready_status
from warmup_tools.sim.bench.support.soak_checks import ProcSample, SoakSettings, Window, process_role

#: The fourth adapter, built for the run and made live through the control folder.
EXTRA_ADAPTER = "billing"
#: Deadlines of the stack's start and of one recovery.
START_TIMEOUT_S, RECOVERY_TIMEOUT_S = 1200.0, 900.0


# ------------------------------------------------------------------------------------------- stack
class Stack:
    """``python -m warmup_tools sidecar`` in a child process on free ports, in its own folders.

    Stopped with SIGINT (the command stops the sidecar, then tritonserver: SIGINT, a bounded wait, SIGKILL),
    then whatever is left of the tree is SIGKILLed: nothing outlives :meth:`stop`."""

    def __init__(self, assets_dir: Path, work: Path) -> None:
        self.work = work
        self.control_dir = work / "control"
        self.request_log_dir = work / "request_log"
        self.server_log = work / "tritonserver.log"
        self.sidecar_log = work / "sidecar.log"
        self.http_port, self.grpc_port, self.metrics_port, self.sidecar_port = (free_port() for _ in range(4))
        self.assets_dir = assets_dir
        self._process: subprocess.Popen[bytes] | None = None
        self._log = None
        #: Every process of the stack seen while it ran (pid: role), checked after the stop.
        self.seen: dict[int, str] = {}

    http_url = property(lambda self: f"127.0.0.1:{self.http_port}")
    grpc_url = property(lambda self: f"127.0.0.1:{self.grpc_port}")
    sidecar_url = property(lambda self: f"http://127.0.0.1:{self.sidecar_port}")
    metrics_url = property(lambda self: f"http://127.0.0.1:{self.metrics_port}/metrics")

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> None:
        from warmup_tools.server.process import _die_with_parent

        for folder in (self.control_dir, self.request_log_dir):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "warmup_tools", "sidecar",
               "--model-repository", str(REPO_ROOT / "model_repository"), "--assets-dir", str(self.assets_dir),
               "--control-dir", str(self.control_dir), "--log-file", str(self.server_log),
               "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
               "--metrics-port", str(self.metrics_port), "--sidecar-port", str(self.sidecar_port),
               "--ready-timeout-s", str(START_TIMEOUT_S), "--no-front"]  # the stack the soak measured before the front
        # NOTE: no WARMUP_* setting of the caller's environment reaches the stack (a snapshot folder or a
        # Redis URL there would change what is measured); the request log goes to the run's own folder.
        env = {k: v for k, v in os.environ.items() if not k.startswith("WARMUP_")}
        env["WARMUP_REQUEST_LOG_DIR"] = str(self.request_log_dir)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
        self._log = open(self.sidecar_log, "ab", buffering=0)
        self._process = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_die_with_parent)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while ready_status(self.sidecar_url) != 200:
            if self._process is None or self._process.poll() is not None:
                raise ServerError(f"`warmup_tools sidecar` exited before /ready said 200; its output:\n"
                                  f"{_tail(self.sidecar_log)}\nserver log:\n{_tail(self.server_log)}")
            if time.monotonic() > deadline:
                raise ServerError(f"/ready did not answer 200 within {timeout_s:.0f}s:\n{_tail(self.sidecar_log)}")
            time.sleep(0.5)

    def processes(self) -> dict[int, str]:
        """``pid: role`` of the sidecar process, tritonserver and each Python backend stub now."""
        if self.pid is None:
            return {}
        children: dict[int, list[tuple[int, list[str]]]] = {}
        for pid, ppid, argv in _proc_table():
            children.setdefault(ppid, []).append((pid, argv))
        found = {self.pid: "sidecar"}
        queue = [self.pid]
        while queue:
            parent = queue.pop()
            for pid, argv in children.get(parent, ()):
                role = process_role(argv)
                if role is not None:
                    found[pid] = role
                    queue.append(pid)
        self.seen.update(found)
        return found

    def stop(self, timeout_s: float = 90.0) -> list[str]:
        """Stop the stack; returns the processes of it still alive afterwards (should be none)."""
        process = self._process
        if process is None:
            return []
        try:
            self.processes()
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=10)
            # NOTE: tritonserver leads its own process group (its stubs are in it): kill what is left of it.
            for pid, role in self.seen.items():
                if role == "tritonserver":
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None
        deadline = time.monotonic() + 10
        while True:
            alive = [f"{role} (pid {pid})" for pid, role in self.seen.items() if _alive(pid)]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.2)


def _proc_table() -> Iterator[tuple[int, int, list[str]]]:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0") if a]
        except (OSError, IndexError, ValueError):
            continue
        yield int(entry.name), ppid, argv


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def serve_assets(demo_root: Path, work: Path, seed: int) -> Path:
    """An assets folder for the run: the demo LM and embedder, copies of the demo adapters, and the extra
    adapter built beside them (adapter folders must be real folders under the adapter root)."""
    from warmup_tools.demo.assets import build_extra_adapter

    root = work / "assets"
    (root / "adapters").mkdir(parents=True)
    (root / "lm").symlink_to((demo_root / "lm").resolve())
    (root / "embedder").symlink_to((demo_root / "embedder").resolve())
    for name in ("support", "legal", "sql"):
        shutil.copytree(demo_root / "adapters" / name, root / "adapters" / name)
    build_extra_adapter(root / "lm", root / "adapters" / EXTRA_ADAPTER, EXTRA_ADAPTER, seed)
    return root


# ----------------------------------------------------------------------------------------- sampling
def read_process(pid: int, t_s: float, role: str, uptime_s: float, ticks: int) -> ProcSample | None:
    """RSS (``VmRSS``), open files (``/proc/PID/fd``) and threads of one process; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        start_ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    try:
        rss = int(fields["VmRSS"].split()[0]) * 1024
        threads = int(fields["Threads"])
    except (KeyError, ValueError, IndexError):
        return None  # a zombie has no VmRSS
    return ProcSample(t_s, role, pid, max(0.0, uptime_s - start_ticks / ticks), rss, fds, threads)


class Sampler:
    """Samples every process of the stack and the bench every ``every_s`` on its own thread."""

    def __init__(self, stack: Stack, t0: float, every_s: float) -> None:
        self.stack, self.t0, self.every_s = stack, t0, every_s
        self.samples: list[ProcSample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        self._ticks = os.sysconf("SC_CLK_TCK")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def sample_once(self) -> None:
        t_s = time.monotonic() - self.t0
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        for pid, role in {**self.stack.processes(), os.getpid(): "bench"}.items():
            sample = read_process(pid, t_s, role, uptime, self._ticks)
            if sample is not None:
                self.samples.append(sample)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            self._stop.wait(self.every_s)


# ------------------------------------------------------------------------------------------ kills
class Killer:
    """SIGKILLs the ``lora_adapter`` stub at each kill time and records the recovery window."""

    def __init__(self, stack: Stack, t0: float, settings: SoakSettings, out: TextIO) -> None:
        self.stack, self.t0, self.settings, self.out = stack, t0, settings, out
        self.windows: list[Window] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-killer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(RECOVERY_TIMEOUT_S + 30)

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _wait_status(self, want: int, deadline_s: float) -> float | None:
        """Poll ``/ready`` every 0.1 s until it answers ``want``: the time it did, or None (stopped, deadline)."""
        while not self._stop.is_set() and self._now() < deadline_s:
            if ready_status(self.stack.sidecar_url) == want:
                return self._now()
            self._stop.wait(0.1)
        return None

    def _run(self) -> None:
        for kill_at in self.settings.kill_times():
            if self._stop.wait(max(0.0, kill_at - self._now())):
                return
            stubs = [pid for pid, role in self.stack.processes().items() if role.startswith("lora_adapter")]
            if not stubs:
                self.errors.append(f"no lora_adapter stub to kill at {kill_at:.0f} s")
                continue
            killed = self._now()
            for pid in stubs:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            not_ready = self._wait_status(503, killed + 120)
            ready = self._wait_status(200, killed + RECOVERY_TIMEOUT_S)
            window = Window.after_kill(killed, ready, self.settings.grace_s, self.settings.duration_s, not_ready)
            self.windows.append(window)
            recovered = f"/ready 200 again after {ready - killed:.1f} s" if ready is not None else "not recovered"
            self.out.write(f"[{killed:7.1f} s] killed lora_adapter stub {stubs}: {recovered}\n")
            self.out.flush()


class ReadyWatch:
    """Polls ``/ready`` every second: the seconds it was not 200, to tell unready time outside the kills."""

    def __init__(self, sidecar_url: str, t0: float) -> None:
        self.sidecar_url, self.t0 = sidecar_url, t0
        self.unready: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-ready", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            if ready_status(self.sidecar_url) != 200:
                self.unready.append(time.monotonic() - self.t0)
