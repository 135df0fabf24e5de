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
    if status not in (401, 500):
        assert response.json()["error"]["message"] == "the engine's reason"
    assert "the engine's reason" not in response.text or status not in (401, 500)


def test_unknown_fields_are_ignored(client):
    body = {"model": "base", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 1, "tools": [],
            "response_format": {"type": "text"}, "some_future_field": {"a": 1}}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
