"""Every bad request gets a clear per-request error, and the next good request still succeeds."""

from __future__ import annotations

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from warmup_tools.server.client import GenerateError, GenerateParams, http_generate

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

GOOD = GenerateParams(max_tokens=3, adapter_id="support")


def assert_still_serving(client):
    assert client.generate("Hello, are you still there?", GOOD).output_tokens >= 1


@pytest.mark.parametrize("text,params,match", [
    ("", GOOD, "empty"),
    ("   ", GOOD, "empty"),
    ("hello", GenerateParams(max_tokens=3, adapter_id="no-such-adapter"), "unknown adapter 'no-such-adapter'"),
    ("hello", GenerateParams(max_tokens=0), "max_tokens"),
    ("hello", GenerateParams(max_tokens=100000), "max_tokens"),
    ("hello", GenerateParams(max_tokens=3, temperature=-1.0), "temperature"),
    ("hello", GenerateParams(max_tokens=3, top_p=2.0), "top_p"),
    (b"\xff\xfe not utf-8", GOOD, "UTF-8"),
    ("hello", GenerateParams(max_tokens=3, top_p=0.0), "1 for no nucleus filtering"),
    ("hello", GenerateParams(max_tokens=3, top_k=-1), "top_k"),
    ("hello", GenerateParams(max_tokens=3, tenant_id="t" * 100_000), "tenant_id' is not a valid name"),
    ("hello", GenerateParams(max_tokens=3, tenant_id="acme\x00\nother"), "tenant_id' is not a valid name"),
    ("hello", GenerateParams(max_tokens=3, adapter_id="../adapters/support"), "adapter_id' is not a valid name"),
    ("x" * (300 << 10), GOOD, "longer than 262144 bytes"),
])
def test_bad_request_is_refused_and_server_keeps_serving(grpc_client, text, params, match):
    with pytest.raises(GenerateError, match=match):
        grpc_client.generate(text, params)
    assert_still_serving(grpc_client)


def test_prompt_longer_than_context_is_refused(grpc_client):
    long_prompt = "word " * 5000
    with pytest.raises(GenerateError, match="context"):
        grpc_client.generate(long_prompt, GOOD)
    assert_still_serving(grpc_client)


def test_missing_text_and_wrong_type_are_refused_by_triton(triton, grpc_client):
    import re

    from tritonclient.utils import InferenceServerException

    missing_text = r"missing required input\(s\) \[?'?text_input"
    wrong_type = r"input 'text_input' data-type is 'INT32', but model 'ensemble' expects 'BYTES'"
    # Over a gRPC stream the error carries Triton's message only (the stream has no status per response).
    missing = _stream_direct(triton, "ensemble", {"max_tokens": np.array([3], dtype=np.int32)})
    wrong = _stream_direct(triton, "ensemble", {"text_input": np.array([7], dtype=np.int32)})
    assert type(missing) is InferenceServerException and re.search(missing_text, missing.message()), missing
    assert type(wrong) is InferenceServerException and re.search(wrong_type, wrong.message()), wrong
    # Over HTTP the same refusal has its status: 400, Triton's INVALID_ARG.
    response = requests.post(f"http://{triton.http_url}/v2/models/ensemble/generate", json={"max_tokens": 3},
                             timeout=60)
    assert response.status_code == 400 and re.search(missing_text, response.json()["error"]), response.text
    assert_still_serving(grpc_client)


def test_http_errors_carry_a_status_and_message(triton):
    with pytest.raises(GenerateError, match="unknown adapter") as info:
        http_generate(triton.http_url, "hello", GenerateParams(max_tokens=3, adapter_id="nope"))
    assert 400 <= int(info.value.status) < 500
    with pytest.raises(GenerateError, match="max_tokens") as info:
        http_generate(triton.http_url, "hello", GenerateParams(max_tokens=0))
    assert int(info.value.status) == 400
    response = requests.post(f"http://{triton.http_url}/v2/models/ensemble/generate",
                             data=b"{not json", timeout=60)
    assert response.status_code >= 400 and "error" in response.json()
    assert http_generate(triton.http_url, "hello", GOOD)["text_output"] is not None


