"""A dead or stopped Python backend stub, seen from ``/proc`` within a fraction of a second.

Triton never notices a stub that died while it was generating: a decoupled request already in the
stub's engine loop gets no final response at all (not from the unload or the reload either: see
docs/faults.md), and a new request finds out only after the backend's one-second health wait. The
sidecar runs beside tritonserver (same container, same process tree), so it can look at the stubs
themselves: each ``triton_python_backend_stub`` is a child of tritonserver whose command line names its
model's ``model.py`` and its instance. A stub that exited is a zombie (state ``Z``) until Triton reaps it
at unload; one stopped by a signal is in state ``T``. Either one is reported at once, with the instance
it served, and the monitor reloads that model (or restarts tritonserver, when the stub was a decoupled
model's: :mod:`warmup_tools.sidecar.stub_death`) without waiting for a probe to time
out.

Not every stub that exits died. Triton 2.51 (python_backend r24.10) ends a stub itself: at each load of a
model it runs one for the configuration's auto-complete (named after the model, not an instance; it
never serves) and finalizes it, and at an unload (the sidecar's own reload, the server's exit) it
finalizes the instance's stub. A finalized stub returns 0 from its main (``pb_stub.cc``), and Triton,
already in ``waitpid``, reaps it within moments: a scan that falls in between sees a zombie. So the
auto-complete stub is not watched, and a zombie whose exit status (``/proc/<pid>/stat``, field 52) is 0
is a stub that Triton stopped, not a death. A stub that crashed or was killed exits with a signal or a
non-zero code (1: its parent is gone).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Callable, Sequence

_STATES = {"Z": "exited", "X": "exited", "T": "stopped by a signal"}
_EXITED = ("Z", "X")
#: Where the stub's command line names its instance (or, for the auto-complete stub, its model): argv[8].
_NAME_ARG = 8
#: ``exit_code`` in ``/proc/<pid>/stat`` (field 52, Linux 3.5 and later), counted from the state (field 3).
_EXIT_CODE_FIELD = 52 - 3


@dataclasses.dataclass(frozen=True, slots=True)
class StubFault:
    """One stub that exited or stopped: its process, the instance it served (``<model>_<group>_<index>``,
    from its command line; "" when it named none) and what happened to it."""

    pid: int
    instance: str
    what: str

    @property
    def reason(self) -> str:
        return f"its Python backend stub (pid {self.pid}) {self.what}"


class StubScanner:
    """``scan()``: ``{model: StubFault}`` for each model of ``models`` with a stub that exited or was stopped.

    NOTE: a zombie's command line is empty, so the scanner remembers which model each live stub serves
    (pid -> model) from earlier scans; a stub that dies before the first scan is left to the probes.
    Each dead stub is reported once: Triton reaps it only when the old instance is destroyed, which a
    request still in flight on it can put off long after the reload (seen on 2.51), and a retry of a
    reload that failed is the health tracker's business. A stub that exited with status 0 (finalized by
    Triton: see the module's note) is no fault, where its exit status can be read.
    """

    def __init__(self, server_pid: int | Callable[[], int | None], models: Sequence[str],
                 proc: Path = Path("/proc")) -> None:
        """``server_pid``: tritonserver's process id, or a function giving it (it changes when the sidecar
        restarts the server)."""
        self._server_pid = server_pid if callable(server_pid) else (lambda: server_pid)
        self.models = tuple(models)
        self._proc = proc
        self._known: dict[int, tuple[str, str]] = {}
        self._reported: set[int] = set()

    def __call__(self) -> dict[str, StubFault]:
        return self.scan()

    def scan(self) -> dict[str, StubFault]:
        faults: dict[str, StubFault] = {}
        seen: dict[int, tuple[str, str]] = {}
        server_pid = self._server_pid()
        for entry in self._proc.iterdir():
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                # NOTE: the command may hold spaces and parentheses: the fields after the last ')' are fixed.
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                state, ppid = fields[0], int(fields[1])
                if ppid != server_pid:
                    continue
                known = self._known.get(pid) or self._stub_of((entry / "cmdline").read_bytes().split(b"\0"))
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile, or not ours to read
            if known is None:
                continue
            seen[pid] = known
            if state not in _STATES:
                self._reported.discard(pid)  # running again (SIGCONT): a later fault is a new one
            elif state in _EXITED and _exit_status(entry, fields) == 0:
                self._reported.add(pid)  # finalized by Triton (an unload, the auto-complete): no death
            elif pid not in self._reported:
                self._reported.add(pid)
                faults.setdefault(known[0], StubFault(pid, known[1], _STATES[state]))
        self._known = seen
        self._reported &= set(seen)
        return faults

    def _stub_of(self, argv: list[bytes]) -> tuple[str, str] | None:
        """``(model, instance)`` of a stub's command line (``stub model.py shm-region ... instance dir``)."""
        if not argv or not argv[0].endswith(b"triton_python_backend_stub"):
            return None
        for model in self.models:
            if any(f"/{model}/".encode() in arg for arg in argv[1:2]):
                if argv[_NAME_ARG:_NAME_ARG + 1] == [model.encode()]:
                    return None  # the configuration's auto-complete stub: named after the model, never serves
                prefix = f"{model}_".encode()
                names = [arg for arg in argv[2:] if arg.startswith(prefix) and b"/" not in arg]
                return model, names[0].decode(errors="replace") if names else ""
        return None


def _exit_status(entry: Path, fields: list[str]) -> int | None:
    """A zombie's exit status as ``waitpid`` gives it (0: a normal exit with code 0), None when not readable.

    NOTE: the kernel writes 0 in place of the status for a reader without ptrace access to the process, so
    the status counts only for a process of this reader's own user and group (the stubs of the server the
    sidecar started are); otherwise None, and the zombie is a death as before.
    """
    try:
        owner = entry.stat()
        status = int(fields[_EXIT_CODE_FIELD])
    except (OSError, IndexError, ValueError):
        return None
    if (owner.st_uid, owner.st_gid) != (os.geteuid(), os.getegid()):
        return None
    return status
