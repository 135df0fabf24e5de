"""``python -m warmup_tools bench flood``: a flood of unique tenants and prompts stays within the budgets.

One run against the real server (open mode, so every request may name a new tenant): ``requests``
requests through ``ensemble`` (``max_tokens=1``), each with a unique 64-byte tenant and a unique
prompt. Before and after, the resident memory of every Python-backend stub (``/proc/<pid>/status``,
``VmRSS``), the number of series on ``/metrics``, and each model's cache bytes as it reports them.
The caches' budgets are the repository's (``cache_bytes`` of the tokenizer and embedding caches,
``kv_cache_bytes`` of lora_adapter); a flood should fill them and then evict, not grow the process.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Annotated, TextIO

from warmup_tools.common.settings import arg
from warmup_tools.server.client import GenerateParams, StreamingClient, scrape_metrics
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.server.process import TritonServer
from warmup_tools.sim.bench.support.params import Seed

MODELS = ("tokenizer_cache", "embedding_cache", "lora_adapter")
_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
          "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def stub_rss(server: TritonServer) -> dict[str, int]:
    """Resident bytes of each model's stub processes (``VmRSS`` of :meth:`TritonServer.stub_pids`)."""
    out: dict[str, int] = {}
    for model in MODELS:
        for pid in server.stub_pids(model):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            rss = next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0)
            out[model] = out.get(model, 0) + rss
    return out


def metric_figures(metrics_url: str) -> tuple[int, dict[str, float]]:
    """Series on /metrics, and the cache bytes each model reports."""
    samples = scrape_metrics(metrics_url, prefix="")
    cache = {}
    for (name, labels), value in samples.items():
        if name in ("warmup_cache_bytes", "warmup_kv_cache_bytes"):
            model = dict(labels).get("model", "?")
            cache[model] = cache.get(model, 0.0) + value
    return len(samples), cache


def run(assets_dir: Path, *, requests: Annotated[int, arg("requests, each with a new tenant and prompt")] = 10_000,
        seed: Seed = 0, out: TextIO = sys.stdout) -> None:
    rng = random.Random(seed)
    env = {"WARMUP_ASSETS_DIR": str(assets_dir), "WARMUP_CONTROL_DIR": ""}
    with TritonServer(REPO_ROOT / "model_repository", env=env) as server:
        server.wait_ready(timeout=1800)
        before_rss = stub_rss(server)
        before_series, before_cache = metric_figures(server.metrics_url)
        started = time.perf_counter()
        errors = 0
        with StreamingClient(server.grpc_url) as client:
            for i in range(requests):
                tenant = f"t{i:08d}-" + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(54))
                prompt = f"Request {i}: " + " ".join(rng.choice(_WORDS) for _ in range(40))
                try:
                    client.generate(prompt, GenerateParams(max_tokens=1, tenant_id=tenant))
                except Exception as exc:  # noqa: BLE001 (counted and reported, the flood goes on)
                    errors += 1
                    if errors <= 3:
                        out.write(f"  error on request {i}: {exc}\n")
                if (i + 1) % 2000 == 0:
                    rss = stub_rss(server)
                    out.write(f"  {i + 1} requests, {time.perf_counter() - started:.0f} s; stub RSS MiB: "
                              + ", ".join(f"{m} {rss.get(m, 0) / 2**20:.0f}" for m in MODELS)
                              + f"; /metrics series {metric_figures(server.metrics_url)[0]}\n")
                    out.flush()
        after_rss = stub_rss(server)
        after_series, after_cache = metric_figures(server.metrics_url)
    out.write(f"\n{requests} requests with unique 64-byte tenants and unique prompts, {errors} errors, "
              f"{time.perf_counter() - started:.0f} s\n\n| stub | RSS before MiB | RSS after MiB | growth MiB |\n"
              "|---|---|---|---|\n")
    for model in MODELS:
        b, a = before_rss.get(model, 0), after_rss.get(model, 0)
        out.write(f"| {model} | {b / 2**20:.0f} | {a / 2**20:.0f} | {(a - b) / 2**20:+.0f} |\n")
    out.write(f"\n/metrics series: {before_series} before, {after_series} after\n")
    for model in sorted(set(before_cache) | set(after_cache)):
        out.write(f"{model} cache bytes reported: {before_cache.get(model, 0) / 2**20:.1f} MiB before, "
                  f"{after_cache.get(model, 0) / 2**20:.1f} MiB after\n")
