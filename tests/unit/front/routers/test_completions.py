import json


def test_a_completion_passes_the_prompt_and_sampling_values_through(client, engine):
    body = {"model": "sql", "prompt": "SELECT", "max_tokens": 5, "top_p": 0.9, "seed": 7}
    answer = client.post("/v1/completions", json=body).json()
    assert answer["object"] == "text_completion"
    assert answer["choices"][0]["text"] == "Hello world"
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    sent = engine.requests[0]
    assert (sent.prompt, sent.adapter, sent.sampling, sent.roles) == (
        "SELECT", "sql", {"max_tokens": 5, "top_p": 0.9, "seed": 7}, ())


def test_a_streamed_completion_ends_with_usage_and_done(client):
    body = {"model": "base", "prompt": ["Hi"], "stream": True, "stream_options": {"include_usage": True}}
    events = [line[6:] for line in client.post("/v1/completions", json=body).text.splitlines()
              if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "Hello world"
    assert chunks[-1]["usage"]["completion_tokens"] == 3


def test_openai_default_of_16_tokens(client, engine):
    client.post("/v1/completions", json={"model": "base", "prompt": "x"})
    assert engine.requests[0].sampling == {"max_tokens": 16}


def test_a_sampling_input_of_the_engine_named_by_vllms_extra_parameter_goes_through(client, engine):
    body = {"model": "base", "prompt": "x", "repetition_penalty": 1.2, "ignore_eos": True}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert engine.requests[0].sampling == {"max_tokens": 16, "repetition_penalty": 1.2, "ignore_eos": True}
