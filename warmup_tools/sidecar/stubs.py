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
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Sequence

_STATES = {"Z": "exited", "X": "exited", "T": "stopped by a signal"}


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
    reload that failed is the health tracker's business.
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
                prefix = f"{model}_".encode()
                names = [arg for arg in argv[2:] if arg.startswith(prefix) and b"/" not in arg]
                return model, names[0].decode(errors="replace") if names else ""
        return None
