"""The front's per-process state and the checks every generation request goes through, in order: the
caller (401), the replica's readiness (503), the parameters the engine cannot honour (400), the model
(404), the prompt's size (413)."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import Request

from warmup_tools.common.tracing import TraceContext, context_from_headers
from warmup_tools.front.admission import TenantLimit, tenant_bound
from warmup_tools.front.auth import TENANT_HEADER, Caller, TenantResolver
from warmup_tools.front.chat_template import ChatRenderer
from warmup_tools.front.drain import Drain
from warmup_tools.front.engine.engine import Engine
from warmup_tools.front.errors import OpenAIError, bad_request, model_not_found
from warmup_tools.front.generation import InFlight
from warmup_tools.front.settings import FrontSettings


@dataclasses.dataclass(slots=True)
class FrontState:
    settings: FrontSettings
    engine: Engine
    resolver: TenantResolver
    #: None when the tokenizer has no chat template: /v1/chat/completions then answers 400.
    renderer: ChatRenderer | None
    drain: Drain = dataclasses.field(default_factory=Drain)
    in_flight: InFlight = dataclasses.field(default_factory=InFlight)
    #: Each tenant's generation requests in flight, bounded by ``tenant_max_in_flight`` (0: the package's
    #: lora_adapter share, for a front built without its repository).
    tenants: TenantLimit = dataclasses.field(init=False)
    #: Whether the engine traces (WARMUP_TRACING_ENDPOINT): only then is a request's trace context read.
    traced: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.tenants = TenantLimit(tenant_bound(self.settings.tenant_max_in_flight))
        self.traced = getattr(self.engine, "tracer", None) is not None


def front_state(request: Request) -> FrontState:
    return request.app.state.front


def caller_of(request: Request, user: str | None) -> Caller:
    state = front_state(request)
    return state.resolver.resolve(request.headers.get("authorization"), request.headers.get(TENANT_HEADER), user)


def trace_of(state: FrontState, request: Request) -> TraceContext | None:
    """The request's W3C trace context (``traceparent``, ``tracestate``) when the front traces; a malformed or
    oversized one is ignored, never an error."""
    return context_from_headers(request.headers) if state.traced else None


async def check_ready(state: FrontState) -> None:
    readiness = await state.engine.readiness()
    if not readiness.ready:
        readiness = await state.engine.readiness(refresh=True)
    if not readiness.ready:
        raise OpenAIError(503, f"This replica is not ready to serve: {readiness.reason}", code="not_ready")


async def resolve_model(state: FrontState, name: str) -> str | None:
    """The adapter ``name`` means (None: the base model); 404 for a model that is not served now."""
    if name == state.settings.served_model_name:
        return None
    models = await state.engine.models()
    if name not in models.adapters or models.adapters[name] is not None:
        models = await state.engine.models(refresh=True)  # it may have gone live since the last poll
    if name not in models.adapters:
        raise model_not_found(f"The model '{name}' does not exist: GET /v1/models lists the models served here")
    reason = models.adapters[name]
    if reason is not None:
        raise model_not_found(f"The model '{name}' is not served yet: {reason}")
    return name


def check_common(state: FrontState, body: Any) -> None:
    """The parameters both endpoints refuse the same way."""
    if body.n not in (None, 1):
        raise bad_request("n must be 1: this server returns one choice per request", param="n")
    stops = body.stop_strings()
    if len(stops) > state.settings.max_stop:
        raise bad_request(f"stop may hold at most {state.settings.max_stop} strings", param="stop")


def check_prompt_size(state: FrontState, prompt: str, param: str) -> None:
    size = len(prompt.encode("utf-8", errors="surrogatepass"))
    if size > state.settings.max_prompt_bytes:
        raise OpenAIError(413, f"The prompt is {size} bytes; this server takes at most "
                               f"{state.settings.max_prompt_bytes}", param=param, code="prompt_too_large")