def test_a_lone_surrogate_through_triton_s_http_generate_is_refused_by_its_parser_and_triton_serves_on(triton):
    # JSON's "\ud800" escape not in a pair: a lone high surrogate never reaches a model, tritonserver's own JSON
    # parser (RapidJSON) refuses the body with its message and the status it gives every body it cannot parse (500
    # in 2.51, as for '{not json' above: Triton's, not the project's; the front answers 400 before Triton sees
    # it). A lone low surrogate passes that parser as its 3-byte encoding; the model's strict UTF-8 decode
    # (warmup_tools/triton/inputs.py) refuses it: 400.
    for body in (b'{"text_input": "a\\ud800b", "max_tokens": 3}',
                 b'{"text_input": "a", "max_tokens": 3, "tenant_id": "\\ud800"}'):
        response = requests.post(f"http://{triton.http_url}/v2/models/ensemble/generate", data=body, timeout=60)
        assert response.status_code >= 400, (body, response.text)
        assert "surrogate pair in string is invalid" in response.json()["error"], (body, response.text)
    for body in (b'{"text_input": "\\udfff", "max_tokens": 3}', b'{"text_input": "x\\udc00y", "max_tokens": 3}'):
        response = requests.post(f"http://{triton.http_url}/v2/models/ensemble/generate", data=body, timeout=60)
        assert response.status_code == 400, (body, response.text)
        assert "input 'text_input' is not valid UTF-8" in response.json()["error"], (body, response.text)
    assert http_generate(triton.http_url, "hello", GOOD)["text_output"] is not None


