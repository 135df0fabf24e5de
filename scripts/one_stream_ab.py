"""One stream against two (or more) server configurations, in one run: ``python scripts/one_stream_ab.py CONFIGS [N]``.

``CONFIGS`` is a JSON object ``{"name": {"ENV_VAR": "value", ...}, ...}``: one tritonserver per name is started
side by side on the model repository (with the demo assets, no control folder, one LM thread), each with its
environment on top of those. After a warm-up request per scope on each, ``N`` requests (default 48) are sent one
at a time through ``ensemble`` to each server in turn, alternating the order (ABBA...), so both see the same
prompts and the same machine load. Per configuration: TTFT p50 and output tokens/s (all output tokens over the
requests' summed wall time), then each configuration against the first.

Example (fp against INT8 KV storage)::

    python scripts/one_stream_ab.py '{"a": {"WARMUP_KV_STORAGE": "fp"}, "b": {"WARMUP_KV_STORAGE": "int8"}}'
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

from warmup_tools.demo.prompts import demo_prompt
from warmup_tools.server.client import GenerateParams, StreamingClient
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.server.process import TritonServer
from warmup_tools.sim.bench.support.latency import SCOPES, stream_prompt

MAX_TOKENS = 32


def main(configs: dict[str, dict[str, str]], count: int, assets: Path) -> None:
    base = {"WARMUP_ASSETS_DIR": str(assets), "WARMUP_CONTROL_DIR": "", "WARMUP_LM_THREADS": "1"}
    with contextlib.ExitStack() as stack:
        clients = {}
        for name, env in configs.items():
            server = stack.enter_context(TritonServer(REPO_ROOT / "model_repository", env={**base, **env}))
            server.wait_ready(timeout=600)
            clients[name] = stack.enter_context(StreamingClient(server.grpc_url))
        for client in clients.values():
            for adapter, scope in SCOPES:
                client.generate(demo_prompt(scope, "warm-up"), GenerateParams(max_tokens=2, adapter_id=adapter))
        samples: dict[str, list[tuple[float, int, float]]] = {name: [] for name in clients}
        names = list(clients)
        for i in range(count):
            for name in names if i % 2 == 0 else names[::-1]:
                adapter, prompt = stream_prompt(0, i)
                start = time.perf_counter()
                result = clients[name].generate(prompt, GenerateParams(max_tokens=MAX_TOKENS, adapter_id=adapter))
                samples[name].append((result.ttft_s * 1000, result.output_tokens, time.perf_counter() - start))
    figures = {name: (statistics.median(r[0] for r in rows), sum(r[1] for r in rows) / sum(r[2] for r in rows))
               for name, rows in samples.items()}
    print(f"one stream, {count} requests per configuration, max_tokens {MAX_TOKENS}, alternating")
    first = names[0]
    for name, (ttft, tps) in figures.items():
        print(f"{name}: TTFT p50 {ttft:.1f} ms, output tokens/s {tps:.1f}; against {first}: tokens/s "
              f"x{tps / figures[first][1]:.3f}, TTFT p50 x{ttft / figures[first][0]:.3f}")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 48,
         Path(__file__).resolve().parents[1] / ".assets")
