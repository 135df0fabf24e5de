"""Servers paused while another one is measured: ``bench peer`` keeps every server up (so it can alternate them
phase by phase) but measures each alone on the cores, the others stopped with SIGSTOP (an idle server still
polls, keeps timers and threads, and on two cores that falls on the one measured).

A server is named by the roots of its process trees (:class:`ServerURL`'s ``pids``); :func:`paused` stops every
process of those trees and continues them on the way out, whatever happens inside."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Iterable, Iterator


class ServerURL(str):
    """A running server's URL (a ``str``), and the processes it runs as: the roots of their trees."""

    pids: tuple[int, ...]

    def __new__(cls, url: str, pids: Iterable[int]) -> ServerURL:
        made = super().__new__(cls, url)
        made.pids = tuple(int(p) for p in pids if p)
        return made


def process_tree(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """``pid`` and every descendant, parents before children (from ``/proc/<pid>/task/*/children``; a process that
    is gone meanwhile is left out)."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop(0)
        tasks = proc / str(current) / "task"
        try:
            children = [int(c) for task in tasks.iterdir()
                        for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
        out.append(current)
        todo.extend(c for c in children if c not in out)
    return out


#: The most :func:`paused` waits for a signalled process to be stopped.
STOP_WAIT_S = 10.0


def stopped_state(pid: int, proc: Path = Path("/proc")) -> bool:
    """Whether ``pid`` is stopped (or gone), from its ``/proc`` state."""
    try:
        return (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t", "Z", "X")
    except (OSError, IndexError):
        return True


@contextlib.contextmanager
def paused(roots: Iterable[int]) -> Iterator[list[int]]:
    """Every process of the trees of ``roots`` stopped (SIGSTOP) inside, continued (SIGCONT) on the way out; the
    processes stopped. It enters once each one is stopped (a signal is delivered when the process next runs), at
    most :data:`STOP_WAIT_S`."""
    stopped: list[int] = []
    try:
        for root in roots:
            for pid in process_tree(root):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
        deadline = time.monotonic() + STOP_WAIT_S
        while not all(stopped_state(pid) for pid in stopped) and time.monotonic() < deadline:
            time.sleep(0.01)
        yield stopped
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
