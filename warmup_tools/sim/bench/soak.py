"""``python -m warmup_tools bench soak``: long mixed traffic against the stack ``warmup_tools sidecar`` runs,
a ``lora_adapter`` stub killed at an interval, and whether anything grows, hangs or is lost.

The stack is started as ``python -m warmup_tools sidecar`` (tritonserver in explicit model-control mode with
the readiness and recovery sidecar in the same process) on free ports, with its own control, request-log
and log folders, and a fourth adapter (``billing``, built with the demo asset code) made live through the
control folder beside the three demo adapters. Then, for ``duration``:

- ``concurrency`` closed-loop clients send a mix: ``ensemble`` gRPC streams with the demo plan's prompts
  (planned prefixes) and with unplanned ones, requests straight to ``lora_adapter`` (token ids), several
  tenants, the four adapters and the base model; some streams are cancelled mid-stream (gRPC cancel), and
  ``bad_share`` of the requests are bad in one of several ways, each of which must get its error;
- every ``kill_every`` the ``lora_adapter`` stub is SIGKILLed; a recovery window runs from the kill until
  the sidecar's ``/ready`` answers 200 again, plus ``grace_s``; a good request that fails outside every
  window is lost;
- every ``sample_every`` the RSS, open files and threads of tritonserver, each stub (by model instance: a
  stub started by a recovery continues its role), the sidecar process and the bench itself are sampled.

Written to ``out_dir``: ``samples.csv``, ``requests.csv``, ``summary.md`` (printed too), and the logs of
the server and the sidecar. The run fails (exit 2) when a request was lost, a bad request did not get its
clear error, a metric grew beyond its tolerance, or a slot stayed held after the traffic stopped.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Annotated, Any, Sequence, TextIO

import numpy as np

from warmup_tools.common.errors import WarmupToolsError
from warmup_tools.common.settings import arg, parse_duration
from warmup_tools.demo.prompts import SYSTEM_PROMPTS, USER_QUESTIONS
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.sim.bench.support.params import MaxTokens, Seed
from warmup_tools.sim.bench.support.soak_checks import (
    CANCELLED,
    ERROR,
    HUNG,
    METRICS,
    OK,
    TOLERANCES,
    Accounting,
    BadKind,
    Flatness,
    ProcSample,
    RequestRecord,
    SoakSettings,
    Window,
    account,
    error_class,
    flatness,
    flatness_table,
)
from warmup_tools.sim.bench.support.soak_stack import (
    EXTRA_ADAPTER,
    Killer,
    ReadyWatch,
    Sampler,
    Stack,
    serve_assets,
)

#: The fourth adapter's warm prompt.
EXTRA_SYSTEM_PROMPT = (
    "You answer billing questions for Acme Cloud. Invoices are issued on the first day of each month, in the "
    "currency of the customer's contract. Explain each line of an invoice, point to the usage report behind "
    "it, and say when a credit note applies. Refunds take five to seven business days. Never change a plan or "
    "issue a refund yourself: tell the customer which form to send.\n\n"
)
EXTRA_QUESTIONS = ["Why is my invoice higher than last month?", "When will my refund arrive?"]
ADAPTERS: tuple[str, ...] = ("support", "legal", "sql", EXTRA_ADAPTER)
TENANTS: tuple[str, ...] = ("default", "acme", "globex", "initech")
#: Seconds a request may go without a response before it counts as hung (any request of the mix takes a
#: few seconds at most on two shared cores).
CLIENT_TIMEOUT_S = 30.0
#: Pause of a client after an error (a real client backs off too; keeps a recovery from being flooded).
ERROR_PAUSE_S = 0.5
#: Vocabulary of the demo LM (token ids above it are refused).
OUTSIDE_VOCAB_ID = 999_999


def _bad_requests() -> list[tuple[BadKind, Any, dict[str, Any]]]:
    """Each bad request: its kind, its text (or token ids, direct), and its parameters."""
    return [
        (BadKind("tenant with control characters", "http", "INVALID_ARG", "tenant_id' is not a valid name", "zq7"),
         "hello", {"tenant_id": "acme\x00\nzq7", "max_tokens": 3}),
        (BadKind("tenant of 100,000 bytes", "grpc", "INVALID_ARG", "tenant_id' is not a valid name", "t" * 80),
         "hello", {"tenant_id": "t" * 100_000, "max_tokens": 3}),
        (BadKind("adapter name with a path", "http", "INVALID_ARG", "adapter_id' is not a valid name", "../"),
         "hello", {"adapter_id": "../adapters/support", "max_tokens": 3}),
        # NOTE: lora_adapter answers an unknown adapter with NOT_FOUND; through the ensemble Triton 2.51's HTTP
        # generate endpoint sends it as 400 ("in ensemble 'ensemble', unknown adapter ..."), as for INVALID_ARG.
        (BadKind("unknown adapter (HTTP)", "http", "NOT_FOUND", "unknown adapter", http_status=400),
         "hello", {"adapter_id": "no-such-adapter", "max_tokens": 3}),
        (BadKind("unknown adapter (gRPC)", "grpc", "NOT_FOUND", "unknown adapter"),
         "hello", {"adapter_id": "no-such-adapter", "max_tokens": 3}),
        (BadKind("text of 300 KiB", "http", "INVALID_ARG", "longer than 262144 bytes", "x" * 32),
         "zq " + "x" * (300 << 10), {"adapter_id": "support", "max_tokens": 3}),
        (BadKind("top_p 0", "grpc", "INVALID_ARG", "1 for no nucleus filtering"),
         "hello", {"top_p": 0.0, "max_tokens": 3}),
        (BadKind("max_tokens 0", "http", "INVALID_ARG", "max_tokens"), "hello", {"max_tokens": 0}),
        (BadKind("max_tokens 100000", "grpc", "INVALID_ARG", "max_tokens"), "hello", {"max_tokens": 100_000}),
        (BadKind("temperature -1", "http", "INVALID_ARG", "temperature"), "hello",
         {"temperature": -1.0, "max_tokens": 3}),
        (BadKind("temperature 1000", "grpc", "INVALID_ARG", "temperature"), "hello",
         {"temperature": 1000.0, "max_tokens": 3}),
        (BadKind("top_k -1", "http", "INVALID_ARG", "top_k"), "hello", {"top_k": -1, "max_tokens": 3}),
        (BadKind("empty text", "grpc", "INVALID_ARG", "empty"), "   ", {"max_tokens": 3}),
        (BadKind("text not UTF-8", "grpc", "INVALID_ARG", "UTF-8"), b"\xff\xfe zq", {"max_tokens": 3}),
        (BadKind("token id outside the vocabulary (direct)", "direct", "INVALID_ARG", "outside the vocabulary"),
         [OUTSIDE_VOCAB_ID], {"max_tokens": 3}),
        (BadKind("tenant of 65 bytes (direct)", "direct", "INVALID_ARG", "tenant_id' is not a valid name", "t" * 65),
         [5, 6, 7, 8], {"tenant_id": "t" * 65, "max_tokens": 3}),
    ]


# ----------------------------------------------------------------------------------------- traffic
class _Cancel(Exception):
    """Raised from a stream's piece callback to cancel it mid-stream."""


