"""Bad requests to the OpenAI front, each with the status it must get: the unit tests send them to a front
over a scripted engine, the integration test to one over a real tritonserver (then the server must serve)."""

from __future__ import annotations

import json

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Hi"}]


def _chat(**fields):
    return json.dumps({"model": "base", "messages": USER, **fields}).encode()


def _completion(**fields):
    return json.dumps({"model": "base", "prompt": "Hi", **fields}).encode()


#: (name, method, path, body bytes, status)
BAD_REQUESTS: list[tuple[str, str, str, bytes, int]] = [
    ("malformed JSON", "POST", CHAT, b'{"model": "base", "messages": [', 400),
    ("body is a list", "POST", CHAT, b"[1, 2]", 400),
    ("empty body", "POST", CHAT, b"", 400),
    ("not UTF-8", "POST", CHAT, b'{"model": "\xff\xfe"}', 400),
    ("deeply nested JSON", "POST", CHAT, b'{"model": "base", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     400),
    ("model missing", "POST", CHAT, json.dumps({"messages": USER}).encode(), 400),
    ("model is a number", "POST", CHAT, _chat(model=123), 400),
    ("messages missing", "POST", CHAT, json.dumps({"model": "base"}).encode(), 400),
    ("messages empty", "POST", CHAT, _chat(messages=[]), 400),
    ("messages is a string", "POST", CHAT, _chat(messages="Hi"), 400),
    ("message without role", "POST", CHAT, _chat(messages=[{"content": "Hi"}]), 400),
    ("bad role", "POST", CHAT, _chat(messages=[{"role": "wizard", "content": "Hi"}]), 400),
    ("tool role", "POST", CHAT, _chat(messages=[{"role": "tool", "content": "Hi"}]), 400),
    ("content is a number", "POST", CHAT, _chat(messages=[{"role": "user", "content": 5}]), 400),
    ("image content part", "POST", CHAT,
     _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400),
    ("temperature is a string", "POST", CHAT, _chat(temperature="hot"), 400),
    ("temperature below 0", "POST", CHAT, _chat(temperature=-1), 400),
    ("temperature above 2", "POST", CHAT, _chat(temperature=3), 400),
    ("temperature NaN", "POST", CHAT, b'{"model": "base", "messages": [{"role": "user", "content": "x"}], '
                                      b'"temperature": NaN}', 400),
    ("top_p 0", "POST", CHAT, _chat(top_p=0), 400),
    ("top_p above 1", "POST", CHAT, _chat(top_p=1.5), 400),
    ("max_tokens 0", "POST", CHAT, _chat(max_tokens=0), 400),
    ("max_tokens is a string", "POST", CHAT, _chat(max_tokens="10"), 400),
    ("max_completion_tokens huge", "POST", CHAT, _chat(max_completion_tokens=10**12), 400),
    ("seed negative", "POST", CHAT, _chat(seed=-1), 400),
    ("n is 2", "POST", CHAT, _chat(n=2), 400),
    ("logprobs", "POST", CHAT, _chat(logprobs=True), 400),
    ("top_logprobs", "POST", CHAT, _chat(top_logprobs=3), 400),
    ("five stop strings", "POST", CHAT, _chat(stop=["a", "b", "c", "d", "e"]), 400),
    ("empty stop string", "POST", CHAT, _chat(stop=[""]), 400),
    ("stream is a string", "POST", CHAT, _chat(stream="yes"), 400),
    ("stream_options is a list", "POST", CHAT, _chat(stream=True, stream_options=[1]), 400),
    ("user is not a tenant name", "POST", CHAT, _chat(user="a b/c"), 400),
    ("unknown model", "POST", CHAT, _chat(model="no-such-model"), 404),
    ("too many messages", "POST", CHAT, _chat(messages=USER * 300), 413),
    ("oversized message", "POST", CHAT, _chat(messages=[{"role": "user", "content": "x" * (300 << 10)}]), 413),
    ("oversized body", "POST", CHAT, _chat(messages=[{"role": "user", "content": "x" * (2 << 20)}]), 413),
    ("completion prompt batch", "POST", COMPLETIONS, _completion(prompt=["a", "b"]), 400),
    ("completion token ids", "POST", COMPLETIONS, _completion(prompt=[1, 2, 3]), 400),
    ("completion empty prompt", "POST", COMPLETIONS, _completion(prompt=""), 400),
    ("completion echo", "POST", COMPLETIONS, _completion(echo=True), 400),
    ("completion logprobs", "POST", COMPLETIONS, _completion(logprobs=1), 400),
    ("completion best_of", "POST", COMPLETIONS, _completion(best_of=2), 400),
    ("completion unknown model", "POST", COMPLETIONS, _completion(model="gpt-4"), 404),
    # A lone surrogate (JSON's "\ud800" escape not in a pair): no UTF-8 encodes it (a 500 deep in the engine).
    ("lone surrogate in a prompt", "POST", COMPLETIONS, _completion(prompt="a\ud800b"), 400),
    ("lone surrogate in a prompt list", "POST", COMPLETIONS, _completion(prompt=["\udfff"]), 400),
    ("lone surrogate in a message", "POST", CHAT, _chat(messages=[{"role": "user", "content": "\ud800"}]), 400),
    ("lone surrogate in a content part", "POST", CHAT,
     _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "ok"},
                                                  {"type": "text", "text": "\udc00"}]}]), 400),
    ("lone surrogate in a message name", "POST", CHAT,
     _chat(messages=[{"role": "user", "content": "Hi", "name": "\ud800"}]), 400),
    ("lone surrogate in a stop string", "POST", CHAT, _chat(stop="\ud800"), 400),
    ("lone surrogate in a stop list", "POST", COMPLETIONS, _completion(stop=["x", "y\udbff"]), 400),
    ("lone surrogate in the model", "POST", CHAT, _chat(model="base\ud800"), 400),
    ("lone surrogate in user", "POST", COMPLETIONS, _completion(user="\ud800"), 400),
    ("wrong method", "GET", CHAT, b"", 405),
    ("unknown route", "POST", "/v1/embeddings", b"{}", 404),
]

#: Bad requests only a real engine refuses (the scripted one takes any value the front lets through).
ENGINE_BAD_REQUESTS: list[tuple[str, str, str, bytes, int]] = [
    ("max_tokens over the engine's limit", "POST", CHAT, _chat(max_tokens=100_000), 400),
    ("the sidecar's probe tenant", "POST", CHAT, _chat(user="warmup-sidecar-probe"), 400),
]
