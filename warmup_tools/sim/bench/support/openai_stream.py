"""One streamed ``/v1/completions`` request read as server-sent events, as the benchmarks' clients read it from
any OpenAI-compatible server (this project's front, the smg router, vLLM)."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Mapping

#: Seconds an idle connection of a benchmark's client is kept for reuse: below every server's keep-alive timeout
#: (llama-server's is 5 s), so a request never goes out on a connection the server is closing.
KEEPALIVE_EXPIRY_S = 1.0


class StreamError(RuntimeError):
    """The server answered with another status than 200."""

    def __init__(self, status: int, text: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(f"HTTP {status}: {text[:300]}")
        self.status = status
        self.text = text
        #: The response's headers (lower-case names).
        self.headers = dict(headers or {})


@dataclasses.dataclass(frozen=True, slots=True)
class Streamed:
    """What the client saw: seconds to the first event with text (None: no text came), in all, and the usage the
    stream reported (empty when it reported none)."""

    ttft_s: float | None
    total_s: float
    usage: Mapping[str, Any]
    #: The response's headers (lower-case names).
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: The ``error`` object of an event that reported one mid-stream (None: none did).
    error: Mapping[str, Any] | None = None

    @property
    def cached_tokens(self) -> int:
        return int((self.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def stream_completion(client: Any, url: str, body: Mapping[str, Any],
                      headers: Mapping[str, str] | None = None) -> Streamed:
    """POST ``body`` (``stream`` and ``include_usage`` set here) to ``url`` with the httpx ``client``;
    :class:`StreamError` on a status other than 200 (httpx's errors pass through)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    started, ttft, usage, error = time.perf_counter(), None, {}, None
    with client.stream("POST", url, json=body, headers=dict(headers or {})) as response:
        seen = {k.lower(): v for k, v in response.headers.items()}
        if response.status_code != 200:
            raise StreamError(response.status_code, response.read().decode("utf-8", "replace"), seen)
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if ttft is None and data.get("choices") and data["choices"][0].get("text"):
                ttft = time.perf_counter() - started
            usage = data.get("usage") or usage
            if isinstance(data.get("error"), dict):
                error = data["error"]
    return Streamed(ttft, time.perf_counter() - started, usage, seen, error)