class Traffic:
    """``concurrency`` client threads sending the mix until stopped; each request becomes a record."""

    def __init__(self, stack: Stack, t0: float, settings: SoakSettings, tokenizer: Any) -> None:
        self.stack, self.t0, self.settings, self.tokenizer = stack, t0, settings, tokenizer
        self.records: list[RequestRecord] = []
        self.bad = _bad_requests()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._worker, args=(i,), name=f"soak-client-{i}", daemon=True)
                         for i in range(settings.concurrency)]

    @property
    def bad_kinds(self) -> dict[str, BadKind]:
        return {kind.name: kind for kind, _, _ in self.bad}

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(CLIENT_TIMEOUT_S + 30)

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _worker(self, index: int) -> None:
        from warmup_tools.server.client import StreamingClient

        rng = random.Random(self.settings.seed * 1000 + index)
        client: Any = None
        try:
            while not self._stop.is_set():
                if client is None:
                    client = StreamingClient(self.stack.grpc_url, timeout_s=CLIENT_TIMEOUT_S)
                record = self._one(rng, client)
                self.records.append(record)
                if record.outcome in (ERROR, HUNG) and record.kind != "bad":
                    _discard(client)  # NOTE: a stream that saw an error is not reused
                    client = None
                    self._stop.wait(ERROR_PAUSE_S)
        finally:
            if client is not None:
                client.close()

    def _one(self, rng: random.Random, client: Any) -> RequestRecord:
        s = self.settings
        draw = rng.random()
        if draw < s.bad_share:
            return self._bad(rng)
        if draw < s.bad_share + s.cancel_share:
            return self._cancelled(rng)
        adapter, tenant = rng.choice(ADAPTERS), rng.choice(TENANTS)
        planned = rng.random() < 0.5
        text = planned_prompt(adapter, rng) if planned else unplanned_prompt(rng)
        if not planned and rng.random() < 0.1:
            adapter = ""  # the base model
        params = {"adapter_id": adapter or None, "tenant_id": tenant, "max_tokens": rng.randint(2, s.max_tokens)}
        if draw < s.bad_share + s.cancel_share + s.direct_share:
            return self._stream("direct", client=None, payload=self._ids(text), params=params)
        return self._stream("planned" if planned else "unplanned", client, text, params)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def _stream(self, kind: str, client: Any, payload: Any, params: dict[str, Any], *, cancel_after: int = 0,
                bad_kind: str = "") -> RequestRecord:
        """One gRPC stream: to ``ensemble`` on ``client`` (text), or to ``lora_adapter`` on a fresh client
        (token ids, ``client`` None); cancelled after ``cancel_after`` pieces when set."""
        from warmup_tools.server.client import GenerateError, GenerateParams, StreamingClient, grpc_inputs

        gen = GenerateParams(**{k: v for k, v in params.items() if v is not None})
        own = client is None or cancel_after > 0 or bad_kind != ""
        if own:
            client = StreamingClient(self.stack.grpc_url, model="ensemble" if isinstance(payload, (str, bytes))
                                     else "lora_adapter", timeout_s=CLIENT_TIMEOUT_S)
        if isinstance(payload, (str, bytes)):
            inputs = grpc_inputs(payload, gen, True)
        else:
            inputs = direct_inputs(payload, gen)
        pieces = 0

        def on_piece(_: str) -> None:
            nonlocal pieces
            pieces += 1
            if cancel_after and pieces >= cancel_after:
                raise _Cancel()

        start = self._now()
        record = dict(kind=kind, adapter=params.get("adapter_id") or "", tenant=params.get("tenant_id") or "",
                      bad_kind=bad_kind)
        finished = False
        try:
            result = client.stream_inputs(inputs, on_piece=on_piece)
            finished = True
        except _Cancel:
            client.cancel()
            return RequestRecord(start_s=start, end_s=self._now(), outcome=CANCELLED, **record)
        except GenerateError as exc:
            message = str(exc)
            outcome = HUNG if message.startswith("no response within") else ERROR
            return RequestRecord(start_s=start, end_s=self._now(), outcome=outcome, error=message[:500],
                                 status=exc.status, **record)
        finally:
            if own and finished:
                client.close()
            elif own:
                _discard(client)
        return RequestRecord(start_s=start, end_s=self._now(), outcome=OK, cached_tokens=result.cached_tokens,
                             prompt_tokens=result.prompt_tokens, output_tokens=result.output_tokens, **record)

    def _cancelled(self, rng: random.Random) -> RequestRecord:
        adapter, tenant = rng.choice(ADAPTERS), rng.choice(TENANTS)
        text = unplanned_prompt(rng)
        if rng.random() < 0.5:
            # NOTE: straight to lora_adapter, where the gRPC cancellation reaches the running sequence (through
            # the ensemble Triton 2.51 does not cancel a step already running: it runs to max_tokens).
            return self._stream("cancel", None, self._ids(text), {"adapter_id": adapter, "tenant_id": tenant,
                                                                  "max_tokens": 64}, cancel_after=2)
        return self._stream("cancel", None, text, {"adapter_id": adapter, "tenant_id": tenant,
                                                   "max_tokens": self.settings.max_tokens}, cancel_after=1)

    def _bad(self, rng: random.Random) -> RequestRecord:
        kind, payload, params = rng.choice(self.bad)
        if kind.transport != "http":
            return self._stream("bad", None, payload, params, bad_kind=kind.name)
        import requests

        from warmup_tools.server.client import GenerateError, GenerateParams, http_generate

        start = self._now()
        base = dict(kind="bad", bad_kind=kind.name, adapter=str(params.get("adapter_id") or ""),
                    tenant=str(params.get("tenant_id") or ""))
        try:
            http_generate(self.stack.http_url, payload, GenerateParams(**params), timeout_s=CLIENT_TIMEOUT_S)
        except GenerateError as exc:
            return RequestRecord(start_s=start, end_s=self._now(), outcome=ERROR, error=str(exc)[:500],
                                 status=int(exc.status) if exc.status is not None else None, **base)
        except requests.Timeout:
            return RequestRecord(start_s=start, end_s=self._now(), outcome=HUNG,
                                 error=f"no response within {CLIENT_TIMEOUT_S:.0f}s", **base)
        except requests.RequestException as exc:
            return RequestRecord(start_s=start, end_s=self._now(), outcome=ERROR,
                                 error=f"{type(exc).__name__}: {exc}"[:500], **base)
        return RequestRecord(start_s=start, end_s=self._now(), outcome=OK, **base)


