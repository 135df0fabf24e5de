"""Requests that once froze a lora_adapter instance, against the real tritonserver: each gets a clear error,
and an ordinary request is served afterwards. The client timeouts are generous on purpose: the assertions
are about outcomes (an error, then a served request), not about how fast they come."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from tests.integration.test_errors import _stream_direct, _text
from warmup_tools.server.client import GenerateError, GenerateParams, http_generate

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

CLIENT_TIMEOUT_S = 600.0
CONCURRENT = 16
GOOD = GenerateParams(max_tokens=4, adapter_id="support")
#: A float32 subnormal: sampling's float32 logits / 1e-40 overflow to inf (once a sequence that held its slot
#: and KV forever while the scheduler spun).
DENORMAL = 1e-40


def _http_outcome(url, params):
    try:
        return None, http_generate(url, "Tell me a story about a lighthouse.", params, timeout_s=CLIENT_TIMEOUT_S)
    except GenerateError as exc:
        return exc, None


def test_concurrent_denormal_temperatures_through_the_ensemble_get_invalid_arg_then_a_request_is_served(triton):
    bad = GenerateParams(max_tokens=8, temperature=DENORMAL, top_p=0.9, seed=7)
    with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        outcomes = list(pool.map(lambda _: _http_outcome(triton.http_url, bad), range(CONCURRENT)))
    for error, result in outcomes:
        assert result is None and error is not None
        assert int(error.status) == 400, str(error)  # INVALID_ARG
        assert "'temperature' is out of range: use 0 (greedy) or 0.01 to 100" in str(error)
        assert "e-4" not in str(error)  # the value is not echoed
    error, result = _http_outcome(triton.http_url, GOOD)
    assert error is None, str(error)
    assert result["text_output"] and result["output_tokens"] >= 1


def _direct(triton, **extra):
    """One request straight to lora_adapter over a gRPC stream: its error, or None once it was served.

    NOTE: an error inside a gRPC stream carries Triton's message but not its code (``status()`` is None);
    the message is the request error's own, and the code is checked over HTTP through the ensemble."""
    inputs = {"input_ids": np.arange(5, 21, dtype=np.int32), "max_tokens": np.array([4], np.int32), **extra}
    return _stream_direct(triton, "lora_adapter", inputs, timeout=CLIENT_TIMEOUT_S)


def test_concurrent_denormal_temperatures_straight_to_lora_adapter_are_refused_then_a_request_is_served(triton):
    sampled = {"temperature": np.array([DENORMAL], np.float32), "top_p": np.array([0.9], np.float32)}
    with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
        errors = list(pool.map(lambda _: _direct(triton, **sampled), range(CONCURRENT)))
    for error in errors:
        assert error is not None
        assert "input 'temperature' is out of range: use 0 (greedy) or 0.01 to 100" in str(error), str(error)
    assert _direct(triton) is None  # an ordinary request: served to its final response


def test_a_2_mib_text_input_straight_to_lora_adapter_is_refused(triton):
    error = _direct(triton, text_input=_text(b"x" * (2 << 20)))
    assert error is not None
    assert "input 'text_input' is longer than 262144 bytes: send a shorter text" in str(error), str(error)
    assert _direct(triton, text_input=_text("Hello there")) is None
