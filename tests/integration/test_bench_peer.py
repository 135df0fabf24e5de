"""bench peer's client and phases against the real OpenAI front (standing in for both servers: vLLM is not
installed in CI; its command line is checked in tests/unit/sim/test_peer.py)."""

from __future__ import annotations

import pytest

from warmup_tools.sim.bench.peer import OpenAIStreams, Prompts, measure
from warmup_tools.sim.bench.support.peer_servers import BASE

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def front_url(triton):
    from tests.conftest import REPO_ROOT
    from warmup_tools.front.server import FrontServer
    from warmup_tools.front.settings import FrontSettings

    settings = FrontSettings(port=0, triton_grpc_url=triton.grpc_url, triton_metrics_url=triton.metrics_url,
                             model_repository=REPO_ROOT / "model_repository")
    with FrontServer(settings, environ={"WARMUP_ASSETS_DIR": str(triton.assets_dir)}) as server:
        yield server.url


def test_a_streamed_completion_reports_its_tokens_and_a_warm_prefix(front_url, triton):
    prompts = Prompts(triton.assets_dir / "lm", seed=1)
    prefix = prompts.text(128)
    with OpenAIStreams(front_url) as client:
        cold = client.complete(BASE, f"{prefix} {prompts.text(16)}", 4)
        warm = client.complete(BASE, f"{prefix} {prompts.text(16)}", 4)
    assert cold.prompt_tokens >= 144 and cold.cached_tokens == 0
    assert warm.cached_tokens >= 96 and 0 < warm.ttft_ms <= warm.total_s * 1000
    assert cold.output_tokens == 4 and warm.output_tokens == 4  # ignore_eos


@pytest.mark.parametrize("model", [BASE, "sql"])
def test_every_phase_gives_every_figure_for_each_server(front_url, triton, model):
    prompts = Prompts(triton.assets_dir / "lm", seed=2)
    servers = {"project": OpenAIStreams(front_url), "vllm": OpenAIStreams(front_url)}
    try:
        figures = measure(servers, model, prompts, repeats=1, streams=2, stream_requests=1, max_tokens=4)
    finally:
        for client in servers.values():
            client.close()
    assert set(figures) == {"project", "vllm"}
    for f in figures.values():
        assert f.cold_ttft_ms > 0 and f.warm_ttft_ms > 0 and f.suffix_ttft_ms > 0
        assert f.one_stream_tps > 0 and f.streams_tps > 0 and f.streams_ttft_p95_ms > 0
    # The second server read the prefix the first one had just computed: the same front, warm for both.
    assert figures["project"].cached_tokens_warm > 0
