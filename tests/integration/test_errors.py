"""Every bad request gets a clear per-request error, and the next good request still succeeds."""

from __future__ import annotations

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from warmup_tools.ops.client import GenerateError, GenerateParams, http_generate

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
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    errors = []
    client.start_stream(callback=lambda result, error: errors.append(error))
    try:
        max_tokens = grpcclient.InferInput("max_tokens", [1], "INT32")
        max_tokens.set_data_from_numpy(np.array([3], dtype=np.int32))
        with pytest.raises(Exception, match="missing required input.*text_input"):
            client.async_stream_infer("ensemble", [max_tokens])
            _wait_for(errors)
        errors.clear()
        wrong = grpcclient.InferInput("text_input", [1], "INT32")
        wrong.set_data_from_numpy(np.array([7], dtype=np.int32))
        with pytest.raises(Exception, match="(?i)data.?type|datatype|expected"):
            client.async_stream_infer("ensemble", [wrong])
            _wait_for(errors)
    finally:
        client.stop_stream()
        client.close()
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


def _wait_for(errors, timeout=60.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if errors and errors[0] is not None:
            raise errors[0]
        time.sleep(0.05)
    raise AssertionError("no error arrived")
