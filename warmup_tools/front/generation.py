"""What chat and completions share: the request to the engine, stop strings on the streamed text, the
answer's usage, server-sent events, the in-flight count per adapter, and a client that goes away."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from warmup_tools.common.wire import ErrorKind
from warmup_tools.front.admission import TenantLimit
from warmup_tools.front.engine.engine import Engine, EngineError, GenerateChunk, GenerateInput
from warmup_tools.front.errors import OpenAIError

T = TypeVar("T")
LOGGER = logging.getLogger(__name__)

#: HTTP status of each error kind (common/wire.py), whatever the words of its message.
_STATUS = {ErrorKind.INVALID: 400, ErrorKind.UNAUTHENTICATED: 401, ErrorKind.NOT_FOUND: 404,
           ErrorKind.TOO_LARGE: 413, ErrorKind.BUSY: 429, ErrorKind.RATE_LIMITED: 429, ErrorKind.UNAVAILABLE: 503,
           ErrorKind.CANCELLED: 503, ErrorKind.TIMEOUT: 504, ErrorKind.INTERNAL: 500}
_CODES = {ErrorKind.NOT_FOUND: "model_not_found", ErrorKind.BUSY: "server_busy",
          ErrorKind.RATE_LIMITED: "rate_limit_exceeded", ErrorKind.UNAUTHENTICATED: "invalid_api_key"}


#: What a client is told of a failure on the server's side, whatever tritonserver said.
_SERVER_SIDE = {
    500: "internal error while serving this request; it was not completed: retry, and report it if it persists",
    503: "this replica cannot serve the request now (a model is restarting, shutting down or unreachable); it was "
         "not completed: retry, another replica may serve it",
    504: "the request did not complete within the server's deadline; retry with fewer tokens or later",
}


def openai_error(exc: EngineError) -> OpenAIError:
    status = _STATUS.get(exc.kind, 500)
    if status == 401:  # NOTE: the same 401 as a wrong key, whatever the model said
        from warmup_tools.front.errors import unauthorized

        return unauthorized()
    # NOTE: a model's own message about the request (a bad value, an unknown adapter, a full queue) is written for
    # the client; tritonserver's own text on a server-side failure names its instances and models
    # ("Stub process 'lora_adapter_0_0' is not healthy."), which a client has no use for: it goes to the log only.
    message = _SERVER_SIDE.get(status, exc.message)
    if status in _SERVER_SIDE:
        LOGGER.warning("request failed on tritonserver (%s, answered %d): %s", exc.kind, status, exc.message)
    return OpenAIError(status, message, param="model" if status == 404 else None, code=_CODES.get(exc.kind))


class StopMatcher:
    """Cuts streamed text at the first stop string; holds back a tail that may be the start of one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text that may go out now; :attr:`stopped` once a stop string was seen (nothing after it)."""
        if not self.stops:
            return text
        self._pending += text
        cut = min((i for i in (self._pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self._pending, self.stopped = self._pending[:cut], "", True
            return out
        keep = self._held_tail()
        out, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
        return out

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out

    def _held_tail(self) -> int:
        """The longest end of the pending text that begins some stop string."""
        for size in range(min(self._hold, len(self._pending)), 0, -1):
            tail = self._pending[-size:]
            if any(s.startswith(tail) for s in self.stops):
                return size
        return 0


class InFlight:
    """Requests in flight through this front per model: waiting (no token yet) and running."""

    def __init__(self) -> None:
        self.waiting: dict[str, int] = {}
        self.running: dict[str, int] = {}

    def _add(self, table: dict[str, int], model: str, delta: int) -> None:
        table[model] = table.get(model, 0) + delta
        if table[model] <= 0:
            del table[model]


@dataclasses.dataclass(slots=True)
class Outcome:
    """What one generation came to: the text already sent, the counters of its last chunk, its reason."""

    text: list[str] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None


class Generation:
    """One request's generation: ``pieces()`` yields the text to send; the outcome fills in as it goes."""

    def __init__(self, engine: Engine, request: GenerateInput, stops: tuple[str, ...], model: str,
                 in_flight: InFlight, tenants: TenantLimit | None = None) -> None:
        self._chunks = engine.generate(request)
        self._stop = StopMatcher(stops)
        self._model = model
        self._in_flight = in_flight
        self._tenants = tenants
        self._tenant = request.tenant
        self._proven = request.tenant_key is not None
        self._place: str | None = None
        self.outcome = Outcome()
        self._first: GenerateChunk | None = None
        self._state = "new"

    async def start(self) -> None:
        """Wait for the first chunk, so that a refusal (busy, unknown adapter, a bad value) is an HTTP error
        before any byte of a streamed answer is sent; a tenant over its bound in this front is refused (429) before
        anything reaches the engine. From here the request holds its tenant's place until :meth:`close`."""
        if self._tenants is not None:
            try:
                self._place = self._tenants.acquire(self._tenant, self._proven)
            except OpenAIError:
                await self.close()
                raise
        self._in_flight._add(self._in_flight.waiting, self._model, 1)
        self._state = "waiting"
        try:
            self._first = await self._chunks.__anext__()
        except StopAsyncIteration:
            self._first = GenerateChunk("", finish_reason="stop")
        except EngineError as exc:
            await self.close()
            raise openai_error(exc) from None
        except BaseException:
            await self.close()
            raise
        self._move("running")

    async def pieces(self) -> AsyncIterator[str]:
        try:
            chunk = self._first
            while chunk is not None:
                self._count(chunk)
                out = self._stop.feed(chunk.text)
                if self._stop.stopped:
                    self.outcome.finish_reason = "stop"
                    if out:
                        self.outcome.text.append(out)
                        yield out
                    return
                if chunk.finish_reason:
                    out += self._stop.flush()
                    self.outcome.finish_reason = chunk.finish_reason
                if out:
                    self.outcome.text.append(out)
                    yield out
                if chunk.finish_reason:
                    return
                try:
                    chunk = await self._chunks.__anext__()
                except StopAsyncIteration:
                    chunk = None
                except EngineError as exc:
                    raise openai_error(exc) from None
            self.outcome.finish_reason = self.outcome.finish_reason or "stop"
        finally:
            await self.close()

    async def drain(self) -> None:
        """Run the generation to its end, keeping nothing but :attr:`outcome` (a whole, non-streamed answer)."""
        async for _ in self.pieces():
            pass

    async def close(self) -> None:
        """End the generation (cancelling it on the engine if it still runs); idempotent."""
        if self._state == "closed":
            return
        self._move("closed")
        if self._tenants is not None:  # NOTE: before any await: a cancelled close still gives the place back
            place, self._place = self._place, None
            self._tenants.release(place)
        await self._chunks.aclose()

    def _count(self, chunk: GenerateChunk) -> None:
        self.outcome.prompt_tokens = chunk.prompt_tokens or self.outcome.prompt_tokens
        self.outcome.cached_tokens = chunk.cached_tokens or self.outcome.cached_tokens
        self.outcome.completion_tokens = chunk.output_tokens or self.outcome.completion_tokens

    def _move(self, state: str) -> None:
        table = {"waiting": self._in_flight.waiting, "running": self._in_flight.running}
        if self._state in table:
            self._in_flight._add(table[self._state], self._model, -1)
        if state in table:
            self._in_flight._add(table[state], self._model, 1)
        self._state = state


class GenerationStream(StreamingResponse):
    """A streamed answer that closes its generation when the response ends, however it ends: the stream sent
    whole, an error, the client gone, or the task cancelled before the stream began (the body's own ``finally``
    never runs for a generator that was never started)."""

    def __init__(self, generation: Generation, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._generation.close()


def sse(data: Any) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"data: {payload}\n\n".encode("utf-8")


DONE = b"data: [DONE]\n\n"


async def until_disconnect(request: Request, work: Awaitable[T], on_gone: Callable[[], Awaitable[None]]) -> T:
    """``work``'s result; if the client disconnects first, ``work`` is cancelled, ``on_gone`` runs and
    :class:`ClientGone` is raised (nobody is left to answer)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await on_gone()
    raise ClientGone()


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def watched(request: Request, generation: Generation, work: Awaitable[None]) -> bool:
    """Run ``work`` (the generation's start, or its whole run) while watching the client: False when the client
    left first (the generation is then cancelled and closed, and nobody is left to answer)."""
    try:
        await until_disconnect(request, work, generation.close)
    except ClientGone:
        return False
    return True


#: What a route returns to a client that already left (nginx's "client closed request"; nobody reads it).
CLIENT_GONE_STATUS = 499


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