def _discard(client: Any) -> None:
    """Close a client whose stream may still hold an unfinished request.

    NOTE: a plain close waits until every request on the stream has finished; a request that was running on
    a killed stub never did (seen through ``ensemble``: no response at all), so the close hung the client
    thread for good. Cancelling the stream first ends it."""
    client.cancel()
    client.close()


def direct_inputs(ids: list[int], params: Any) -> list[Any]:
    """``lora_adapter``'s inputs: the ensemble's sampling and identity tensors, token ids for the text."""
    import tritonclient.grpc as grpcclient

    from warmup_tools.server.client import grpc_inputs

    tensors = [t for t in grpc_inputs(b"-", params, True) if t.name() != "text_input"]
    array = np.asarray(ids, dtype=np.int32)
    tensor = grpcclient.InferInput("input_ids", list(array.shape), "INT32")
    tensor.set_data_from_numpy(array)
    return [tensor, *tensors]


def planned_prompt(adapter: str, rng: random.Random) -> str:
    """A prompt behind the demo plan's (or the extra adapter's warmed) system prompt."""
    if adapter == EXTRA_ADAPTER:
        return f"{EXTRA_SYSTEM_PROMPT}User: {rng.choice(EXTRA_QUESTIONS)}\nAssistant:"
    return f"{SYSTEM_PROMPTS[adapter]}User: {rng.choice(USER_QUESTIONS[adapter])}\nAssistant:"


