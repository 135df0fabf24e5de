"""Probes: one real, small inference per model through tritonclient, each with a short deadline.

A probe is what a client would see: the model's own readiness endpoint says nothing about a dead stub
(see :mod:`warmup_tools.sidecar.health`), so every model gets a request it must answer. Probes carry their
own tenant (``PROBE_TENANT``: their cache entries never mix with a real tenant's, the request log and the
heat statistics skip them), proven with a credential only the sidecar holds (its probe tenant's key in
trust mode, the per-start probe secret in open mode) and a fresh token per probe for the later steps, and
ask for one token; their prompts are shorter than a KV block, so they cache no KV.

lora_adapter runs the probe tenant's requests in a running slot of their own, never behind the tenants'
queue (:mod:`warmup_tools.lora_adapter.admission`). A probe answered ``busy`` or ``rate_limited`` (a full
instance: an older lora_adapter, or more probes held than its bound) still proves the model alive: its
:class:`ProbeResult` says ``busy``, which the health tracker never counts as a failure.
"""

from __future__ import annotations

import dataclasses
import queue
import re
import time
import uuid
from typing import Any, Callable, Union

import numpy as np

from warmup_tools.common.records import PROBE_TENANT
from warmup_tools.server.client import cancel_stream, end_stream
from warmup_tools.sidecar.health import ProbeResult

#: A probe of one model: returns a :class:`ProbeResult`, never raises for a failed request.
ProbeFn = Callable[[str], ProbeResult]
#: The token a probe of a later step carries: a fixed one, or a function that makes a fresh one (tokens expire).
TokenSource = Union[str, Callable[[], str], None]

# The demo tokenizer's ids are small integers; any few ids the LM's vocabulary holds will do.
_PROBE_IDS = np.array([1, 2, 3, 4], dtype=np.int32)
_PROBE_TEXT = b"sidecar readiness probe"
#: A model's refusal for lack of room (common/wire.py's tags), wherever tritonserver's prefixes put it.
_BUSY = re.compile(r"\[(busy|rate_limited)\] ")


@dataclasses.dataclass(frozen=True, slots=True)
class _ProbeRequest:
    inputs: list[tuple[str, np.ndarray, str]]
    decoupled: bool


