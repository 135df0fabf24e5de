"""What the routers need from an LLM engine, and the plain records it takes and returns.

Like ``openai_frontend/engine/engine.py`` in Triton's server repository: one interface, one implementation
per backend (here :class:`~warmup_tools.front.engine.triton_engine.TritonEngine`); tests use a fake one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator, Mapping, Protocol

from warmup_tools.common.tracing import TraceContext
from warmup_tools.common.wire import ErrorKind


@dataclasses.dataclass(frozen=True, slots=True)
class GenerateInput:
    """One generation, as the front hands it to the engine (already validated)."""

    prompt: str
    #: The LoRA adapter; None for the base model.
    adapter: str | None
    tenant: str | None
    #: Trust mode: the key that proves ``tenant`` (the client's bearer key); never logged.
    tenant_key: str | None = dataclasses.field(default=None, repr=False)
    #: The sampling inputs the request sets, by their wire names (``max_tokens``, ``temperature``, ...: the
    #: fields of common/wire.py's ``SamplingParams``); the engine sends them as they are.
    sampling: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: The role of each span of a rendered conversation: ``((role, start, end), ...)`` in characters of
    #: ``prompt``; empty for a raw prompt. It reaches the request log beside the prompt.
    roles: tuple[tuple[str, int, int], ...] = ()
    #: The client's W3C trace context (its ``traceparent`` header, checked); None: none, or tracing is off.
    trace: TraceContext | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class GenerateChunk:
    """One piece of generated text; the last one has ``finish_reason`` (``stop`` or ``length``)."""

    text: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class ModelState:
    """The models a client may name now: the base model is always there; ``adapters`` maps each adapter
    the engine knows to None when it is live, or to the reason it is not."""

    adapters: dict[str, str | None]

    def live(self) -> list[str]:
        return sorted(name for name, reason in self.adapters.items() if reason is None)


@dataclasses.dataclass(frozen=True, slots=True)
class LoadSignals:
    """What a router reads to choose a replica (fed from the scheduler's gauges)."""

    running: float = 0.0
    waiting: float = 0.0
    #: Share of the KV budget the running sequences hold, 0 to 1 (None when unknown); cached blocks they may evict
    #: are free room, as in vLLM's KV cache usage.
    kv_usage: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Readiness:
    ready: bool
    reason: str = ""
    #: The sidecar's service temperature of the replica (``warm`` or ``hot`` when ready) and of each adapter;
    #: empty without a sidecar.
    temperature: str = ""
    adapters: Mapping[str, str] = dataclasses.field(default_factory=dict)


class EngineError(Exception):
    """The engine refused or failed a request; ``kind`` says which (common/wire.py's :class:`ErrorKind`, which
    front/generation.py maps to an HTTP status)."""

    def __init__(self, kind: ErrorKind | str, message: str) -> None:
        super().__init__(message)
        self.kind = ErrorKind(kind)
        self.message = message


class Engine(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def generate(self, request: GenerateInput) -> AsyncIterator[GenerateChunk]:
        """The pieces of one generation; closing the iterator early (a client gone, a stop string) cancels
        it on the engine. Raises :class:`EngineError`."""
        ...

    async def models(self, refresh: bool = False) -> ModelState: ...

    async def readiness(self, refresh: bool = False) -> Readiness: ...

    async def load(self) -> LoadSignals: ...
