"""Client helpers for the ``ensemble`` model over gRPC streaming and the HTTP generate extension, and for the
replica's OpenAI front (streamed ``/v1/completions``), with one interface.

Used by the demo, the tests and the benchmarks; they measure time to first token (TTFT) on the client.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import queue
import time
import uuid
from typing import Any, Callable, Iterator, Self

from warmup_tools.common.errors import WarmupToolsError
from warmup_tools.common.wire import input_tensors


class GenerateError(WarmupToolsError):
    """The server answered a generate request with an error."""

    def __init__(self, message: str, status: str | int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(slots=True)
class GenerateResult:
    text: str
    pieces: list[str]
    ttft_s: float
    total_s: float
    cached_tokens: int
    prompt_tokens: int
    output_tokens: int
    finish_reason: str
    #: Seconds from the request's send to each response (one per token when streaming).
    arrivals_s: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, slots=True)
class GenerateParams:
    max_tokens: int | None = 16
    adapter_id: str | None = None
    tenant_id: str | None = None
    #: Trust mode: the key that proves ``tenant_id`` (SECURITY.md).
    tenant_key: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def grpc_inputs(text: str | bytes, params: GenerateParams, stream: bool) -> list[Any]:
    """The ``ensemble`` input tensors for one request (optional inputs only when set), as common/wire.py's table
    types them."""
    import tritonclient.grpc as grpcclient

    tensors = input_tensors({"text_input": text, "stream": stream, **params.as_json()})
    inputs = []
    for name, dtype, array in tensors:
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


@functools.cache
def _closing_once_client_class() -> type:
    """tritonclient's gRPC ``InferenceServerClient`` with an idempotent ``close()``.

    NOTE: tritonclient's ``__del__`` calls ``close()`` again after an explicit close. Under gevent (Locust),
    that second ``grpc.Channel.close`` during interpreter shutdown hung the process after the run had
    finished, about one run in two on a loaded machine (py-spy: ``__del__`` -> ``Channel._close``)."""
    import tritonclient.grpc as grpcclient

    class ClosingOnceClient(grpcclient.InferenceServerClient):
        _closed = False

        def close(self) -> None:
            if not self._closed:
                self._closed = True
                super().close()

    return ClosingOnceClient


_COUNTERS = ("cached_tokens", "prompt_tokens", "output_tokens")


class _Collector:
    """Accumulates one request's streamed pieces, its TTFT and the counters of its last response."""

    def __init__(self, on_piece: Callable[[str], None] | None) -> None:
        self.start = time.perf_counter()
        self.on_piece = on_piece
        self.pieces: list[str] = []
        self.ttft: float | None = None
        self.last: dict[str, Any] = {}
        self.arrivals: list[float] = []

    def piece(self, text: str, fields: dict[str, Any]) -> None:
        self.arrivals.append(time.perf_counter() - self.start)
        if self.ttft is None:
            self.ttft = self.arrivals[-1]
        self.pieces.append(text)
        if self.on_piece is not None and text:
            self.on_piece(text)
        self.counts(fields)
        reason = fields.get("finish_reason", "")
        self.last["finish_reason"] = reason.decode() if isinstance(reason, bytes) else str(reason)

    def counts(self, fields: dict[str, Any]) -> None:
        """The token counters among ``fields`` (a response that carries no text: OpenAI's usage chunk)."""
        for name in _COUNTERS:
            if name in fields:
                self.last[name] = int(fields[name])

    def result(self) -> GenerateResult:
        total = time.perf_counter() - self.start
        return GenerateResult(
            text="".join(self.pieces), pieces=self.pieces, ttft_s=self.ttft if self.ttft is not None else total,
            total_s=total, cached_tokens=self.last.get("cached_tokens", 0),
            prompt_tokens=self.last.get("prompt_tokens", 0), output_tokens=self.last.get("output_tokens", 0),
            finish_reason=self.last.get("finish_reason", ""), arrivals_s=self.arrivals,
        )


