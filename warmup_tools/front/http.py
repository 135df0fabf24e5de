"""The front's HTTP/1.1 protocol: uvicorn's httptools protocol (llhttp, a C parser) with the bounds a connection
needs and neither llhttp nor uvicorn has: the size of a request's head, the time to send it, and the connections
held at once.

Why not uvicorn's h11 protocol, which has a size bound (``h11_max_incomplete_event_size``): h11 parses in pure
Python; httptools and uvloop together take time off a streamed request's TTFT and off the front's CPU per request
(``scripts/front_ab.py``; the figures: docs/benchmarks.md, "The OpenAI front").
"""

from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from warmup_tools.front.errors import OpenAIError
from warmup_tools.front.settings import FrontSettings

_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large", 503: "Service Unavailable"}


def bounded_httptools(settings: FrontSettings) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol (``uvicorn.Config(http=...)``) with three bounds, each answered in OpenAI's
    error body and followed by the connection's close:

    - ``max_header_bytes``: a request line and headers larger than that are answered 431. Two counts: the parsed
      line and headers (exact, checked as the parser hands each over), and, while a head is incomplete, the raw
      bytes received (the parser holds a header's pieces until its end, so a 10 MB header is refused once
      ``max_header_bytes`` and one read, 64 KiB, have arrived, not once it is whole).
    - ``head_timeout_s``: a head not whole that long after the connection was made, or after the first byte that
      followed a complete response (uvicorn's keep-alive timeout covers the idle time before it, and uvicorn
      cancels that timeout at any byte, even one that starts no request), is answered 408.
    - ``max_connections``: a connection made while that many are open is answered 503 at once, before anything
      is read from it, and closed; it costs no parsing and holds its descriptor no longer than that.

    A refusal that comes while an earlier request's response is still being sent on the same connection (a
    pipelined head) writes nothing into that response: reading stops and the connection closes once the response
    is complete."""
    max_head_bytes = settings.max_header_bytes
    head_timeout_s = settings.head_timeout_s
    max_connections = settings.max_connections

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        _head_timer = None
        _refused = False

        def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self._refuse(503, OpenAIError(
                    503, f"This server holds {max_connections} connections, the most it takes: retry shortly or "
                         "on another replica.", code="too_many_connections"))
                return
            self._start_head()
            self._arm_head_timer()  # the first head's deadline runs from the connection's start

        def connection_lost(self, exc) -> None:  # type: ignore[no-untyped-def]
            self._stop_head_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self.timeout_keep_alive_task is not None:
                # Idle after a response: these bytes cancel uvicorn's keep-alive timeout and start the next head.
                self._arm_head_timer()
            counting = self._in_head
            super().data_received(data)
            if counting and self._in_head and not self.transport.is_closing():
                self._raw_bytes += len(data)
                if self._raw_bytes > max_head_bytes:
                    self._refuse_head()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._start_head()
            if self._head_timer is None:  # a head pipelined behind a request still being answered
                self._arm_head_timer()

        def on_url(self, url: bytes) -> None:
            self._count(len(url) + 16)  # and the method and version
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._stop_head_timer()
            super().on_headers_complete()

        def send_400_response(self, msg: str) -> None:
            if self._head_bytes > max_head_bytes:
                self._refuse_head()
            else:
                super().send_400_response(msg)

        def _start_head(self) -> None:
            self._in_head = True
            self._head_bytes = 0  # the request line and headers parsed so far
            self._raw_bytes = 0  # bytes received while the head was incomplete

        def _arm_head_timer(self) -> None:
            self._stop_head_timer()
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_timed_out)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self._refuse(408, OpenAIError(
                    408, f"The request line and headers did not arrive within {head_timeout_s:g} s.",
                    code="request_timeout"))

        def _count(self, size: int) -> None:
            self._head_bytes += size
            if self._head_bytes > max_head_bytes:
                raise _HeadTooLarge()  # the parser stops and reports a callback error: send_400_response above

        def _refuse_head(self) -> None:
            self._refuse(431, OpenAIError(
                431, f"The request line and headers are larger than {max_head_bytes} bytes, the most this server "
                     "takes.", code="headers_too_large"))

        def _refuse(self, status: int, error: OpenAIError) -> None:
            self._stop_head_timer()
            self._refused = True
            if self.cycle is not None and not self.cycle.response_complete:
                self.flow.pause_reading()
                self.cycle.keep_alive = False  # uvicorn closes the connection once this response is complete
                return
            body = json.dumps(error.body()).encode()
            self.transport.write(f"HTTP/1.1 {status} {_REASONS[status]}\r\n".encode()
                                 + b"content-type: application/json\r\ncontent-length: "
                                 + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
            self.transport.close()

    return BoundedHttpToolsProtocol


class _HeadTooLarge(Exception):
    """Raised from a parser callback when the head passed its bound."""