def unplanned_prompt(rng: random.Random) -> str:
    """A prompt no plan holds: a random ticket number first, then a few questions of any scope."""
    questions = [q for qs in USER_QUESTIONS.values() for q in qs] + EXTRA_QUESTIONS
    body = " ".join(rng.choice(questions) for _ in range(rng.randint(2, 8)))
    return f"Ticket {rng.getrandbits(48):012x}: {body}\nAssistant:"


# ---------------------------------------------------------------------------------------------- run
def run(assets_dir: Path, *,
        duration: Annotated[float, arg("how long the traffic runs (30m)", parse=parse_duration)] = 1800.0,
        kill_every: Annotated[float, arg("SIGKILL the lora_adapter stub this often", parse=parse_duration)] = 600.0,
        concurrency: Annotated[int, arg("closed-loop clients")] = 4,
        bad_share: Annotated[float, arg("share of bad requests")] = 0.05,
        cancel_share: Annotated[float, arg("share of streams cancelled mid-stream")] = 0.05,
        direct_share: Annotated[float, arg("share of requests straight to lora_adapter")] = 0.10,
        settle: Annotated[float, arg("flat after this long (after the start and after each process's own start)",
                                     parse=parse_duration)] = 300.0,
        sample_every: Annotated[float, arg("process sampling interval", parse=parse_duration)] = 5.0,
        grace: Annotated[float, arg("added to each recovery window after /ready 200", parse=parse_duration)] = 5.0,
        max_tokens: MaxTokens = 16,
        seed: Seed = 0,
        out_dir: Annotated[Path, arg("folder for summary.md, samples.csv, requests.csv and the logs",
                                     flag="out")] = REPO_ROOT / "runs" / "soak",
        out: TextIO = sys.stdout) -> Accounting:
    """Run the soak; write samples.csv, requests.csv and summary.md to ``out_dir``; print the summary."""
    from transformers import AutoTokenizer

    from warmup_tools.control.registry import ControlRegistry
    from warmup_tools.control.state import AdapterState

    settings = SoakSettings(duration, kill_every, concurrency, bad_share, cancel_share, direct_share, settle,
                            sample_every, grace, max_tokens, seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    stack: Stack | None = None
    left: list[str] = []
    try:
        out.write(f"building the assets of the run (the extra adapter {EXTRA_ADAPTER!r}) in {work}\n")
        out.flush()
        served = serve_assets(Path(assets_dir), work, seed)
        tokenizer = AutoTokenizer.from_pretrained(served / "lm")
        stack = Stack(served, work)
        stack.start()
        out.write(f"starting `warmup_tools sidecar` (pid {stack.pid}): gRPC {stack.grpc_url}, sidecar "
                  f"{stack.sidecar_url}\n")
        out.flush()
        stack.wait_ready()
        registry = ControlRegistry(stack.control_dir)
        registry.add(EXTRA_ADAPTER, [EXTRA_SYSTEM_PROMPT])
        registry.wait_until(EXTRA_ADAPTER, AdapterState.LIVE, timeout_s=600)
        stack.wait_ready()
        out.write(f"ready with adapters {', '.join(ADAPTERS)}; {concurrency} clients for {duration / 60:g} min, the "
                  f"lora_adapter stub killed at {', '.join(f'{t / 60:g}' for t in settings.kill_times()) or 'never'}"
                  " min\n")
        out.flush()
        t0 = time.monotonic()
        sampler, killer = Sampler(stack, t0, sample_every), Killer(stack, t0, settings, out)
        watch, traffic = ReadyWatch(stack.sidecar_url, t0), Traffic(stack, t0, settings, tokenizer)
        for part in (sampler, watch, killer, traffic):
            part.start()
        try:
            _progress(traffic, killer, t0, duration, out)
        finally:
            traffic.stop()
            killer.stop()
            watch.stop()
            sampler.stop()
        run_end = time.monotonic() - t0
        held = _slots_after(stack)
        left = stack.stop()
        stack_logs = (stack.server_log, stack.sidecar_log)
        stack = None
        for log in stack_logs:
            if log.exists():
                shutil.copy2(log, out_dir / log.name)
        windows = list(killer.windows)
        if len(windows) < len(settings.kill_times()):
            out.write("warning: fewer recoveries recorded than kills planned\n")
        accounting = account(traffic.records, windows, traffic.bad_kinds)
        roles = _roles(sampler.samples)
        # NOTE: a model's load starts a short-lived stub named after the model (no instance): seen only in a
        # recovery window, it is listed, not judged.
        brief = [r for r in roles if not any(s.role == r and s.t_s >= settle for s in sampler.samples)]
        rows = [flatness(sampler.samples, role, metric, settle, windows)
                for role in roles if role not in brief for metric in METRICS]
        _write_samples(out_dir / "samples.csv", sampler.samples, windows)
        _write_requests(out_dir / "requests.csv", traffic.records)
        unready_outside = [t for t in watch.unready if not any(w.kill_s <= t <= w.end_s for w in windows)]
        summary = format_summary(settings, accounting, windows, rows, held, left, unready_outside,
                                 killer.errors, run_end, traffic.bad_kinds, brief)
        (out_dir / "summary.md").write_text(summary)
        out.write("\n" + summary)
        out.write(f"\nwritten to {out_dir}: summary.md, samples.csv, requests.csv, tritonserver.log, sidecar.log\n")
        out.flush()
        failures = verdict_failures(accounting, rows, held, left, killer.errors)
        if failures:
            raise WarmupToolsError("soak failed: " + "; ".join(failures))
        return accounting
    finally:
        if stack is not None:
            left = stack.stop()
            if left:
                out.write(f"warning: still alive after the stop: {', '.join(left)}\n")
        shutil.rmtree(work, ignore_errors=True)


def _progress(traffic: Traffic, killer: Killer, t0: float, duration: float, out: TextIO) -> None:
    """Wait for the end of the run, printing a line a minute."""
    next_line = 60.0
    while True:
        now = time.monotonic() - t0
        if now >= duration:
            return
        time.sleep(min(1.0, duration - now))
        if now >= next_line:
            records = list(traffic.records)
            errors = sum(r.outcome in (ERROR, HUNG) and r.kind != "bad" for r in records)
            out.write(f"[{now:7.1f} s] {len(records)} requests, {errors} good ones failed, "
                      f"{len(killer.windows)} recoveries\n")
            out.flush()
            next_line += 60.0


def _slots_after(stack: Stack, timeout_s: float = 120.0) -> dict[str, float]:
    """lora_adapter's running and waiting sequences once the traffic stopped (0 when nothing leaked)."""
    from warmup_tools.server.client import metric_sum, scrape_metrics

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            samples = scrape_metrics(stack.metrics_url)
        except Exception:  # noqa: BLE001 - shown as unknown (a failure), the run goes on to stop the stack
            return {"running": float("nan"), "waiting": float("nan")}
        held = {name: metric_sum(samples, f"warmup_scheduler_{name}_sequences") for name in ("running", "waiting")}
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.5)


