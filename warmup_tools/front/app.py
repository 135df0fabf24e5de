"""The FastAPI application: the routers, the request-size middleware and OpenAI's error bodies."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from warmup_tools.front.auth import TenantResolver
from warmup_tools.front.chat_template import ChatRenderer
from warmup_tools.front.drain import Drain, DrainGate
from warmup_tools.front.engine.engine import Engine
from warmup_tools.front.errors import OpenAIError, bad_request, send_error
from warmup_tools.front.routers import chat, completions, models, observability
from warmup_tools.front.serving import FrontState
from warmup_tools.front.settings import FrontSettings
from warmup_tools.front.smg_grpc import router as grpc_workers_router

if TYPE_CHECKING:
    from warmup_tools.front.smg_grpc.listeners import GrpcWorkers

LOGGER = logging.getLogger(__name__)


def build_app(settings: FrontSettings, engine: Engine, renderer: ChatRenderer | None,
              drain: Drain | None = None, grpc_workers: GrpcWorkers | None = None) -> FastAPI:
    """The front's application; ``drain`` (default a new one) is how its owner drains it on SIGTERM;
    ``grpc_workers``: smg's gRPC worker listeners, started and stopped with it (front/smg_grpc)."""
    drain = drain or Drain()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            if grpc_workers is not None:
                await grpc_workers.start(app.state.front)
            try:
                yield
            finally:
                if grpc_workers is not None:
                    await grpc_workers.stop()
        finally:
            await engine.close()

    app = FastAPI(title="warmup_tools OpenAI front", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.front = FrontState(settings, engine, TenantResolver(settings.tenant_keys_file), renderer, drain)
    app.state.grpc_workers = grpc_workers
    for module in (chat, completions, models, observability, grpc_workers_router):
        app.include_router(module.router)
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RecursionError, _too_deep)
    app.add_exception_handler(Exception, _unexpected)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s)
    app.add_middleware(DrainGate, drain=drain)
    app.add_middleware(ModelPrefix)  # added last: the outermost, so every route sees the plain path
    return app


async def _openai_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return exc.response()


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    """Pydantic's first complaint, as OpenAI's 400: the field (``param``) and what is wrong with it."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return bad_request("We could not parse the JSON body of your request: send valid JSON "
                           f"({first.get('ctx', {}).get('error', 'invalid JSON')}).").response()
    if not loc and first.get("type") in ("missing", "model_attributes_type", "dict_type"):
        return bad_request("The body must be a JSON object with the request's fields, sent with "
                           "'Content-Type: application/json'.").response()
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    return bad_request(f"{where}: {first.get('msg', 'invalid value')}", param=param).response()


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = {404: f"Unknown route {request.method} {request.url.path}",
               405: f"Method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code,
                                                                                       str(exc.detail))
    return OpenAIError(exc.status_code, message).response()


async def _too_deep(request: Request, exc: Exception) -> JSONResponse:
    return bad_request("The JSON body is nested too deeply.").response()


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    LOGGER.exception("unexpected error on %s %s", request.method, request.url.path)
    return OpenAIError(500, "internal error while serving this request; it was not completed: retry, and report "
                            "it if it persists").response()


class BodyLimit:
    """Reads a POST body whole before the application sees it: at most ``max_bytes`` (413, from the
    ``Content-Length`` alone when it says more), within ``timeout_s`` (408 for a half-sent body), then
    replays it. A client that disconnects mid-body gets nothing (nobody is left to answer)."""

    def __init__(self, app: ASGIApp, *, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                await send_error(send, bad_request("Content-Length is not a number."))
                return
            if int(length) > self.max_bytes:
                await send_error(send, _too_large(int(length), self.max_bytes))
                return
        try:
            body = await asyncio.wait_for(self._read(receive), timeout=self.timeout_s)
        except asyncio.TimeoutError:
            await send_error(send, OpenAIError(408, f"The request body did not arrive within {self.timeout_s:g} s.",
                                                code="body_timeout"))
            return
        except OpenAIError as exc:
            await send_error(send, exc)
            return
        if body is None:
            return  # the client went away mid-body
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _too_large(size, self.max_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(413, f"The request body is larger than {limit} bytes, the most this server takes.",
                       code="request_too_large")


class ModelPrefix:
    """Serves every route under ``/m/<model>/`` too (``/m/sql/v1/chat/completions`` is
    ``/v1/chat/completions``): a router that knows one model per worker URL (smg) reaches each adapter of
    a replica through a URL of its own, and the body's ``model`` still selects the adapter."""

    PREFIX = "/m/"

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and path.startswith(self.PREFIX):
            rest = path[len(self.PREFIX):].partition("/")[2]
            scope = {**scope, "path": "/" + rest, "raw_path": ("/" + rest).encode()}
        await self.app(scope, receive, send)
