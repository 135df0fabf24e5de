"""The ensemble end to end through a real tritonserver: gRPC streaming, HTTP generate, warm-up."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import requests

from tests.waiting import HANG_S, wait_for
from warmup_tools.demo.prompts import SYSTEM_PROMPTS, demo_prompt
from warmup_tools.server.client import GenerateParams, http_generate, http_generate_stream, metric_sum, scrape_metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PROMPT = demo_prompt("support", "My invoice shows two charges for March, what should I do?")


def test_grpc_stream_sends_pieces_as_they_are_generated(grpc_client):
    result = grpc_client.generate(PROMPT, GenerateParams(max_tokens=12, adapter_id="support"))
    assert result.output_tokens >= 1
    assert len(result.pieces) == result.output_tokens  # one response per generated token
    assert result.text.strip()
    assert result.prompt_tokens > 100
    assert result.cached_tokens >= 0
    assert result.finish_reason in {"length", "stop"}
    assert result.ttft_s < result.total_s


def test_non_streaming_over_grpc_gives_one_response_with_the_same_text(grpc_client):
    params = GenerateParams(max_tokens=12, adapter_id="legal")
    streamed = grpc_client.generate(PROMPT, params, stream=True)
    whole = grpc_client.generate(PROMPT, params, stream=False)
    assert len(whole.pieces) == 1
    assert whole.text == streamed.text


def test_http_generate_and_generate_stream(triton):
    params = GenerateParams(max_tokens=10, adapter_id="sql")
    answer = http_generate(triton.http_url, PROMPT, params)
    assert answer["text_output"].strip()
    assert answer["output_tokens"] == 10 or answer["finish_reason"] == "stop"
    events = list(http_generate_stream(triton.http_url, PROMPT, params))
    assert len(events) == answer["output_tokens"]
    assert "".join(e["text_output"] for e in events) == answer["text_output"]


def test_http_generate_with_plain_curl_style_json(triton):
    body = {"text_input": "Hello there", "max_tokens": 4}
    response = requests.post(f"http://{triton.http_url}/v2/models/ensemble/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["model_name"] == "ensemble"


def test_adapters_change_the_output(grpc_client):
    outputs = {
        adapter: grpc_client.generate(PROMPT, GenerateParams(max_tokens=12, adapter_id=adapter)).text
        for adapter in (None, "support", "legal", "sql")
    }
    assert len(set(outputs.values())) == 4, outputs


def test_greedy_output_is_reproducible_and_seeded_sampling_too(grpc_client):
    greedy = GenerateParams(max_tokens=12, adapter_id="support")
    assert grpc_client.generate(PROMPT, greedy).text == grpc_client.generate(PROMPT, greedy).text
    sampled = GenerateParams(max_tokens=12, adapter_id="support", temperature=1.0, top_p=0.95, seed=1234)
    first = grpc_client.generate(PROMPT, sampled).text
    assert grpc_client.generate(PROMPT, sampled).text == first


def test_warmup_samples_ran_before_ready(triton):
    """Each composing model ran its model_warmup samples (one per demo adapter) before READY."""
    at_ready = triton.metrics_at_ready
    for model in ("tokenizer_cache", "embedding_cache"):
        assert metric_sum(at_ready, "warmup_cache_lookups_total", model=model, result="miss") == 3
        assert metric_sum(at_ready, "warmup_cache_entries", model=model) == 3
    for adapter in ("support", "legal", "sql"):
        assert metric_sum(at_ready, "warmup_generate_requests_total", model="lora_adapter", adapter=adapter) == 1


def test_first_request_for_a_warmed_prompt_hits_the_caches(triton, grpc_client):
    # NOTE: local hits are sent to /metrics together, and any miss sends them first: a unique prompt before
    # each scrape makes every count exact when it is read, without waiting for the periodic send.
    miss = GenerateParams(max_tokens=1)
    grpc_client.generate(f"a prompt no cache holds {uuid.uuid4()}", miss)
    before = scrape_metrics(triton.metrics_url)
    grpc_client.generate(SYSTEM_PROMPTS["legal"], GenerateParams(max_tokens=2, adapter_id="legal"))
    grpc_client.generate(f"a prompt no cache holds {uuid.uuid4()}", miss)
    after = scrape_metrics(triton.metrics_url)
    for model in ("tokenizer_cache", "embedding_cache"):
        hits = [metric_sum(m, "warmup_cache_lookups_total", model=model, result="hit") for m in (before, after)]
        assert hits[1] == hits[0] + 1, model


def test_first_live_request_after_warmup_reuses_the_warmed_system_prompt(triton):
    """The model_warmup samples pre-filled each adapter's system prompt into the KV prefix cache."""
    from warmup_tools.server.client import StreamingClient

    with StreamingClient(triton.grpc_url) as client:
        result = client.generate(demo_prompt("sql", "Orders per day last week?"),
                                 GenerateParams(max_tokens=2, adapter_id="sql"))
    assert result.cached_tokens >= 0.8 * (result.prompt_tokens - 20)
    assert result.cached_tokens % 16 == 0