def _roles(samples: list[ProcSample]) -> list[str]:
    order = {"tritonserver": 0, "sidecar": 2, "bench": 3}
    return sorted({s.role for s in samples}, key=lambda r: (order.get(r, 1), r))


def _write_samples(path: Path, samples: list[ProcSample], windows: list[Window]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["t_s", "role", "pid", "age_s", "rss_bytes", "fds", "threads", "in_recovery_window"])
        for s in samples:
            writer.writerow([f"{s.t_s:.1f}", s.role, s.pid, f"{s.age_s:.1f}", s.rss_bytes, s.fds, s.threads,
                             int(any(w.kill_s <= s.t_s <= w.end_s for w in windows))])


def _write_requests(path: Path, records: list[RequestRecord]) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["kind", "start_s", "end_s", "outcome", "adapter", "tenant", "bad_kind", "status", "error",
                         "prompt_tokens", "cached_tokens", "output_tokens"])
        for r in sorted(records, key=lambda r: r.start_s):
            writer.writerow([r.kind, f"{r.start_s:.3f}", f"{r.end_s:.3f}", r.outcome, r.adapter,
                             r.tenant[:64].encode("unicode_escape").decode(), r.bad_kind,
                             "" if r.status is None else r.status, error_class(r.error, 200), r.prompt_tokens,
                             r.cached_tokens, r.output_tokens])