class TritonProbes:
    """Probes of the demo repository's models over one gRPC connection (used from one thread)."""

    def __init__(self, grpc_url: str, timeout_s: float = 5.0, tenant: str = PROBE_TENANT, *,
                 tenant_key: str | None = None, tenant_token: TokenSource = None) -> None:
        """The probe tenant needs its key for ``tokenizer_cache`` and ``ensemble``, and a signed token for
        the later steps, which the sidecar makes itself (SECURITY.md); ``tenant_token`` may make a fresh
        one for each probe."""
        import tritonclient.grpc as grpcclient

        self.timeout_s = timeout_s
        self._grpc = grpcclient
        self._client = grpcclient.InferenceServerClient(grpc_url)
        self._tenant, self._tenant_key, self._tenant_token = tenant.encode(), tenant_key, tenant_token

    def server_ready(self) -> tuple[bool, str]:
        """``(ready, reason)`` from Triton's own readiness endpoint."""
        from tritonclient.utils import InferenceServerException

        try:
            ready = bool(self._client.is_server_ready(client_timeout=self.timeout_s))
        except InferenceServerException as exc:
            return False, f"tritonserver not reachable: {_message(exc)}"
        return ready, "" if ready else "tritonserver reports not ready"

    def probe(self, model: str) -> ProbeResult:
        """Send ``model`` its probe request and wait for its (final) response, at most ``timeout_s``."""
        from tritonclient.utils import InferenceServerException

        token = self._tenant_token() if callable(self._tenant_token) else self._tenant_token
        request = _probe_requests(self._tenant, self._tenant_key, token)[model]
        start = time.perf_counter()
        at = time.time()
        try:
            inputs = [self._input(name, array, dtype) for name, array, dtype in request.inputs]
            if request.decoupled:
                self._stream_once(model, inputs)
            else:
                self._client.infer(model, inputs, client_timeout=self.timeout_s)
        except InferenceServerException as exc:
            rejected = "INVALID_ARG" in str(exc.status() or "")
            message = _message(exc)
            return ProbeResult(False, time.perf_counter() - start, at, message, rejected=rejected,
                               busy=_BUSY.search(message) is not None)
        except TimeoutError as exc:
            return ProbeResult(False, time.perf_counter() - start, at, str(exc))
        return ProbeResult(True, time.perf_counter() - start, at)

    def close(self) -> None:
        self._client.close()

    # ------------------------------------------------------------------------------------- helpers
    def _input(self, name: str, array: np.ndarray, dtype: str) -> Any:
        tensor = self._grpc.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        return tensor

    def _stream_once(self, model: str, inputs: list[Any]) -> None:
        """One request over a fresh gRPC stream: decoupled models answer only there."""
        from tritonclient.utils import InferenceServerException

        responses: queue.Queue[tuple[Any, Any]] = queue.Queue()
        # NOTE: a fresh stream per probe, cancelled unless its final response (or an error) came, so a probe that
        # timed out can never deliver its late responses to the next probe.
        self._client.start_stream(callback=lambda result, error: responses.put((result, error)))
        answered = False
        try:
            self._client.async_stream_infer(model, inputs, request_id=uuid.uuid4().hex,
                                            enable_empty_final_response=True)
            deadline = time.monotonic() + self.timeout_s
            while True:
                try:
                    result, error = responses.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    raise TimeoutError(f"no response from {model} within {self.timeout_s:g}s") from None
                if error is not None:
                    # NOTE: a model's error (busy, rate_limited) is its request's final response: the stream is
                    # ended like an answered one, since a call cancelled just after its final response keeps a
                    # decoupled model loaded on 2.51 (end_stream cancels it only if it does not end by itself).
                    answered = True
                    raise error if isinstance(error, InferenceServerException) else InferenceServerException(
                        str(error))
                final = result.get_response().parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    answered = True
                    return
        finally:
            if answered:
                end_stream(self._client, self.timeout_s)
            else:
                cancel_stream(self._client)  # NOTE: not stop_stream(cancel_requests=True): that leaks a thread


def _probe_requests(tenant: bytes, tenant_key: str | None = None,
                    tenant_token: str | None = None) -> dict[str, _ProbeRequest]:
    text = np.array([_PROBE_TEXT], dtype=np.object_)
    who = [("tenant_id", np.array([tenant], dtype=np.object_), "BYTES")]
    first = who + ([("tenant_key", np.array([tenant_key.encode()], dtype=np.object_), "BYTES")] if tenant_key else [])
    later = who + ([("tenant_token", np.array([tenant_token.encode()], dtype=np.object_), "BYTES")]
                   if tenant_token else [])
    one = np.array([1], dtype=np.int32)
    no_stream = np.array([False], dtype=bool)
    return {
        "tokenizer_cache": _ProbeRequest([("text_input", text, "BYTES"), *first], False),
        "embedding_cache": _ProbeRequest([("text_input", text, "BYTES"), *later], False),
        "lora_adapter": _ProbeRequest([("input_ids", _PROBE_IDS, "INT32"), *later,
                                       ("max_tokens", one, "INT32"), ("stream", no_stream, "BOOL")], True),
        "ensemble": _ProbeRequest([("text_input", text, "BYTES"), *first,
                                   ("max_tokens", one, "INT32"), ("stream", no_stream, "BOOL")], True),
    }


#: The models :class:`TritonProbes` knows how to probe.
PROBED_MODELS: tuple[str, ...] = tuple(_probe_requests(b""))


def _message(exc: Exception) -> str:
    message = getattr(exc, "message", None)
    text = message() if callable(message) else str(exc)
    return str(text).strip() or type(exc).__name__
