"""Leaving without losing a request: on SIGTERM the replica's ``/health`` fails first (a router stops choosing
it), new requests are refused after a grace period (a router retries them on another replica), and the
requests in flight finish before tritonserver stops.

:class:`Drain` is shared by the ASGI gate (:class:`DrainGate`, on the event loop) and the thread that drains
(:meth:`warmup_tools.front.server.FrontServer.drain`), hence a condition variable rather than asyncio."""

from __future__ import annotations

import threading

from starlette.types import ASGIApp, Receive, Scope, Send

from warmup_tools.front.errors import OpenAIError, send_error


class Drain:
    """Generation requests in flight through the front, and where the front is in its drain."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.active = 0
        #: Generation requests taken since the start.
        self.total = 0
        #: Requests in flight when the drain began (None: not draining).
        self.in_flight_at_start: int | None = None
        #: /health answers 503 from here on.
        self.draining = False
        #: New generation requests are refused from here on.
        self.refusing = False

    def enter(self) -> bool:
        """Count one request in; False when new requests are refused."""
        with self._cond:
            if self.refusing:
                return False
            self.active += 1
            self.total += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self.active -= 1
            self._cond.notify_all()

    def run(self, grace_s: float, timeout_s: float, stop: threading.Event | None = None) -> int:
        """Fail /health, take requests for ``grace_s`` more (``stop`` cuts it short), refuse new ones, then wait
        up to ``timeout_s`` for those in flight: how many were still in flight at the end (0: none lost)."""
        with self._cond:
            self.in_flight_at_start = self.active
        self.draining = True
        (stop or threading.Event()).wait(grace_s)
        with self._cond:
            self.refusing = True
            self._cond.wait_for(lambda: self.active == 0, timeout=timeout_s)
            return self.active


class DrainGate:
    """Counts the generation requests (``POST /v1/...``) through :class:`Drain`; once it refuses, answers them 503
    with OpenAI's error body (a router retries a 503 elsewhere)."""

    def __init__(self, app: ASGIApp, *, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if not self.drain.enter():
            await send_error(send, OpenAIError(503, "This replica is shutting down: send the request to another "
                                                    "replica.", code="draining"))
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()