def verdict_failures(accounting: Accounting, rows: list[Flatness], held: dict[str, float], left: list[str],
                     killer_errors: list[str]) -> list[str]:
    failures = []
    if accounting.lost:
        failures.append(f"{len(accounting.lost)} requests lost outside the recovery windows")
    if accounting.bad_failed:
        failures.append(f"{len(accounting.bad_failed)} bad requests without their clear error")
    growing = [f"{r.role} {r.metric}" for r in rows if r.verdict == "growing"]
    if growing:
        failures.append("growing: " + ", ".join(growing))
    if any(v != 0 for v in held.values()):
        failures.append(f"sequences held after the traffic stopped: {held}")
    if left:
        failures.append(f"still alive after the stop: {', '.join(left)}")
    failures += killer_errors
    return failures


def _machine() -> str:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    gpu = "a GPU (nvidia-smi found)" if shutil.which("nvidia-smi") else "no GPU"
    return f"{os.cpu_count()} CPU cores ({model or 'unknown model'}), {gpu}"


def format_summary(settings: SoakSettings, a: Accounting, windows: list[Window], rows: list[Flatness],
                   held: dict[str, float], left: list[str], unready_outside: list[float], killer_errors: list[str],
                   run_end_s: float, bad_kinds: dict[str, BadKind], brief: Sequence[str] = ()) -> str:
    s = settings
    lines = [
        f"# Soak: {s.duration_s / 60:g} minutes of mixed traffic, a lora_adapter stub killed every "
        f"{s.kill_every_s / 60:g} minutes",
        "",
        f"{datetime.date.today().isoformat()}, {_machine()}. `python -m warmup_tools bench soak --duration "
        f"{s.duration_s / 60:g}m --kill-every {s.kill_every_s / 60:g}m --concurrency {s.concurrency} --bad-share "
        f"{s.bad_share:g}` ({s.concurrency} closed-loop clients, cancel share {s.cancel_share:g}, direct share "
        f"{s.direct_share:g}, max_tokens up to {s.max_tokens}, seed {s.seed}); traffic ran {run_end_s:.0f} s.",
        "",
        "## Requests",
        "",
        "| class | sent | served | cancelled | failed in a recovery window | lost |",
        "|---|---|---|---|---|---|",
    ]
    for kind in ("planned", "unplanned", "direct", "cancel"):
        sent = a.sent.get(kind, 0)
        lines.append(f"| {kind} | {sent} | {a.ok.get(kind, 0)} | {a.cancelled if kind == 'cancel' else 0} | "
                     f"{sum(r.kind == kind for r in a.outage_failures)} | {sum(r.kind == kind for r in a.lost)} |")
    lines += ["", f"**Lost requests outside the recovery windows: {len(a.lost)}** (a window runs from the kill "
              f"until the sidecar's /ready answers 200 again, plus {s.grace_s:g} s of grace).", ""]
    for r in a.lost[:10]:
        lines.append(f"- lost: {r.kind} at {r.start_s:.1f}-{r.end_s:.1f} s, {r.outcome}: {error_class(r.error)}")
    hung = sum(r.outcome == HUNG for r in a.outage_failures)
    if hung:
        lines.append(f"- in a window, {hung} hung: no response at all within {CLIENT_TIMEOUT_S:.0f} s (not lost, "
                     "but each held its client that long)")
    failures_by_error: dict[str, int] = {}
    for r in (r for r in a.outage_failures if r.outcome != HUNG):
        failures_by_error[error_class(r.error)] = failures_by_error.get(error_class(r.error), 0) + 1
    for message, count in sorted(failures_by_error.items(), key=lambda kv: -kv[1])[:5]:
        lines.append(f"- in a window, {count} x: {message}")
    lines += ["", "## Recoveries", "", "| kill at s | /ready 503 after s | /ready 200 after s | window s |",
              "|---|---|---|---|"]
    for w in windows:
        not_ready = f"{w.not_ready_s - w.kill_s:.1f}" if w.not_ready_s is not None else "-"
        ready = f"{w.ready_s - w.kill_s:.1f}" if w.ready_s is not None else "not recovered"
        lines.append(f"| {w.kill_s:.1f} | {not_ready} | {ready} | {w.end_s - w.kill_s:.1f} |")
    lines += ["", f"/ready not 200 outside the windows: {len(unready_outside)} of the once-a-second polls."]
    lines += killer_errors
    lines += ["", "## Bad requests", "",
              f"{sum(a.bad_sent.values())} sent, {sum(a.bad_answered.values())} answered with their error, "
              f"**{len(a.bad_failed)} without it** outside the windows, {a.bad_in_window} in a window (not judged).",
              "", "| kind | transport | expected | sent | answered |", "|---|---|---|---|---|"]
    for name, kind in bad_kinds.items():
        expected = kind.code + (f" (HTTP {kind.expected_status})" if kind.transport == "http" else "")
        lines.append(f"| {name} | {kind.transport} | {expected} | {a.bad_sent.get(name, 0)} | "
                     f"{a.bad_answered.get(name, 0)} |")
    for r, verdict in a.bad_failed[:10]:
        lines.append(f"- {r.bad_kind}: {verdict} (status {r.status}): {error_class(r.error)}")
    lines += ["", "Over HTTP the class is the status (INVALID_ARG 400, NOT_FOUND 404); over a gRPC stream Triton "
              "sends the message only, and the class is told by the text only that error holds. A message must "
              "not echo the bad value.", "",
              f"## Processes (flat after {s.settle_s / 60:g} minutes)", "",
              f"Sampled every {s.sample_every_s:g} s. The slope is a least-squares line over the samples at least "
              f"{s.settle_s / 60:g} minutes after both the traffic's start and the process's own start, outside the "
              "recovery windows, with one intercept per process (a stub started by a recovery continues its "
              "role); \"at settle\" is the first sample at or after that time, \"max after\" the largest after it. "
              "Tolerances per 10 minutes: "
              + "; ".join(f"{m}: {t.describe(m)}" for m, t in TOLERANCES.items()) + ".", ""]
    lines += flatness_table(rows)
    if brief:
        lines += ["", f"Seen only before {s.settle_s / 60:g} minutes (not judged): {', '.join(brief)}."]
    held_text = ", ".join(f"{k} {v:g}" for k, v in held.items())
    lines += ["", f"lora_adapter sequences after the traffic stopped: {held_text}; processes of the stack alive "
              f"after the stop: {len(left)}.", ""]
    return "\n".join(lines) + "\n"
