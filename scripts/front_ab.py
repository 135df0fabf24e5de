"""Two fronts against one tritonserver, A/B: ``python scripts/front_ab.py OTHER_CHECKOUT [ROUNDS] [PIPELINE]``.

Measures a change to the OpenAI front: the front of this checkout and the front of ``OTHER_CHECKOUT`` (another
clone or ``git worktree`` of the project, say at the commit before the change), each ``python -m warmup_tools
front`` in its own process (the other one run from its checkout, so that its package is the one imported), beside
one tritonserver (this checkout's demo repository and assets, one LM thread). Each round sends, one at a time and
in an order that alternates between rounds, a streamed ``/v1/completions`` of a warm demo prompt (adapter
``support``, one token) through each front and the same request to tritonserver's ``generate_stream``. It prints
each one's TTFT p50, each front's p50 less generate_stream's, and each front's CPU time per request (its process's
user and system time over the rounds). Figures: docs/benchmarks.md ("The OpenAI front").
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from pathlib import Path

import httpx
from front_floor import (  # scripts/, this script's folder
    UNMEASURED_CALLS,
    front_ttft_ms,
    generate_stream_ttft_ms,
    interleaved,
)

from warmup_tools.demo.assets import ensure_demo_assets
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.server.process import TritonServer
from warmup_tools.sim.bench.support.servers import front_process


def main(other: Path, rounds: int, pipeline: str) -> None:
    assets = ensure_demo_assets(REPO_ROOT / ".assets")
    env = {"WARMUP_ASSETS_DIR": str(assets.root), "WARMUP_CONTROL_DIR": "", "WARMUP_LM_THREADS": "1"}
    with TritonServer(REPO_ROOT / "model_repository", env=env) as server, httpx.Client(timeout=60) as client, \
            contextlib.ExitStack() as stack:
        server.wait_ready(timeout=600)
        fronts = {"this checkout": stack.enter_context(front_process(server, Path(assets.root), pipeline)),
                  str(other): stack.enter_context(front_process(server, Path(assets.root), pipeline, checkout=other))}
        ways = {name: (lambda url=front.url: front_ttft_ms(client, url)) for name, front in fronts.items()}
        ways["generate_stream"] = lambda: generate_stream_ttft_ms(client, server.http_url)
        cpu = {name: front.cpu_seconds() for name, front in fronts.items()}
        times = interleaved(ways, rounds)
        requests = rounds + UNMEASURED_CALLS  # the CPU time covers the unmeasured calls too
        cpu = {name: (front.cpu_seconds() - cpu[name]) / requests * 1000 for name, front in fronts.items()}
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