def _infer_direct(triton, model, inputs):
    """One request straight to a composing model (not through ``ensemble``), as any client may send."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(triton.http_url)
    try:
        tensors = []
        for name, value in inputs.items():
            dtype = "BYTES" if value.dtype == object else {"int32": "INT32", "int64": "INT64",
                                                            "float32": "FP32"}[str(value.dtype)]
            tensor = httpclient.InferInput(name, list(value.shape), dtype)
            tensor.set_data_from_numpy(value)
            tensors.append(tensor)
        return client.infer(model, tensors)
    finally:
        client.close()


def _text(value):
    return np.array([value.encode() if isinstance(value, str) else value], dtype=object)


@pytest.mark.parametrize("model,inputs,match", [
    ("embedding_cache", {"text_input": _text("hello"), "prompt_tokens": np.array([-1], dtype=np.int32)},
     "prompt_tokens'=-1 is out of range"),
    ("embedding_cache", {"text_input": _text("hello"), "tenant_id": _text("x" * 5000)}, "tenant_id' is not a valid"),
    ("embedding_cache", {"text_input": _text("hello"), "adapter_id": _text("sup port")}, "adapter_id' is not a valid"),
    ("tokenizer_cache", {"text_input": _text("hello"), "tenant_id": _text("a\nb")}, "tenant_id' is not a valid"),
    ("tokenizer_cache", {"text_input": _text("")}, "empty"),
])
def test_composing_models_called_directly_check_their_inputs(triton, grpc_client, model, inputs, match):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match=match):
        _infer_direct(triton, model, inputs)
    good = _infer_direct(triton, model, {"text_input": _text("Hello there, a good request.")})
    assert good.get_response()["outputs"]
    assert_still_serving(grpc_client)


def _stream_direct(triton, model, inputs, timeout=120.0):
    """One request straight to a decoupled model over a gRPC stream; its responses or its error."""
    import queue

    client = grpcclient.InferenceServerClient(triton.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        tensors = []
        for name, value in inputs.items():
            dtype = "BYTES" if value.dtype == object else {"int32": "INT32", "float32": "FP32"}[str(value.dtype)]
            tensor = grpcclient.InferInput(name, list(value.shape), dtype)
            tensor.set_data_from_numpy(value)
            tensors.append(tensor)
        client.async_stream_infer(model, tensors, enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=timeout)
            if error is not None:
                return error
            if result.get_response().parameters["triton_final_response"].bool_param:
                return None
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.parametrize("model", ["tokenizer_cache", "embedding_cache"])
def test_a_client_cannot_send_the_warmup_control_input(triton, grpc_client, model):
    from tritonclient.utils import InferenceServerException

    for plan in ("", "some-plan-id"):  # unpinned warm-up, or pinned under a plan
        with pytest.raises(InferenceServerException, match="'warmup_plan' is a control input"):
            _infer_direct(triton, model, {"text_input": _text("You are a contracts assistant."),
                                          "warmup_plan": _text(plan)})
    assert_still_serving(grpc_client)


def test_a_client_cannot_pin_or_unpin_kv_through_lora_adapter(triton, grpc_client):
    ids = np.arange(5, 69, dtype=np.int32)
    for plan in ("", "operator-plan", "another-plan"):
        error = _stream_direct(triton, "lora_adapter", {"input_ids": ids, "max_tokens": np.array([1], np.int32),
                                                        "warmup_plan": _text(plan)})
        assert error is not None and "'warmup_plan' is a control input" in str(error)
    assert _stream_direct(triton, "lora_adapter", {"input_ids": ids, "max_tokens": np.array([1], np.int32)}) is None
    assert_still_serving(grpc_client)


def test_a_client_cannot_set_how_long_kv_stays_pinned_through_lora_adapter(triton, grpc_client):
    ids = np.arange(5, 69, dtype=np.int32)
    retention = np.array([30 * 86400.0], np.float32)
    # Alone, or with a plan to pin under: refused, naming the first control input it carries.
    for extra, named in (({}, "warmup_retention_s"), ({"warmup_plan": _text("operator-plan")}, "warmup_plan")):
        error = _stream_direct(triton, "lora_adapter", {"input_ids": ids, "max_tokens": np.array([1], np.int32),
                                                        "warmup_retention_s": retention, **extra})
        assert error is not None and f"'{named}' is a control input" in str(error), error
    assert _stream_direct(triton, "lora_adapter", {"input_ids": ids, "max_tokens": np.array([1], np.int32)}) is None
    assert_still_serving(grpc_client)


def _ids(n=8, dtype=np.int32):
    return np.arange(5, 5 + n, dtype=dtype)


@pytest.mark.parametrize("extra,match", [
    ({"max_tokens": np.array([0], np.int32)}, "max_tokens"),
    ({"top_p": np.array([0.0], np.float32)}, "top_p"),
    ({"top_k": np.array([-3], np.int32)}, "top_k"),
    ({"temperature": np.array([np.nan], np.float32)}, "temperature"),
    ({"cluster_id": np.array([-7], np.int32)}, "cluster_id"),
    ({"tenant_id": _text("t" * 65)}, "tenant_id' is not a valid name"),
    ({"adapter_id": _text("a/b")}, "adapter_id' is not a valid name"),
    ({"adapter_id": _text("no-such-adapter")}, "unknown adapter 'no-such-adapter': send the name"),
    ({"input_ids": np.array([999_999], np.int32)}, "outside the vocabulary"),
    ({"input_ids": np.full(5000, 7, dtype=np.int32)}, "context"),
    ({"input_ids": np.array([[1, 2], [3, 4]], np.int32)}, "shape"),
    ({"text_input": _text(b"\xff\xfe")}, None),  # only logged when the request log is on: not an error here
])
def test_lora_adapter_called_directly_checks_every_input(triton, grpc_client, extra, match):
    error = _stream_direct(triton, "lora_adapter", {"input_ids": _ids(), "max_tokens": np.array([1], np.int32),
                                                    **extra})
    if match is None:
        assert error is None
    else:
        assert error is not None and match in str(error), str(error)
    assert _stream_direct(triton, "lora_adapter", {"input_ids": _ids(), "max_tokens": np.array([1], np.int32)}) is None
    assert_still_serving(grpc_client)


def test_a_models_error_kind_reaches_every_client_of_the_ensemble(triton, grpc_client):
    """What tritonserver 2.51 carries of a lora_adapter error inside the ensemble: the message, with the kind
    the model put first (common/wire.py), over the gRPC stream and over HTTP. The status is the kind's only
    for INVALID_ARG: HTTP answers a step's NOT_FOUND with 400 too, and the stream carries no code."""
    with pytest.raises(GenerateError) as streamed:
        grpc_client.generate("hello", GenerateParams(max_tokens=3, adapter_id="nope"))
    assert "[not_found] unknown adapter 'nope'" in str(streamed.value)
    with pytest.raises(GenerateError) as http:
        http_generate(triton.http_url, "hello", GenerateParams(max_tokens=3, adapter_id="nope"))
    assert "[not_found] unknown adapter 'nope'" in str(http.value) and int(http.value.status) == 400
    response = requests.post(f"http://{triton.http_url}/v2/models/ensemble/generate",
                             json={"text_input": "hello", "max_tokens": 3, "repetition_penalty": 0}, timeout=60)
    assert response.status_code == 400, response.text
    assert "[invalid] input 'repetition_penalty' is out of range: use 0.01 to 100" in response.json()["error"]
    assert_still_serving(grpc_client)
