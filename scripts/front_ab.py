"""Two fronts against one tritonserver, A/B: ``python scripts/front_ab.py OTHER_CHECKOUT [ROUNDS] [PIPELINE]``.

Measures a change to the OpenAI front: the front of this checkout and the front of ``OTHER_CHECKOUT`` (another
clone or ``git worktree`` of the project, say at the commit before the change), each ``python -m warmup_tools
front`` in its own process (the other one run from its checkout, so that its package is the one imported), beside
one tritonserver (this checkout's demo repository and assets, one LM thread). Each round sends, one at a time and
in an order that alternates between rounds, a streamed ``/v1/completions`` of a warm demo prompt (adapter
``support``, one token) through each front and the same request to tritonserver's ``generate_stream``. It prints
each one's TTFT p50, each front's p50 less generate_stream's, and each front's CPU time per request (its process's
user and system time over the rounds). Figures: docs/benchmarks.md ("The front's added TTFT").
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from pathlib import Path

import httpx
from front_floor import PROMPT, first_event_ms  # scripts/, this script's folder

from warmup_tools.demo.assets import ensure_demo_assets
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.server.process import TritonServer
from warmup_tools.sim.bench.front import _front_process


def main(other: Path, rounds: int, pipeline: str) -> None:
    assets = ensure_demo_assets(REPO_ROOT / ".assets")
    env = {"WARMUP_ASSETS_DIR": str(assets.root), "WARMUP_CONTROL_DIR": "", "WARMUP_LM_THREADS": "1"}
    with TritonServer(REPO_ROOT / "model_repository", env=env) as server, httpx.Client(timeout=60) as client, \
            contextlib.ExitStack() as stack:
        server.wait_ready(timeout=600)
        fronts = {"this checkout": stack.enter_context(_front_process(server, Path(assets.root), pipeline)),
                  str(other): stack.enter_context(_front_process(server, Path(assets.root), pipeline, checkout=other))}
        ways = {name: (lambda url=front.url: first_event_ms(
                    client, f"{url}/v1/completions",
                    {"model": "support", "prompt": PROMPT, "max_tokens": 1, "stream": True},
                    lambda data: data["choices"] and data["choices"][0]["text"]))
                for name, front in fronts.items()}
        ways["generate_stream"] = lambda: first_event_ms(
            client, f"http://{server.http_url}/v2/models/ensemble/generate_stream",
            {"text_input": PROMPT, "max_tokens": 1, "stream": True, "adapter_id": "support"},
            lambda data: data.get("text_output"))
        for way in ways.values():  # one-off costs
            way(), way()
        times: dict[str, list[float]] = {name: [] for name in ways}
        cpu = {name: front.cpu_seconds() for name, front in fronts.items()}
        names = list(ways)
        for i in range(rounds):
            for name in names if i % 2 else names[::-1]:
                times[name].append(ways[name]())
        cpu = {name: (front.cpu_seconds() - cpu[name]) / rounds * 1000 for name, front in fronts.items()}
        base = statistics.median(times["generate_stream"])
        for name, values in times.items():
            p50 = statistics.median(values)
            line = f"{pipeline:9s} {name:40s} TTFT p50 {p50:6.2f} ms"
            if name in cpu:
                line += f" (added {p50 - base:+.2f} ms), CPU {cpu[name]:.2f} ms per request"
            print(line, flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 2 or not (Path(sys.argv[1]) / "warmup_tools").is_dir():
        sys.exit(__doc__.splitlines()[0])
    main(Path(sys.argv[1]).resolve(), int(sys.argv[2]) if len(sys.argv) > 2 else 100,
         sys.argv[3] if len(sys.argv) > 3 else "composing")