def test_each_request_is_logged_off_the_request_path(triton, grpc_client):
    import json
    text = f"Request log check {uuid.uuid4().hex}"
    result = grpc_client.generate(text, GenerateParams(max_tokens=3, adapter_id="sql", tenant_id="globex"))
    path = triton.request_log_dir / "requests-lora_adapter_0_0.jsonl"
    found = wait_for(lambda: path.exists() and next(
        (json.loads(line) for line in path.read_text().splitlines() if text in line), None), "the request logged")
    assert found["prompt"] == text and found["tenant"] == "globex" and found["adapter"] == "sql"
    assert found["prompt_tokens"] == result.prompt_tokens and found["output_tokens"] == 3
    assert found["cached_tokens"] == result.cached_tokens and found["ttft_ms"] > 0


def test_a_direct_call_cannot_put_text_it_did_not_send_into_the_request_log(triton, grpc_client):
    """text_input beside unrelated input_ids (a direct call to lora_adapter) is logged without its text."""
    from tests.integration.test_errors import _stream_direct

    marker = f"Planted prompt {uuid.uuid4().hex}"
    error = _stream_direct(triton, "lora_adapter", {
        "input_ids": np.arange(5, 40, dtype=np.int32), "max_tokens": np.array([1], np.int32),
        "text_input": np.array([marker.encode()], dtype=object)})
    assert error is None
    probe = f"Request log check {uuid.uuid4().hex}"
    grpc_client.generate(probe, GenerateParams(max_tokens=1))  # logged after the direct call
    path = triton.request_log_dir / "requests-lora_adapter_0_0.jsonl"
    wait_for(lambda: path.exists() and probe in path.read_text(), "the probe logged after the direct call")
    text = path.read_text()
    assert probe in text and marker not in text


def test_concurrent_streams_are_batched_and_each_gets_the_text_it_gets_alone(triton, grpc_client):
    """The continuous scheduler batches concurrent requests (mixed adapters, one step each token);
    greedy output does not depend on what else runs."""
    import threading

    from warmup_tools.server.client import StreamingClient

    cases = [(adapter, demo_prompt(scope, f"Concurrency check {i}: what next?"))
             for i, (adapter, scope) in enumerate([("support", "support"), ("legal", "legal"), ("sql", "sql"),
                                                   (None, "support"), ("sql", "sql"), ("support", "support")])]

    # What requests add to the counters, not the totals of the whole session. NOTE: a step's metrics are
    # recorded after its responses went out: wait until the requests' last token is counted.
    def added(metrics, since, name, **labels):
        return (metric_sum(metrics, name, model="lora_adapter", **labels)
                - metric_sum(since, name, model="lora_adapter", **labels))

    def counted(since, tokens):
        metrics = scrape_metrics(triton.metrics_url)
        return metrics if added(metrics, since, "warmup_output_tokens_total") >= tokens else None

    initial = scrape_metrics(triton.metrics_url)
    alone = [grpc_client.generate(prompt, GenerateParams(max_tokens=10, adapter_id=adapter))
             for adapter, prompt in cases]
    tokens = sum(result.output_tokens for result in alone)
    before = wait_for(lambda: counted(initial, tokens), "the requests' tokens on /metrics")
    # NOTE: the test holds the batch open itself: a generation of 512 tokens (the longest a request may ask for)
    # runs beside them from its first token on, so they share steps with it whatever the threads' timing.
    held: list[object] = []
    holding = threading.Event()

    def hold():
        try:
            with StreamingClient(triton.grpc_url, timeout_s=HANG_S) as client:
                held.append(client.generate(PROMPT, GenerateParams(max_tokens=512, adapter_id="legal"),
                                            on_piece=lambda _: holding.set()))
        except Exception as exc:  # noqa: BLE001 - asserted below
            held.append(exc)
        finally:
            holding.set()

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(HANG_S) and not [h for h in held if isinstance(h, Exception)], held
    together: list[object] = [None] * len(cases)
    start = threading.Barrier(len(cases))

    def one(index):
        adapter, prompt = cases[index]
        with StreamingClient(triton.grpc_url, timeout_s=HANG_S) as client:
            start.wait()
            try:
                together[index] = client.generate(prompt, GenerateParams(max_tokens=10, adapter_id=adapter)).text
            except Exception as exc:  # noqa: BLE001 - asserted below
                together[index] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(cases))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG_S)
    holder.join(HANG_S)
    assert together == [result.text for result in alone]
    assert not isinstance(held[0], Exception), held

    metrics = wait_for(lambda: counted(before, tokens + held[0].output_tokens),
                       "the concurrent requests' tokens on /metrics")
    assert added(metrics, before, "warmup_output_tokens_total") == tokens + held[0].output_tokens
    assert added(metrics, before, "warmup_output_tokens_total", adapter="sql") == sum(
        result.output_tokens for (adapter, _), result in zip(cases, alone) if adapter == "sql")
    steps = added(metrics, before, "warmup_scheduler_steps_total")
    assert added(metrics, before, "warmup_scheduler_step_sequences_total") > steps  # some ran more than one sequence
