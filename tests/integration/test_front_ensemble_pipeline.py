"""The OpenAI front's two pipelines over one real tritonserver: ``ensemble`` (one stream to ``ensemble``) answers
what the default ``composing`` (tokenizer_cache and embedding_cache, then a stream to ``lora_adapter``) answers:
the same greedy text, the same usage, the same errors."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.front_bad_requests import CHAT, ENGINE_BAD_REQUESTS
from tests.waiting import wait_for
from warmup_tools.demo.prompts import SYSTEM_PROMPTS
from warmup_tools.server.client import metric_sum, scrape_metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

PIPELINES = ("composing", "ensemble")


@pytest.fixture(scope="module")
def fronts(triton):
    """One front per pipeline, both on the session's tritonserver."""
    from tests.conftest import REPO_ROOT
    from warmup_tools.front.server import FrontServer
    from warmup_tools.front.settings import FrontSettings

    def front(pipeline: str) -> FrontServer:
        settings = FrontSettings(port=0, triton_grpc_url=triton.grpc_url, triton_metrics_url=triton.metrics_url,
                                 model_repository=REPO_ROOT / "model_repository", pipeline=pipeline,
                                 poll_interval_s=0.2)
        return FrontServer(settings, environ={"WARMUP_ASSETS_DIR": str(triton.assets_dir)})

    with front("composing") as composing, front("ensemble") as ensemble:
        assert (composing.settings.pipeline, ensemble.settings.pipeline) == PIPELINES
        yield {"composing": composing, "ensemble": ensemble}


@pytest.fixture()
def sdks(fronts):
    clients = {name: openai.OpenAI(base_url=f"{front.url}/v1", api_key="any key: open mode", max_retries=0)
               for name, front in fronts.items()}
    try:
        yield clients
    finally:
        for client in clients.values():
            client.close()


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_PROMPTS["legal"]}, {"role": "user", "content": question}]


def _chat(sdk: openai.OpenAI, question: str, max_tokens: int = 8, **options):
    return sdk.chat.completions.create(model="legal", messages=_messages(question), max_tokens=max_tokens, **options)


def _streamed(sdk: openai.OpenAI, question: str) -> tuple[str, str, dict]:
    chunks = list(_chat(sdk, question, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, reasons[-1], chunks[-1].usage.model_dump()


def _ensemble_requests(triton) -> float:
    """Requests tritonserver answered on the ``ensemble`` model."""
    return metric_sum(scrape_metrics(triton.metrics_url, prefix="nv_"), "nv_inference_request_success_total",
                      model="ensemble")


def test_a_chat_completion_is_the_same_through_the_ensemble(triton, sdks):
    question = "Which clause covers termination? (both pipelines, whole answer)"
    before = _ensemble_requests(triton)
    # NOTE: the first answer stores the whole prompt's blocks in lora_adapter's one instance, so the two compared
    # after it start from the same cache and report the same cached tokens.
    first = _chat(sdks["composing"], question)
    ensemble = _chat(sdks["ensemble"], question)
    composing = _chat(sdks["composing"], question)
    assert ensemble.choices[0].message.content == composing.choices[0].message.content \
        == first.choices[0].message.content != ""
    assert ensemble.choices[0].finish_reason == composing.choices[0].finish_reason == "length"
    assert ensemble.usage.model_dump() == composing.usage.model_dump()
    usage = ensemble.usage
    assert usage.completion_tokens == 8 and usage.prompt_tokens == first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens > 0  # the system prompt, warmed before READY
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16
    # The ensemble front's request went through the ensemble model.
    wait_for(lambda: _ensemble_requests(triton) > before, "a request counted on the ensemble model")


def test_a_streamed_chat_completion_is_the_same_through_the_ensemble(sdks):
    question = "Who may sign on the company's behalf? (both pipelines, streamed)"
    first = _streamed(sdks["composing"], question)
    ensemble = _streamed(sdks["ensemble"], question)
    composing = _streamed(sdks["composing"], question)
    assert ensemble == composing and ensemble[0] == first[0] != ""
    assert ensemble[1] == "length" and ensemble[2]["completion_tokens"] == 8
    # The streamed text is the text of the same request answered whole (greedy).
    assert _chat(sdks["ensemble"], question).choices[0].message.content == ensemble[0]


def _too_long(stream: bool) -> bytes:
    """A prompt over the demo LM's 2,048-token context: lora_adapter refuses it."""
    return json.dumps({"model": "legal", "messages": [{"role": "user", "content": "clause " * 3000}],
                       "max_tokens": 8, "stream": stream}).encode()


ERRORS = [*[(name, body, status) for name, _, path, body, status in ENGINE_BAD_REQUESTS if path == CHAT],
          ("a prompt over the context", _too_long(False), 400),
          ("a streamed prompt over the context", _too_long(True), 400),
          ("a streamed request over the engine's max_tokens", json.dumps(
              {"model": "base", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100_000,
               "stream": True}).encode(), 400)]


@pytest.mark.parametrize("name, body, status", ERRORS, ids=[case[0] for case in ERRORS])
def test_an_error_is_the_same_through_the_ensemble(fronts, sdks, name, body, status):
    answers = {}
    for pipeline, front in fronts.items():
        response = httpx.post(f"{front.url}{CHAT}", content=body, headers={"Content-Type": "application/json"},
                              timeout=120)
        answers[pipeline] = (response.status_code, response.json())
    assert answers["ensemble"] == answers["composing"], name
    assert answers["ensemble"][0] == status and answers["ensemble"][1]["error"]["message"], name
    # The ensemble serves after the error.
    assert _chat(sdks["ensemble"], "Hi", max_tokens=2).usage.completion_tokens == 2
