"""A tenant over its share of an instance (lora_adapter's TenantBusyError) reaches an OpenAI client as 429
``rate_limit_error`` with code ``rate_limit_exceeded``, the model's own words and a Retry-After; a full instance stays
429 ``server_busy``."""

import pytest

from tests.unit.front.engine.test_triton_engine import sent
from warmup_tools.common.errors import ServerBusyError, TenantBusyError
from warmup_tools.common.wire import ErrorKind
from warmup_tools.front.engine.triton_engine import classify, engine_error
from warmup_tools.front.generation import openai_error

TENANT_LIMIT = ("too many concurrent requests from this tenant: it already has 12 requests on this instance, its "
                "share (8 running, 4 waiting); wait for some of them to finish before sending more, or lower your "
                "concurrency")


def test_a_tenants_limit_has_its_own_kind_over_triton_and_through_the_ensemble():
    message = sent(TenantBusyError(TENANT_LIMIT))
    assert message.startswith("in ensemble 'ensemble', [rate_limited] ")
    assert classify(message) is ErrorKind.RATE_LIMITED
    assert classify(message, "StatusCode.UNAVAILABLE") is ErrorKind.RATE_LIMITED  # Triton's code is UNAVAILABLE
    assert classify(sent(ServerBusyError("server busy: retry later"))) is ErrorKind.BUSY


@pytest.mark.parametrize("exc, code", [(TenantBusyError(TENANT_LIMIT), "rate_limit_exceeded"),
                                       (ServerBusyError("server busy: retry later"), "server_busy")])
def test_both_refusals_are_429_rate_limit_errors_with_their_own_code(exc, code):
    error = openai_error(engine_error(sent(exc)))
    assert error.status == 429 and error.code == code and error.message == str(exc)
    body = error.body()["error"]
    assert body["type"] == "rate_limit_error" and body["code"] == code


@pytest.mark.parametrize("stream", [True, False])
def test_the_client_gets_429_with_retry_after_and_the_front_serves_the_next_request(client, engine, stream):
    engine.error = engine_error(sent(TenantBusyError(TENANT_LIMIT)))
    body = {"model": "base", "messages": [{"role": "user", "content": "x"}], "stream": stream}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 429 and response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert error == {"message": TENANT_LIMIT, "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}
    engine.error = None
    assert client.post("/v1/chat/completions", json=body).status_code == 200
