"""``make demo``: start the repository, stream a few requests for two adapters, stop the server."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

from warmup_tools.ops.client import GenerateParams, StreamingClient
from warmup_tools.ops.config import ServeConfig
from warmup_tools.ops.server import ServerPorts, TritonServer
from warmup_tools.sim.demo_prompts import SYSTEM_PROMPTS, USER_QUESTIONS

LOGGER = logging.getLogger(__name__)


def demo_prompt(adapter: str, question: str) -> str:
    return f"{SYSTEM_PROMPTS[adapter]}User: {question}\nAssistant:"


def run_demo(config: ServeConfig, adapters: tuple[str, ...] = ("support", "legal"), max_tokens: int = 24,
             out: TextIO = sys.stdout) -> None:
    """Start tritonserver on free ports, stream requests for ``adapters``, print text, TTFT and cached_tokens."""
    server = TritonServer(config.model_repository, ports=ServerPorts.free(), env=config.server_env(),
                          log_path=config.log_file, log_verbose=config.log_verbose)
    out.write(f"starting tritonserver on {config.model_repository} (log: {server.log_path})\n")
    out.flush()
    with server:
        server.wait_ready(timeout=config.ready_timeout_s)
        out.write(f"ready: gRPC {server.grpc_url}, HTTP {server.http_url}\n")
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
        out.write("\nstopping tritonserver\n")
    out.write("server stopped; nothing left running\n")
