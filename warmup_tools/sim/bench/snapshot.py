"""``python -m warmup_tools bench snapshot``: restart to warm READY with a KV snapshot against without one.

One run, on a copy of the repository whose ``lora_adapter`` warm-up samples pin a hot set of
``prompts`` planned prompts (each an adapter's system prompt plus ~``prompt_tokens`` of seeded text,
under one plan id), with ``snapshot_dir`` set to an empty folder:

1. **cold start**: nothing to restore, so the warm-up samples compute every planned block (recompute).
   Then the planned prompts plus a question, and ``live`` prompts no sample carries, are sent (greedy,
   ``max_tokens`` tokens); the server stops, and ``finalize`` writes the snapshot.
2. **restart with the snapshot**: the instance restores (checks, recomputes a sample of blocks) before
   the samples run, which then find their prefixes cached. The same requests are sent again, the live
   prompts first (they are warm only through the snapshot); outputs must be identical.
3. **scale-out**: while the restarted server still runs, a second server starts on the same folder and
   sends the live prompts as its first requests (``cached_tokens`` > 0 expected).

The *warm-up phase* is read from the server log: from ``lora_adapter``'s "device ..." line (the engine
is loaded, the restore is next) to Triton's "successfully loaded 'lora_adapter'" (the samples ran). READY
is the wall time from starting tritonserver to ``/v2/health/ready``.
"""

from __future__ import annotations

import dataclasses
import datetime
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, TextIO

import numpy as np

from warmup_tools.common.errors import ServerError
from warmup_tools.common.settings import arg
from warmup_tools.demo.prompts import SYSTEM_PROMPTS
from warmup_tools.planning.stanzas import WarmupInput, WarmupSample, string_input, write_model_warmup
from warmup_tools.server.client import GenerateParams, StreamingClient, metric_sum, scrape_metrics
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.server.process import TritonServer
from warmup_tools.sim.bench.support.params import LmThreads, MaxTokens, Seed
from warmup_tools.sim.bench.support.text import make_text

ADAPTERS = ("support", "legal", "sql", None)
PLAN_ID = "bench-snapshot"
_STAMP = re.compile(r"^[IWE]\d{4} (\d\d):(\d\d):(\d\d\.\d+) ")


@dataclasses.dataclass(frozen=True, slots=True)
class Probe:
    text: str
    adapter: str | None
    planned: bool


@dataclasses.dataclass(slots=True)
class RunResult:
    label: str
    ready_s: float
    warmup_s: float
    restored_blocks: float = 0.0
    skipped: float = 0.0
    #: Probe index -> (text, cached_tokens).
    outputs: dict[int, tuple[str, int]] = dataclasses.field(default_factory=dict)


