import json

from warmup_tools.demo.prompts import SYSTEM_PROMPTS, demo_prompt


def _events(response):
    return [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]


def test_a_chat_completion_renders_the_template_and_reports_usage(client, engine):
    body = {"model": "sql", "messages": [{"role": "system", "content": SYSTEM_PROMPTS["sql"]},
                                         {"role": "user", "content": "Revenue per region?"}],
            "max_completion_tokens": 8, "temperature": 0.5, "seed": 3, "user": "acme"}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "Hello world"}
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"] == {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43,
                               "prompt_tokens_details": {"cached_tokens": 32}}
    sent = engine.requests[0]
    # The same prompt a raw request of the demo builds: one KV prefix for chat and raw traffic.
    assert sent.prompt == demo_prompt("sql", "Revenue per region?")
    assert (sent.adapter, sent.tenant, sent.sampling) == ("sql", "acme", {"max_tokens": 8, "temperature": 0.5,
                                                                         "seed": 3})
    system_end = len(SYSTEM_PROMPTS["sql"])
    assert sent.roles == (("system", 0, system_end), ("user", system_end, len(sent.prompt)))


def test_a_streamed_chat_completion_is_openai_chunks_then_usage_then_done(client):
    body = {"model": "base", "messages": [{"role": "user", "content": "Hi"}], "stream": True,
            "stream_options": {"include_usage": True}}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = _events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "Hello world"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)


def test_a_stop_string_cuts_the_text_and_ends_the_generation(client, engine):
    engine.pieces = ["Hel", "lo", " wor", "ld", " again"]
    body = {"model": "base", "messages": [{"role": "user", "content": "Hi"}], "stop": ["o w"]}
    answer = client.post("/v1/chat/completions", json=body).json()
    assert answer["choices"][0]["message"]["content"] == "Hell"
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert engine.closed == 1


def test_a_stop_string_split_across_pieces_never_reaches_a_streaming_client(client, engine):
    engine.pieces = ["a <", "/en", "d> b"]
    body = {"model": "base", "messages": [{"role": "user", "content": "Hi"}], "stream": True, "stop": "</end>"}
    chunks = [json.loads(e) for e in _events(client.post("/v1/chat/completions", json=body))[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == "a "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_an_error_after_the_first_token_ends_the_stream_with_an_error_event(client, engine):
    from warmup_tools.front.engine.engine import EngineError

    engine.error, engine.error_after = EngineError("unavailable", "the stream to tritonserver failed; retry"), 1
    body = {"model": "base", "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    events = _events(client.post("/v1/chat/completions", json=body))
    assert events[-1] == "[DONE]"
    assert "retry" in json.loads(events[-2])["error"]["message"]


def test_developer_messages_render_as_system_and_content_parts_join(client, engine):
    body = {"model": "base", "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert engine.requests[0].prompt == "Be brief.\n\nUser: Hi there\nAssistant:"
    assert [role for role, _, _ in engine.requests[0].roles] == ["system", "user"]
