"""``python -m warmup_tools bench recovery``: how long a killed ``lora_adapter`` stub costs with the sidecar.

One server in explicit model-control mode with the sidecar beside it (what ``warmup_tools sidecar``
runs). For each kill: SIGKILL the ``lora_adapter`` stub, then print the seconds until ``/ready`` says 503
and until it says 200 again, how the requests a client kept sending meanwhile failed (and how fast), the
recovery (a reload of the model, or a restart of tritonserver: ``--on-stub-death``), its duration, when
it started, how a request that was streaming at the kill ended (and how long after the kill), and whether
requests after the recovery fail and hit the warm prefix.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, TextIO

from warmup_tools.common.errors import ServerError
from warmup_tools.common.settings import arg
from warmup_tools.demo.prompts import USER_QUESTIONS, demo_prompt
from warmup_tools.server.client import GenerateError, GenerateParams, StreamingClient
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.server.process import RepositoryKey, TritonServer
from warmup_tools.sidecar.app import Sidecar
from warmup_tools.sidecar.config import STUB_DEATH_ACTIONS, SidecarConfig
from warmup_tools.sim.bench.support.servers import ready_status

CLIENT_TIMEOUT_S = 60.0
#: Prefix of :class:`GenerateError`'s message when the client's own deadline passed (a hang).
CLIENT_TIMEOUT_MESSAGE = "no response within"


@dataclasses.dataclass(frozen=True, slots=True)
class Attempt:
    """One request sent during an outage: when (s after the kill), how long it took, its error if any."""

    at_s: float
    latency_s: float
    error: str = ""


class OutageClient:
    """Sends one short ``ensemble`` request every ``gap_s`` on its own thread until stopped."""

    def __init__(self, grpc_url: str, gap_s: float = 0.5, adapter: str = "support") -> None:
        self.grpc_url = grpc_url
        self.gap_s = gap_s
        self.adapter = adapter
        self.attempts: list[Attempt] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outage-client", daemon=True)
        self._begin = time.monotonic()

    def start(self, begin: float | None = None) -> None:
        self._begin = begin if begin is not None else time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(CLIENT_TIMEOUT_S + 10)

    def failures(self) -> list[Attempt]:
        return [a for a in self.attempts if a.error]

    def hung(self) -> list[Attempt]:
        return [a for a in self.attempts if CLIENT_TIMEOUT_MESSAGE in a.error]

    def summary(self) -> list[str]:
        """One line per outcome: count and min / median / max latency in ms."""
        kinds: dict[str, list[float]] = {}
        for attempt in self.attempts:
            kinds.setdefault(attempt.error[:90] or "ok", []).append(attempt.latency_s * 1000)
        return [f"{len(ms):4d} x {kind!r}: {min(ms):.1f} / {sorted(ms)[len(ms) // 2]:.1f} / {max(ms):.1f} ms"
                for kind, ms in sorted(kinds.items())]

    def _run(self) -> None:
        while not self._stop.is_set():
            # NOTE: a fresh client per request: a stream that saw an error is not reused.
            with StreamingClient(self.grpc_url, timeout_s=CLIENT_TIMEOUT_S) as client:
                at = time.monotonic() - self._begin
                start = time.perf_counter()
                error = ""
                try:
                    client.generate("Hello", GenerateParams(max_tokens=2, adapter_id=self.adapter))
                except GenerateError as exc:
                    error = str(exc) or "error"
            self.attempts.append(Attempt(at, time.perf_counter() - start, error))
            self._stop.wait(self.gap_s)


class InFlightRequest:
    """One long generation that is streaming when the stub is killed: how long after the kill it ends."""

    def __init__(self, grpc_url: str, adapter: str = "support", timeout_s: float = CLIENT_TIMEOUT_S) -> None:
        self.grpc_url = grpc_url
        self.adapter = adapter
        self.timeout_s = timeout_s
        self.streaming = threading.Event()
        self.ended_at: float | None = None
        self.error = ""
        self._thread = threading.Thread(target=self._run, name="in-flight", daemon=True)

    def start(self) -> bool:
        """Start it; True once its first token arrived (it is in the engine, not queued)."""
        self._thread.start()
        return self.streaming.wait(self.timeout_s)

    def join(self) -> None:
        self._thread.join(self.timeout_s + 10)

    def describe(self, killed_at: float) -> str:
        if self.ended_at is None:
            return "still waiting"
        outcome = f"failed ({self.error[:90]!r})" if self.error else "finished"
        return f"{outcome} {self.ended_at - killed_at:.1f} s after the kill"

    def _run(self) -> None:
        question = USER_QUESTIONS[self.adapter][0]
        with StreamingClient(self.grpc_url, timeout_s=self.timeout_s) as client:
            try:
                client.generate(demo_prompt(self.adapter, question),
                                GenerateParams(max_tokens=512, adapter_id=self.adapter),
                                on_piece=lambda _: self.streaming.set())
            except GenerateError as exc:
                self.error = str(exc) or "error"
            finally:
                self.ended_at = time.monotonic()
                self.streaming.set()


def wait_for_ready(sidecar_url: str, want: int, deadline_s: float) -> float:
    """Poll ``/ready`` every 0.1 s until it answers ``want``; returns the seconds it took."""
    start = time.monotonic()
    while ready_status(sidecar_url) != want:
        if time.monotonic() - start > deadline_s:
            raise ServerError(f"/ready did not answer {want} within {deadline_s:.0f}s")
        time.sleep(0.1)
    return time.monotonic() - start


def run(assets_dir: Path, *, kills: Annotated[int, arg("times the stub is killed")] = 1,
        probe_interval_s: Annotated[float, arg("the sidecar's probe_interval_s")] = 2.0,
        after: Annotated[int, arg("requests sent after each recovery")] = 5,
        watch_stubs: Annotated[bool, arg("the sidecar watches the stubs (--no-watch-stubs: it finds the dead stub "
                                         "through its probes only)")] = True,
        signal_name: Annotated[str, arg("SIGKILL the stub (a crash) or SIGSTOP it (a hang)", flag="signal",
                                        choices=("KILL", "STOP"))] = "KILL",
        on_stub_death: Annotated[str | None, arg("the sidecar's on_stub_death (none: its default); "
                                                 "docs/faults.md", choices=STUB_DEATH_ACTIONS)] = None,
        restart_grace_s: Annotated[float | None, arg("the sidecar's restart_grace_s (none: its default)")] = None,
        out: TextIO = sys.stdout) -> None:
    """Kill (or, with ``signal_name`` STOP, stop) the ``lora_adapter`` stub ``kills`` times; print what the
    outage cost each time, and how long the server and sidecar took to be ready at start (what a restart
    of a killed tritonserver costs). Without ``watch_stubs`` the sidecar finds the stub through its probes
    (and never restarts the server). ``on_stub_death``, ``restart_grace_s``: the sidecar's settings (None:
    its default)."""
    env = {"WARMUP_ASSETS_DIR": str(assets_dir), "WARMUP_CONTROL_DIR": "", "WARMUP_REDIS_URL": "",
           "WARMUP_REQUEST_LOG_DIR": ""}
    server = TritonServer(REPO_ROOT / "model_repository", env=env, explicit_model_control=True,
                          repository_key=RepositoryKey.generate())
    settings = {k: v for k, v in (("on_stub_death", on_stub_death), ("restart_grace_s", restart_grace_s))
                if v is not None}
    config = SidecarConfig(probe_interval_s=probe_interval_s, port=0, **settings)
    start = time.monotonic()
    with server:
        server.wait_ready(timeout=600)
        with Sidecar(config, server.http_url, server.grpc_url, server.repository_key,
                     REPO_ROOT / "model_repository", server=server if watch_stubs else None) as sidecar:
            wait_for_ready(sidecar.url, 200, 300)
            watched = f"watched, on_stub_death {config.on_stub_death}" if watch_stubs else "not watched"
            out.write(f"server and sidecar ready {time.monotonic() - start:.1f} s after the start (probe interval "
                      f"{probe_interval_s:g} s, stubs {watched}, SIG{signal_name})\n")
            for kill in range(1, kills + 1):
                _one_kill(server, sidecar, kill, after, out, getattr(signal, f"SIG{signal_name}"))


def _one_kill(server: TritonServer, sidecar: Sidecar, kill: int, after: int, out: TextIO,
              sig: signal.Signals = signal.SIGKILL) -> None:
    stubs = server.stub_pids("lora_adapter")
    if len(stubs) != 1:
        raise ServerError(f"expected one lora_adapter stub, found {stubs}")
    outage = OutageClient(server.grpc_url)
    inflight = InFlightRequest(server.grpc_url)
    streaming = inflight.start()
    os.kill(stubs[0], sig)
    killed_at, killed_wall = time.monotonic(), time.time()
    outage.start(killed_at)
    try:
        not_ready_s = wait_for_ready(sidecar.url, 503, 300)
        ready_s = not_ready_s + wait_for_ready(sidecar.url, 200, 600)
    finally:
        outage.stop()
        inflight.join()
    status = sidecar.monitor.snapshot()
    recovery = status["last_recovery"] or {}
    reload_at = recovery.get("started_at", float("nan")) - killed_wall
    failed_after, cached = 0, []
    with StreamingClient(server.grpc_url, timeout_s=CLIENT_TIMEOUT_S) as client:
        for question in (USER_QUESTIONS["support"] * after)[:after]:
            try:
                result = client.generate(demo_prompt("support", question),
                                         GenerateParams(max_tokens=4, adapter_id="support"))
                cached.append(result.cached_tokens)
            except GenerateError:
                failed_after += 1
    what = "restart" if recovery.get("model") == "tritonserver" else "reload"
    out.write(f"kill {kill}: /ready 503 after {not_ready_s:.1f} s, 200 again after {ready_s:.1f} s "
              f"({what} {recovery.get('duration_s', float('nan')):.1f} s); {len(outage.failures())} of "
              f"{len(outage.attempts)} requests during the outage failed, {len(outage.hung())} hung; "
              f"after recovery {failed_after} of {after} failed, cached_tokens {cached}\n")
    out.write(f"    {what} started {reload_at:.1f} s after the kill; a request streaming at the kill "
              f"{inflight.describe(killed_at) if streaming else 'did not start streaming'}\n")
    for line in outage.summary():
        out.write(f"    {line}  (min / median / max)\n")
    out.flush()