def run(assets_dir: Path, *, prompts: Annotated[int, arg("planned prompts of the hot set")] = 32,
        prompt_tokens: Annotated[int, arg("tokens of each planned prompt")] = 640,
        live: Annotated[int, arg("planned and live-only prompts sent after READY")] = 4,
        max_tokens: MaxTokens = 16,
        seed: Seed = 0,
        lm_threads: LmThreads = 1,
        out: TextIO = sys.stdout) -> dict[str, object]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets_dir / "lm")
    rng = random.Random(seed)
    planned = [(ADAPTERS[i % len(ADAPTERS)], make_text(tokenizer, prompt_tokens, rng)) for i in range(prompts)]
    texts = [(adapter, (SYSTEM_PROMPTS[adapter] if adapter else "") + body) for adapter, body in planned]
    probes = [Probe(text + " Question: what is the next step?", adapter, True) for adapter, text in texts[:live]]
    probes += [Probe("Report: " + make_text(tokenizer, prompt_tokens // 2, rng), ADAPTERS[i % len(ADAPTERS)], False)
               for i in range(live)]
    ids = [tokenizer.encode(text, add_special_tokens=True) for _, text in texts]
    with tempfile.TemporaryDirectory(prefix="bench-snapshot-") as tmp:
        root = Path(tmp)
        repo = root / "repo"
        shutil.copytree(REPO_ROOT / "model_repository", repo)
        write_model_warmup(repo / "lora_adapter", [
            WarmupSample(f"hot_{i:04d}", tuple(
                [WarmupInput("input_ids", "TYPE_INT32", np.asarray(token_ids, dtype=np.int32)),
                 string_input("tenant_id", "default"),
                 WarmupInput("max_tokens", "TYPE_INT32", np.array([1], dtype=np.int32)),
                 string_input("warmup_plan", PLAN_ID)]
                + ([string_input("adapter_id", adapter)] if adapter else [])))
            for i, ((adapter, _), token_ids) in enumerate(zip(texts, ids))])
        snapshots = root / "snapshots"
        env = {"WARMUP_ASSETS_DIR": str(Path(assets_dir).resolve()), "WARMUP_CONTROL_DIR": "",
               "WARMUP_SNAPSHOT_DIR": str(snapshots), "WARMUP_SNAPSHOT_INTERVAL_S": "0",
               "WARMUP_SNAPSHOT_BYTES": str(512 << 20), "WARMUP_LM_THREADS": str(lm_threads)}
        tokens = sum(len(t) for t in ids)
        print(f"hot set: {prompts} planned prompts over {len(ADAPTERS)} scopes, {tokens} tokens "
              f"({tokens // 16} blocks of 16); {live} planned and {live} live-only probe prompts, "
              f"max_tokens {max_tokens}", file=out, flush=True)

        cold = _serve(repo, env, root / "run1", "cold start (recompute)", probes, live_first=False,
                      max_tokens=max_tokens)
        manifests = sorted(snapshots.glob("*.manifest.json"))
        payload = sum(p.stat().st_size for p in snapshots.glob("*.safetensors"))
        print(f"snapshot written at shutdown: {len(manifests)} manifest(s), {payload / 2**20:.1f} MiB payload",
              file=out, flush=True)
        restarted, scaled = _serve(repo, env, root / "run2", "restart with snapshot", probes, live_first=True,
                                   max_tokens=max_tokens, scale_out=root / "run3")

    same = sum(cold.outputs[i][0] == restarted.outputs[i][0] for i in range(len(probes)))
    live_indices = [i for i, p in enumerate(probes) if not p.planned]
    print("\n| run | READY s | warm-up phase s | restored blocks | snapshots skipped |", file=out)
    print("|---|---|---|---|---|", file=out)
    for result in (cold, restarted, scaled):
        print(f"| {result.label} | {result.ready_s:.1f} | {result.warmup_s:.2f} | {result.restored_blocks:.0f} | "
              f"{result.skipped:.0f} |", file=out)
    ratio = cold.warmup_s / restarted.warmup_s if restarted.warmup_s > 0 else float("inf")
    print(f"\nwarm-up phase: {cold.warmup_s:.2f} s recompute vs {restarted.warmup_s:.2f} s with the snapshot: "
          f"x{ratio:.1f} faster (goal >= 5); READY {cold.ready_s:.1f} s vs {restarted.ready_s:.1f} s", file=out)
    print(f"greedy outputs identical after the restore: {same} of {len(probes)}", file=out)
    print(f"live-only prompts' cached_tokens: cold start {[cold.outputs[i][1] for i in live_indices]}, restart "
          f"(its first requests) {[restarted.outputs[i][1] for i in live_indices]}", file=out)
    print(f"scale-out: second server's first requests (live-only prompts) cached_tokens: "
          f"{[scaled.outputs[i][1] for i in live_indices]}; outputs identical "
          f"{sum(scaled.outputs[i][0] == cold.outputs[i][0] for i in live_indices)} of {len(live_indices)}",
          file=out, flush=True)
    return {"cold": cold, "restarted": restarted, "scale_out": scaled, "ratio": ratio, "identical": same}


def _serve(repo: Path, env: dict[str, str], work: Path, label: str, probes: list[Probe], *, live_first: bool,
           max_tokens: int, scale_out: Path | None = None):
    live = [i for i, p in enumerate(probes) if not p.planned]
    order = live + [i for i in range(len(probes)) if i not in live] if live_first else list(range(len(probes)))
    server = TritonServer(repo, env=env, work_dir=work)
    start = time.monotonic()
    server.start()
    try:
        server.wait_ready(timeout=900)
        result = RunResult(label, time.monotonic() - start, _warmup_seconds(server.logs()))
        _record(server, result, probes, order, max_tokens)
        if scale_out is None:
            return result
        second = TritonServer(repo, env=env, work_dir=scale_out)
        begin = time.monotonic()
        second.start()
        try:
            second.wait_ready(timeout=900)
            scaled = RunResult("scale-out: second server, same folder", time.monotonic() - begin,
                               _warmup_seconds(second.logs()))
            _record(second, scaled, probes, live, max_tokens)
        finally:
            second.stop(timeout=120)
        return result, scaled
    finally:
        server.stop(timeout=120)


def _record(server: TritonServer, result: RunResult, probes: list[Probe], order: list[int],
            max_tokens: int) -> None:
    with StreamingClient(server.grpc_url, timeout_s=300) as client:
        for index in order:
            probe = probes[index]
            reply = client.generate(probe.text, GenerateParams(max_tokens=max_tokens, adapter_id=probe.adapter))
            result.outputs[index] = (reply.text, reply.cached_tokens)
    samples = scrape_metrics(server.metrics_url)
    result.restored_blocks = metric_sum(samples, "warmup_kv_snapshot_restored_blocks_total")
    result.skipped = metric_sum(samples, "warmup_kv_snapshot_skipped_total")


def _warmup_seconds(log: str) -> float:
    """Seconds from lora_adapter's "device" line to Triton's "successfully loaded 'lora_adapter'"."""
    begin = end = None
    for line in log.splitlines():
        if begin is None and "lora_adapter: device" in line:
            begin = _stamp(line)
        elif begin is not None and "successfully loaded 'lora_adapter'" in line:
            end = _stamp(line)
            break
    if begin is None or end is None:
        raise ServerError("the server log lacks lora_adapter's start or load line; cannot time the warm-up phase")
    return (end - begin).total_seconds() % 86400


def _stamp(line: str) -> datetime.timedelta:
    match = _STAMP.match(line)
    if match is None:
        raise ServerError(f"no timestamp in the log line {line[:80]!r}")
    hours, minutes, seconds = match.groups()
    return datetime.timedelta(hours=int(hours), minutes=int(minutes), seconds=float(seconds))