class _Closeable:
    """``with client:`` closes the client."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StreamingClient(_Closeable):
    """One gRPC connection to Triton sending ``ensemble`` requests over the bidirectional stream."""

    def __init__(self, url: str, model: str = "ensemble", timeout_s: float = 300.0) -> None:
        self.model = model
        self.timeout_s = timeout_s
        self._client = _closing_once_client_class()(url)
        self._responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
        self._client.start_stream(callback=lambda result, error: self._responses.put((result, error)))

    def generate(
        self,
        text: str | bytes,
        params: GenerateParams = GenerateParams(),
        *,
        stream: bool = True,
        on_piece: Callable[[str], None] | None = None,
    ) -> GenerateResult:
        """Send one request and collect its responses until the final one."""
        return self.stream_inputs(grpc_inputs(text, params, stream), on_piece=on_piece)

    def stream_inputs(self, inputs: list[Any], *, on_piece: Callable[[str], None] | None = None) -> GenerateResult:
        """Send one request of ready-made input tensors (any model with ``text_output``, e.g. ``lora_adapter``
        called directly with ``input_ids``) and collect its responses until the final one.

        An exception raised by ``on_piece`` propagates; :meth:`cancel` then ends the request on the server."""
        request_id = uuid.uuid4().hex
        collect = _Collector(on_piece)
        from tritonclient.utils import InferenceServerException

        try:
            self._client.async_stream_infer(self.model, inputs, request_id=request_id,
                                            enable_empty_final_response=True)
        except InferenceServerException:
            # NOTE: the stream failed before the request went out (the server is gone or restarting); the
            # reason came through the callback.
            try:
                _, error = self._responses.get_nowait()
            except queue.Empty:
                error = None
            raise GenerateError(f"the stream failed before the request was sent: {error}",
                                getattr(error, "status", lambda: None)()) from None
        while True:
            try:
                result, error = self._responses.get(timeout=self.timeout_s)
            except queue.Empty:
                raise GenerateError(f"no response within {self.timeout_s:.0f}s") from None
            if error is not None:
                raise GenerateError(str(error), getattr(error, "status", lambda: None)())
            response = result.get_response()
            final = response.parameters.get("triton_final_response")
            text_out = result.as_numpy("text_output")
            if text_out is not None:
                collect.piece(text_out.reshape(-1)[0].decode("utf-8"),
                              {name: result.as_numpy(name).reshape(-1)[0] for name in _COUNTERS + ("finish_reason",)})
            if final is not None and final.bool_param:
                break
        return collect.result()

    def cancel(self) -> None:
        """Cancel the stream (gRPC cancellation) with every request still running on it; the client is
        not usable afterwards."""
        cancel_stream(self._client)

    def close(self) -> None:
        self._client.close()


def http_generate(url: str, text: str, params: GenerateParams = GenerateParams(), model: str = "ensemble",
                  timeout_s: float = 300.0) -> dict[str, Any]:
    """``POST /v2/models/<model>/generate``: one JSON answer (raises GenerateError on an error status)."""
    import requests

    body = {"text_input": text, "stream": False, **params.as_json()}
    response = requests.post(f"http://{url}/v2/models/{model}/generate", json=body, timeout=timeout_s)
    if response.status_code != 200:
        raise GenerateError(_error_text(response.text), response.status_code)
    return response.json()


def http_generate_stream(url: str, text: str, params: GenerateParams = GenerateParams(),
                         model: str = "ensemble", timeout_s: float = 300.0,
                         session: Any = None) -> Iterator[dict[str, Any]]:
    """``POST /v2/models/<model>/generate_stream``: yields each server-sent event's JSON."""
    import requests

    body = {"text_input": text, "stream": True, **params.as_json()}
    with (session or requests).post(f"http://{url}/v2/models/{model}/generate_stream", json=body, stream=True,
                                    timeout=timeout_s) as response:
        if response.status_code != 200:
            raise GenerateError(_error_text(response.text), response.status_code)
        for line in response.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data:"):
                continue
            event = json.loads(line[len("data:"):].strip())
            if "error" in event:
                raise GenerateError(event["error"], response.status_code)
            yield event


class HttpStreamingClient(_Closeable):
    """:class:`StreamingClient`'s interface over HTTP: ``POST /v2/models/<model>/generate_stream`` (SSE),
    one keep-alive session. ``url`` is Triton's HTTP address."""

    def __init__(self, url: str, model: str = "ensemble", timeout_s: float = 300.0) -> None:
        import requests

        self.url = url
        self.model = model
        self.timeout_s = timeout_s
        self._session = requests.Session()

    def generate(self, text: str, params: GenerateParams = GenerateParams(), *,
                 on_piece: Callable[[str], None] | None = None) -> GenerateResult:
        collect = _Collector(on_piece)
        for event in http_generate_stream(self.url, text, params, self.model, self.timeout_s, self._session):
            collect.piece(event.get("text_output", ""), event)
        return collect.result()

    def close(self) -> None:
        self._session.close()


