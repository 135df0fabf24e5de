"""``bench peer --replay-traffic real``: this project and vLLM on a replay of real-text traffic, both warmed.

The same two days of traffic :mod:`warmup_tools.sim.bench.replay` builds (``real``: a log from public text): the
planner plans from day 1, and day 2's first hour is replayed in order (``max_tokens`` 1) through both servers'
OpenAI APIs, one request at a time, the servers alternated request by request.

- This project serves the repository with the plan's stanzas: its caches are warmed before it reports ready.
- vLLM is warmed as a user of vLLM would warm it: every prompt of the plan (its token ids, with its adapter) is
  sent once before the replay, so its prefix cache holds them. vLLM has no tenants: its cache is shared by every
  caller, where this project's blocks past a declared public prefix are private to their tenant (the replay sends
  each record's tenant in ``X-Tenant-Id``; vLLM ignores the header).

Printed: requests, the cold share (no prompt token from cache), the share of prompt tokens from cache, and TTFT p50
and p90 of each server, with vLLM's block size.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from warmup_tools.sim.bench.support.openai_stream import StreamError, stream_completion
from warmup_tools.sim.bench.support.peer_servers import BASE, project_server, vllm_server
from warmup_tools.sim.bench.support.workload import Served, WindowFigures, figures, prepare

#: Day 2's hours replayed.
REPLAY_HOURS = 1.0


def _complete(client: Any, model: str, prompt: str | list[int], tenant: str | None, ts: float = 0.0) -> Served:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    headers = {"X-Tenant-Id": tenant} if tenant else None
    try:
        streamed = stream_completion(client, "/v1/completions", body, headers)
    except StreamError as exc:
        raise RuntimeError(f"{client.base_url}: {exc}") from None
    ttft = streamed.ttft_s if streamed.ttft_s is not None else streamed.total_s
    return Served(ts, streamed.cached_tokens == 0, ttft * 1000, streamed.cached_tokens,
                  int(streamed.usage.get("prompt_tokens", 0)))


def run_replay(python: Path, assets_dir: Path, *, threads: int, max_num_seqs: int, traffic: str, seed: int,
               requests_per_day: int, logs: Path, out: TextIO, block_size: int = 0) -> dict[str, WindowFigures]:
    """Plan, start both servers, warm vLLM with the plan's prompts, replay; prints and returns the figures."""
    import httpx

    work = Path(tempfile.mkdtemp(prefix="bench-peer-replay-"))
    try:
        repos = prepare(work, assets_dir, seed=seed, requests_per_day=requests_per_day, out=out, traffic=traffic,
                        hours=REPLAY_HOURS)
        records = repos.first_hours
        started = time.perf_counter()
        with project_server(assets_dir, threads=threads, max_num_seqs=max_num_seqs,
                            repository=repos.with_plan) as project_url:
            project_ready_s = time.perf_counter() - started
            with vllm_server(python, assets_dir, lora=True, threads=threads, max_num_seqs=max_num_seqs,
                             log=logs / "vllm-replay.log", block_size=block_size) as vllm_url, \
                    httpx.Client(base_url=project_url, timeout=600) as project, \
                    httpx.Client(base_url=vllm_url, timeout=600) as vllm:
                started = time.perf_counter()
                for item in repos.plan.items:
                    _complete(vllm, item["adapter"] or BASE, list(item["token_ids"]), None)
                vllm_warm_s = time.perf_counter() - started
                out.write(f"replaying {len(records)} requests of day 2's first {REPLAY_HOURS:g} h ({traffic}); "
                          f"vLLM warmed with the plan's {len(repos.plan.items)} prompts in {vllm_warm_s:.1f} s, "
                          f"this project ready with its stanzas in {project_ready_s:.0f} s\n")
                out.flush()
                answers: dict[str, list[Served]] = {"project": [], "vllm": []}
                clients = {"project": project, "vllm": vllm}
                for index, record in enumerate(records):
                    order = ("project", "vllm") if index % 2 == 0 else ("vllm", "project")
                    for name in order:
                        answers[name].append(_complete(clients[name], record.adapter or BASE, record.prompt or "",
                                                       record.tenant, record.ts))
        results = {name: figures(name, served) for name, served in answers.items()}
        out.write(format_replay(results, traffic=traffic, block_size=block_size))
        out.flush()
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


def format_replay(results: dict[str, WindowFigures], *, traffic: str, block_size: int = 0) -> str:
    p, v = results["project"], results["vllm"]
    blocks = f"--block-size {block_size}" if block_size else "its default blocks (128 tokens on the CPU)"
    lines = [f"\nbench peer, replay ({traffic} text, day 2's first {REPLAY_HOURS:g} h, max_tokens 1, both warmed "
             f"with the plan): this project / vLLM with {blocks}",
             "| | this project | vLLM |", "|---|---|---|",
             f"| requests | {p.requests} | {v.requests} |",
             f"| cold share (no prompt token from cache) | {p.cold_share:.1%} | {v.cold_share:.1%} |",
             f"| prompt tokens from cache | {p.cached_share:.1%} | {v.cached_share:.1%} |",
             f"| TTFT p50 / p90, ms | {p.ttft_p50_ms:.0f} / {p.ttft_p90_ms:.0f} | "
             f"{v.ttft_p50_ms:.0f} / {v.ttft_p90_ms:.0f} |"]
    return "\n".join(lines) + "\n"
