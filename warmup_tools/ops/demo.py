"""``make demo``: start the repository, stream a few requests for two adapters, stop the server."""

from __future__ import annotations

import json
import logging
import sys
import time
import urllib.request
from pathlib import Path
from typing import Annotated, Any, TextIO

from warmup_tools.common.settings import arg
from warmup_tools.demo.prompts import SYSTEM_PROMPTS, USER_QUESTIONS, demo_prompt
from warmup_tools.server.client import GenerateParams, StreamingClient
from warmup_tools.server.config import ServeConfig
from warmup_tools.server.process import RepositoryKey, ServerPorts, TritonServer

LOGGER = logging.getLogger(__name__)

#: The docs/serving.md section that says how to serve a real model and real adapters instead of the demo assets.
REAL_MODEL_SECTION = "Point the repository at a real model and adapters"


def lm_note(config: ServeConfig) -> str:
    """What the demo's LM is, and where to read how to serve a real one (printed before the requests)."""
    return (f"note: the demo LM ({Path(config.assets_dir) / 'lm'}) has random weights, so its text is noise by "
            "design; what the demo shows is TTFT and cached_tokens.\n"
            f'      to serve a real model and adapters: docs/serving.md, "{REAL_MODEL_SECTION}" '
            "(WARMUP_ASSETS_DIR or the config.pbtxt parameters)\n")


def run_demo(config: ServeConfig, adapters: tuple[str, ...] = ("support", "legal"),
             max_tokens: Annotated[int, arg("tokens generated per demo request")] = 24,
             out: TextIO = sys.stdout) -> None:
    """Start tritonserver on free ports, stream requests for ``adapters``, print text, TTFT and cached_tokens."""
    from warmup_tools.sidecar.app import Sidecar
    from warmup_tools.sidecar.config import SidecarConfig

    # As `warmup_tools sidecar` runs it: explicit model control, the repository API restricted to the sidecar.
    server = TritonServer(config.model_repository, ports=ServerPorts.free(), env=config.server_env(),
                          log_path=config.log_file, log_verbose=config.log_verbose, explicit_model_control=True,
                          repository_key=RepositoryKey.generate())
    out.write(f"starting tritonserver on {config.model_repository} (log: {server.log_path})\n")
    out.flush()
    with server, Sidecar(SidecarConfig(port=0, probe_interval_s=1.0), server.http_url, server.grpc_url,
                         server.repository_key, config.model_repository, control_dir=config.control_dir) as sidecar:
        server.wait_ready(timeout=config.ready_timeout_s)
        out.write(f"ready: gRPC {server.grpc_url}, HTTP {server.http_url}; sidecar {sidecar.url}\n")
        _show_sidecar(sidecar, out)
        out.write("\n" + lm_note(config))
        with StreamingClient(server.grpc_url) as client:
            for adapter in adapters:
                for question in USER_QUESTIONS[adapter]:
                    out.write(f"\n[{adapter}] {question}\n  -> ")
                    out.flush()

                    def show(piece: str) -> None:
                        out.write(piece.replace("\n", "\n     "))
                        out.flush()

                    result = client.generate(
                        demo_prompt(adapter, question),
                        GenerateParams(max_tokens=max_tokens, adapter_id=adapter),
                        on_piece=show,
                    )
                    out.write(
                        f"\n  TTFT {result.ttft_s * 1000:.1f} ms, cached_tokens {result.cached_tokens}"
                        f"/{result.prompt_tokens} prompt tokens, {result.output_tokens} tokens in "
                        f"{result.total_s * 1000:.0f} ms ({result.finish_reason})\n"
                    )
        _show_sidecar(sidecar, out)
        _chat_through_the_front(config, server, sidecar.url, out)
        out.write("\nstopping tritonserver\n")
    out.write("server stopped; nothing left running\n")


def _show_sidecar(sidecar: Any, out: TextIO, timeout_s: float = 60.0) -> None:
    """Print the sidecar's /status once it has probed every model (what a readinessProbe would see)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"{sidecar.url}/status", timeout=5) as response:
            status = json.loads(response.read())
        probed = all(m["last_probe"] is not None for m in status["models"].values())
        if (probed and status["ready"]) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    models = ", ".join(
        f"{name} {m['state']}" + (f" ({m['last_probe']['latency_ms']:.0f} ms)" if m["last_probe"] else "")
        for name, m in status["models"].items())
    out.write(f"\nsidecar /ready: {'200' if status['ready'] else '503 ' + status['reason']}; {models}; "
              f"{sum(m['recoveries'] for m in status['models'].values())} recoveries\n")
    for instance, entry in dict(status.get("coverage", {}).get("instances") or {}).items():
        coverage = ", ".join(f"{name} {c['resident']}/{c['planned']}" for name, c in entry["adapters"].items())
        out.write(f"  warm coverage on {instance} ({entry['source']}): {coverage or '-'}\n")
    out.flush()


def _chat_through_the_front(config: ServeConfig, server: TritonServer, sidecar_url: str, out: TextIO,
                            adapter: str = "support") -> None:
    """One chat completion streamed through the OpenAI front with the ``openai`` SDK, and its usage."""
    import os

    import openai

    from warmup_tools.front.server import FrontServer
    from warmup_tools.front.settings import FrontSettings

    for name in ("httpx", "httpx2"):  # the SDK's per-request log lines
        logging.getLogger(name).setLevel(logging.WARNING)
    settings = FrontSettings(port=0, triton_grpc_url=server.grpc_url, triton_metrics_url=server.metrics_url,
                             sidecar_url=sidecar_url, model_repository=config.model_repository)
    with FrontServer(settings, environ={**os.environ, **config.server_env()}) as front, \
            openai.OpenAI(base_url=f"{front.url}/v1", api_key="open-mode", max_retries=0) as client:
        question = USER_QUESTIONS[adapter][1]
        models = ", ".join(model.id for model in client.models.list())
        # NOTE: the SDK imports its streaming and chat modules on first use: a one-token request first, so the
        # TTFT shown is the server's and the network's, not the SDK's start-up.
        client.chat.completions.create(model=adapter, max_tokens=1, messages=[{"role": "user", "content": "Hi"}])
        out.write(f"\nOpenAI front {front.url}/v1 (models: {models}); the openai SDK, model {adapter!r}: "
                  f"{question}\n  -> ")
        out.flush()
        started = time.perf_counter()
        ttft = None
        usage = None
        stream = client.chat.completions.create(
            model=adapter, max_tokens=16, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "system", "content": SYSTEM_PROMPTS[adapter]}, {"role": "user", "content": question}])
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft if ttft is not None else time.perf_counter() - started
                out.write(chunk.choices[0].delta.content.replace("\n", "\n     "))
                out.flush()
            if chunk.usage is not None:
                usage = chunk.usage
        if usage is not None:
            out.write(f"\n  TTFT {(ttft or 0) * 1000:.1f} ms; usage: prompt_tokens {usage.prompt_tokens}, "
                      f"completion_tokens {usage.completion_tokens}, prompt_tokens_details.cached_tokens "
                      f"{usage.prompt_tokens_details.cached_tokens}\n")

