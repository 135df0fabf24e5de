"""A client that goes away: a cancelled gRPC stream to ``lora_adapter`` leaves the running batch.

Through ``ensemble`` Triton 2.51 does not cancel a step that is already running (the ensemble scheduler
checks the parent request between steps only), so this is tested on ``lora_adapter`` itself, where the
gRPC frontend's cancellation reaches the request's response sender.
"""

from __future__ import annotations

import threading

import numpy as np
import tritonclient.grpc as grpcclient
from transformers import AutoTokenizer

from tests.waiting import HANG_S, wait_for_generation_to_leave
from warmup_tools.server.client import GenerateParams, metric_sum, scrape_metrics

MAX_TOKENS = 512  # lora_adapter's max_tokens_limit: a stream that ran to the end would produce all of them


def _tensor(name, array, dtype):
    tensor = grpcclient.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


def _one_response(triton, inputs):
    """The single response of a non-streaming request to the decoupled lora_adapter."""
    results = []
    done = threading.Event()
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: (results.append((result, error)), done.set()))
        client.async_stream_infer("lora_adapter", inputs)
        assert done.wait(HANG_S), f"no response within {HANG_S:g} s"
        client.stop_stream(cancel_requests=True)
    finally:
        client.close()
    result, error = results[0]
    assert error is None, error
    return result


def _legal_tokens(triton):
    return metric_sum(scrape_metrics(triton.metrics_url), "warmup_output_tokens_total", model="lora_adapter",
                      adapter="legal")


def test_a_cancelled_grpc_stream_leaves_the_batch_and_the_instance_keeps_serving(triton, grpc_client):
    tokenizer = AutoTokenizer.from_pretrained(triton.assets_dir / "lm")
    ids = np.array(tokenizer.encode("Tell me a very long story about a lighthouse."), dtype=np.int32)
    inputs = [_tensor("input_ids", ids, "INT32"),
              _tensor("max_tokens", np.array([MAX_TOKENS], dtype=np.int32), "INT32"),
              _tensor("stream", np.array([True]), "BOOL"),
              _tensor("adapter_id", np.array([b"legal"], dtype=np.object_), "BYTES")]
    # The same request, not cancelled, runs to max_tokens (no end-of-sequence token first): so a cancelled
    # stream that produced fewer tokens did stop because of the cancellation.
    whole = [t for t in inputs if t.name() != "stream"] + [_tensor("stream", np.array([False]), "BOOL")]
    assert int(_one_response(triton, whole).as_numpy("output_tokens")[0]) == MAX_TOKENS
    # NOTE: an instance counts its tokens on /metrics after they went out, at the latest once it falls idle, before
    # its next step: once a later request was answered, every token before it is counted.
    assert grpc_client.generate("Hello before a cancelled stream", GenerateParams(max_tokens=1)).output_tokens == 1
    tokens_before = _legal_tokens(triton)
    first = threading.Event()
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: first.set())
        client.async_stream_infer("lora_adapter", inputs)
        assert first.wait(HANG_S), f"no first token within {HANG_S:g} s"
        # NOTE: no wait for the stream to be seen running (it may be over before a scrape): it is cancelled at its
        # first token, with 511 steps still to run.
        client.stop_stream(cancel_requests=True)
    finally:
        client.close()
    wait_for_generation_to_leave(triton.metrics_url, "legal", tokens_before)
    result = grpc_client.generate("Hello after a cancelled stream", GenerateParams(max_tokens=4))
    assert result.output_tokens == 4  # served after it: the cancelled stream's every token is counted
    tokens = _legal_tokens(triton) - tokens_before
    assert 1 <= tokens < MAX_TOKENS, f"the cancelled stream ran {tokens} of its {MAX_TOKENS} tokens"