class OpenAIStreamingClient(_Closeable):
    """:class:`StreamingClient`'s interface over the replica's OpenAI front: streamed ``POST /v1/completions``
    (server-sent events, usage in the last chunk), one keep-alive session. ``url`` is the front's address
    (``http://host:9000`` or ``host:9000``); the adapter is the request's model (``base_model``, the front's
    ``served_model_name``, when none); the tenant is proven by its key as a bearer token (trust mode), or named in
    ``X-Tenant-Id`` (open mode)."""

    def __init__(self, url: str, base_model: str = "base", timeout_s: float = 300.0) -> None:
        import requests

        self.url = (url if "://" in url else f"http://{url}").rstrip("/")
        self.base_model = base_model
        self.timeout_s = timeout_s
        self._session = requests.Session()

    def generate(self, text: str, params: GenerateParams = GenerateParams(), *,
                 on_piece: Callable[[str], None] | None = None) -> GenerateResult:
        body: dict[str, Any] = {"model": params.adapter_id or self.base_model, "prompt": text, "stream": True,
                                "stream_options": {"include_usage": True}}
        body.update({k: v for k, v in (("max_tokens", params.max_tokens), ("temperature", params.temperature),
                                       ("top_p", params.top_p), ("seed", params.seed)) if v is not None})
        headers = ({"Authorization": f"Bearer {params.tenant_key}"} if params.tenant_key
                   else {"X-Tenant-Id": params.tenant_id} if params.tenant_id else {})
        collect = _Collector(on_piece)
        with self._session.post(f"{self.url}/v1/completions", json=body, headers=headers, stream=True,
                                timeout=self.timeout_s) as response:
            if response.status_code != 200:
                raise GenerateError(_error_text(response.text), response.status_code)
            for line in response.iter_lines(decode_unicode=True):
                if not line or not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise GenerateError(_error_text(json.dumps(event)), response.status_code)
                for choice in event.get("choices") or ():
                    collect.piece(choice.get("text") or "", {"finish_reason": choice.get("finish_reason") or ""})
                usage = event.get("usage") or {}
                if usage:
                    collect.counts({"prompt_tokens": usage.get("prompt_tokens", 0),
                                    "output_tokens": usage.get("completion_tokens", 0),
                                    "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                                    or 0})
        return collect.result()

    def close(self) -> None:
        self._session.close()


def _error_text(body: str) -> str:
    """The message of an error body: Triton's ``{"error": "..."}`` or OpenAI's ``{"error": {"message": "..."}}``."""
    try:
        error = json.loads(body).get("error", body)
    except (ValueError, AttributeError):
        return body
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


def scrape_metrics(metrics_url: str, prefix: str = "warmup_",
                   headers: dict[str, str] | None = None) -> dict[tuple[str, frozenset], float]:
    """Samples from a Prometheus /metrics whose name starts with ``prefix``: ``{(name, labels): value}``.

    An answer other than 200 raises ``requests.HTTPError`` (an OSError)."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    response = requests.get(metrics_url, timeout=10, headers=headers)
    response.raise_for_status()
    text = response.text
    samples: dict[tuple[str, frozenset], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix):
                samples[(sample.name, frozenset(sample.labels.items()))] = float(sample.value)
    return samples


def metric_sum(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, lbl), v in samples.items() if n == name and wanted <= lbl)


def end_stream(client: Any, timeout_s: float = 5.0) -> None:
    """End a tritonclient gRPC client's stream whose requests are all answered: close the request side and let
    the server end the call with OK; cancel it (:func:`cancel_stream`) only if it has not ended in ``timeout_s``.

    NOTE: see docs/fleet.md, "Leaving without losing a request": tritonserver 2.51 keeps a decoupled model
    loaded when a request's call is cancelled just after its FINAL response."""
    stream = getattr(client, "_stream", None)
    handler = getattr(stream, "_handler", None)
    queue_ = getattr(stream, "_request_queue", None)
    if stream is None or handler is None or queue_ is None:
        cancel_stream(client)
        return
    queue_.put(None)  # the end of the requests: the server ends the call once its responses are out
    handler.join(timeout_s)
    if handler.is_alive():
        cancel_stream(client)
        return
    client.stop_stream()  # the call is over: this only drops the client's handle on it


def cancel_stream(client: Any) -> None:
    """Stop a tritonclient gRPC client's stream with gRPC cancellation of every request still on it.

    NOTE: tritonclient (2.73) ends a cancelled stream without ending its request iterator, so the gRPC
    thread that reads that iterator waits on its queue for good: one thread leaked per cancelled stream
    (the soak benchmark saw a process's thread count climb by one per cancel). The end marker a plain
    ``stop_stream()`` would have queued lets that thread finish.
    """
    stream = getattr(client, "_stream", None)
    client.stop_stream(cancel_requests=True)
    queue_ = getattr(stream, "_request_queue", None)
    if queue_ is not None:
        queue_.put(None)
