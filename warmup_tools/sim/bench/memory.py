"""``python -m warmup_tools bench memory``: what one replica costs in memory, the real engine against the simulated.

One fleet replica at a time (``python -m warmup_tools sidecar``: tritonserver, its Python-backend stubs, the sidecar
and its OpenAI front; :class:`~warmup_tools.fleet.replica.Replica`), started with the real engine, measured once
warm, stopped; then the same with ``engine=simulated``. Each process's proportional set size (PSS: its private
pages plus its share of the pages it shares, so the sum over processes is what they cost together) comes from
``/proc/<pid>/smaps_rollup``, ``settle_s`` after the replica is warm, with whether torch's and onnxruntime's
libraries are mapped into it. The figure: the simulated replica's PSS over the real one's (goal: at most 25%).
Only one replica runs at a time, so no page is shared with the other's processes.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, TextIO

from warmup_tools.common.settings import arg, environ_overrides
from warmup_tools.fleet.process import descendants
from warmup_tools.fleet.replica import Replica
from warmup_tools.fleet.settings import FleetSettings
from warmup_tools.lora_adapter.profile import DEFAULT_PROFILE
from warmup_tools.sim.bench.support.params import LmThreads
from warmup_tools.sim.bench.support.soak_checks import process_role
from warmup_tools.sim.bench.support.tables import markdown

#: The goal: a simulated replica's PSS at most this share of a real one's.
GOAL = 0.25
#: Libraries whose mapping into a process says it loaded them (file-name fragments).
LIBRARIES = {"torch": "libtorch_cpu", "onnxruntime": "onnxruntime_pybind"}


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessMemory:
    """One process of a replica."""

    role: str
    pid: int
    pss_kib: int
    libraries: tuple[str, ...]


def run(assets_dir: Path, *,
        profile: Annotated[str, arg("the simulated engine's profile")] = DEFAULT_PROFILE,
        settle_s: Annotated[float, arg("seconds after a replica is warm before it is measured", ge=0.0)] = 5.0,
        lm_threads: LmThreads = 1,
        out: TextIO = sys.stdout) -> None:
    measured: dict[str, list[ProcessMemory]] = {}
    for engine in ("real", "simulated"):
        env = {"WARMUP_ENGINE": engine}
        if engine == "simulated":
            env["WARMUP_ENGINE_PROFILE"] = profile
        with environ_overrides(env):
            measured[engine] = measure_replica(assets_dir, lm_threads, settle_s)
        out.write(f"{engine}: {len(measured[engine])} processes, "
                  f"{sum(p.pss_kib for p in measured[engine]) / 1024:,.0f} MiB\n")
        out.flush()
    out.write("\n" + report(measured) + "\n")


def measure_replica(assets_dir: Path, lm_threads: int, settle_s: float) -> list[ProcessMemory]:
    """Start one replica, wait until warm and ``settle_s`` more, read each of its processes, stop it."""
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        work = Path(tmp)
        for folder in ("control", "requests"):
            (work / folder).mkdir()
        settings = FleetSettings(replicas=1, lm_threads=lm_threads, assets_dir=assets_dir)
        replica = Replica("m0", settings, work, work / "control", None, request_log_dir=work / "requests")
        replica.start()
        try:
            replica.wait_warm()
            time.sleep(settle_s)
            pid = replica.process.pid
            assert pid is not None
            read = (process_memory(p) for p in (pid, *descendants(pid)))
            return [memory for memory in read if memory.pss_kib]
        finally:
            replica.stop()


def process_memory(pid: int) -> ProcessMemory:
    """PSS (KiB), role and mapped libraries of ``pid`` now (zero PSS when it is gone)."""
    proc = Path(f"/proc/{pid}")
    try:
        rollup = (proc / "smaps_rollup").read_text()
        argv = (proc / "cmdline").read_bytes().split(b"\0")
        maps = (proc / "maps").read_text()
    except OSError:
        return ProcessMemory("gone", pid, 0, ())
    pss = next((int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:")), 0)
    return ProcessMemory(role_of([a.decode(errors="replace") for a in argv if a]), pid, pss,
                         tuple(name for name, fragment in LIBRARIES.items() if fragment in maps))


def role_of(argv: list[str]) -> str:
    """What a replica's process is, from its command line: a stub by its model, tritonserver, the sidecar."""
    role = process_role(argv)
    if role is not None:
        return "tritonserver" if role == "tritonserver" else f"stub {re.sub(r'_[0-9]+_[0-9]+$', '', role)}"
    if "sidecar" in argv:
        return "sidecar + front"
    return Path(argv[0]).name if argv else "?"


def report(measured: dict[str, list[ProcessMemory]]) -> str:
    """Per role: each engine's PSS and mapped libraries, then the totals and the ratio against :data:`GOAL`."""
    roles = sorted({p.role for ps in measured.values() for p in ps})
    rows = []
    for role in roles:
        cells = [role]
        for engine in ("real", "simulated"):
            mine = [p for p in measured.get(engine, []) if p.role == role]
            libs = sorted({lib for p in mine for lib in p.libraries})
            cells.append(f"{sum(p.pss_kib for p in mine) / 1024:,.0f}" + (f" ({', '.join(libs)})" if libs else ""))
        rows.append(cells)
    totals = {e: sum(p.pss_kib for p in ps) / 1024 for e, ps in measured.items()}
    rows.append(["**total**", f"**{totals.get('real', 0):,.0f}**", f"**{totals.get('simulated', 0):,.0f}**"])
    ratio = totals["simulated"] / totals["real"] if totals.get("real") else float("nan")
    verdict = "met" if ratio <= GOAL else "NOT met"
    return (markdown(["process", "real engine: PSS MiB (libraries)", "simulated: PSS MiB (libraries)"], rows)
            + f"\n\nsimulated / real: {ratio:.0%} (goal <= {GOAL:.0%}: {verdict})")
