"""A child process of the fleet (a replica, the router): started in its own session so that it dies with the
fleet, its output in a log file, stopped by a signal with a bounded wait, then its whole tree killed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from warmup_tools.server.process import _die_with_parent

# NOTE: PR_SET_PDEATHSIG fires when the thread that forked the child exits: every child of the fleet is
# forked from this one long-lived thread, so a child started from a short-lived thread outlives nothing.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fleet-spawner")


class Child:
    """One command run in the background; :meth:`stop` leaves nothing of it alive."""

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str], log_path: Path,
                 cwd: Path | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = dict(env)
        self.log_path = log_path
        self.cwd = cwd
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab", buffering=0) as log:
            self._process = _SPAWNER.submit(
                subprocess.Popen, self.argv, cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent).result()

    def exited(self) -> bool:
        return self._process is None or self._process.poll() is not None

    @property
    def returncode(self) -> int | None:
        return self._process.poll() if self._process is not None else None

    def send(self, sig: signal.Signals) -> None:
        if self._process is not None and self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._process.send_signal(sig)

    def wait(self, timeout_s: float) -> bool:
        """Whether it exited within ``timeout_s``."""
        if self._process is None:
            return True
        try:
            self._process.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 60.0) -> bool:
        """``sig``, a bounded wait, then SIGKILL to every process of its tree: whether it exited by itself."""
        if self._process is None:
            return True
        # NOTE: each process is known by its pid and its start time: a pid that exited during the wait may
        # belong to another program by the time the SIGKILLs go out (pids wrap around on a busy host).
        tree = {pid: started(pid) for pid in descendants(self._process.pid)}
        self.send(sig)
        clean = self.wait(timeout_s)
        tree.update({pid: started(pid) for pid in descendants(self._process.pid) if pid not in tree})
        with contextlib.suppress(ProcessLookupError, PermissionError):
            self._process.kill()  # NOTE: its pid stays ours until it is waited for
        for pid, start in tree.items():
            if start is not None and started(pid) == start:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        self._process.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(alive(pid) and started(pid) == start for pid, start in tree.items()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return clean

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def descendants(pid: int) -> Iterator[int]:
    """Every process below ``pid`` now (children first), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    queue = [pid]
    while queue:
        for child in children.get(queue.pop(0), ()):
            yield child
            queue.append(child)


def started(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, /proc/<pid>/stat field 22); None when it is gone."""
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
