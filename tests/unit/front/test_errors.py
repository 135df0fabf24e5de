import pytest

from tests.front_bad_requests import BAD_REQUESTS
from warmup_tools.front.engine.engine import EngineError


@pytest.mark.parametrize("name, method, path, body, status", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_each_bad_request_gets_a_clear_openai_error(client, engine, name, method, path, body, status):
    response = client.request(method, path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert engine.requests == []
    # and the front serves the next request
    ok = client.post("/v1/chat/completions", json={"model": "base", "messages": [{"role": "user", "content": "x"}]})
    assert ok.status_code == 200


def test_there_are_at_least_thirty_kinds():
    assert len(BAD_REQUESTS) >= 30


@pytest.mark.parametrize("kind, status", [("invalid", 400), ("not_found", 404), ("busy", 429), ("unavailable", 503),
                                          ("timeout", 504), ("internal", 500), ("unauthenticated", 401)])
def test_engine_refusals_map_to_their_status(client, engine, kind, status):
    engine.error = EngineError(kind, "the engine's reason")
    body = {"model": "base", "messages": [{"role": "user", "content": "x"}], "stream": True}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == status
    # A refusal of the request (a model's own message) reaches the client; a failure on the server's side does not:
    # tritonserver's text names its instances and models.
    server_side = status in (401, 500, 503, 504)
    assert ("the engine's reason" in response.text) is not server_side
    if not server_side:
        assert response.json()["error"]["message"] == "the engine's reason"


def test_tritonservers_text_of_a_failure_on_its_side_does_not_reach_the_client(client, engine):
    engine.error = EngineError("unavailable", "Stub process 'lora_adapter_0_0' is not healthy.")
    body = {"model": "base", "messages": [{"role": "user", "content": "x"}]}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 503 and "lora_adapter" not in response.text and "Stub" not in response.text
    assert "retry" in response.json()["error"]["message"]


def test_unknown_fields_are_ignored(client):
    body = {"model": "base", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 1, "tools": [],
            "response_format": {"type": "text"}, "some_future_field": {"a": 1}}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
