"""Errors as OpenAI writes them: ``{"error": {"message", "type", "param", "code"}}`` with the right status."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse
from starlette.types import Send

from warmup_tools.front.schemas import ErrorInfo, ErrorResponse

#: OpenAI's error ``type`` for each status the front answers with.
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          408: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
          422: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
          503: "service_unavailable", 504: "timeout"}


class OpenAIError(Exception):
    """A request answered with an error; ``status`` is its HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=_TYPES.get(self.status, "invalid_request_error"),
                         param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        if self.status == 429:
            headers = {"Retry-After": RETRY_AFTER_S}  # NOTE: a rate limit or a full queue frees within a generation
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def model_not_found(message: str) -> OpenAIError:
    return OpenAIError(404, message, param="model", code="model_not_found")


#: What a 429 answer asks a client to wait, in seconds (``Retry-After``).
RETRY_AFTER_S = "1"

#: The one message for a missing or wrong key: it never says whether the tenant exists.
INVALID_KEY = ("Incorrect API key provided: send 'Authorization: Bearer <key>' with a tenant key of this deployment "
               "(ask your operator for one).")


def unauthorized() -> OpenAIError:
    return OpenAIError(401, INVALID_KEY, code="invalid_api_key")


async def send_error(send: Send, error: OpenAIError) -> None:
    """``error`` straight onto an ASGI ``send`` (for middleware, before the application runs)."""
    body = json.dumps(error.body()).encode()
    headers: list[Any] = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                          (b"connection", b"close")]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
