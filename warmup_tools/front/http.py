"""The front's HTTP/1.1 protocol: uvicorn's httptools protocol (llhttp, a C parser) with a bound on a request's
head, which llhttp does not have.

Why not uvicorn's h11 protocol, which has such a bound (``h11_max_incomplete_event_size``): h11 parses in pure
Python. On the development machine httptools and uvloop together took 0.5 to 0.7 ms off the TTFT p50 of a streamed
request and 0.4 to 0.8 ms off the front's CPU per request (``scripts/front_ab.py``; docs/benchmarks.md, "The
front's added TTFT").
"""

from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from warmup_tools.front.errors import OpenAIError


def bounded_httptools(max_head_bytes: int, head_timeout_s: float = 10.0) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol (``uvicorn.Config(http=...)``) that answers 431 and closes the connection when a
    request's line and headers are larger than ``max_head_bytes``, and 408 when they have not all arrived
    ``head_timeout_s`` after the connection started or the next request's first byte (uvicorn's keep-alive timeout
    only runs between requests, after a response: a connection that never finishes its first head held its
    descriptor for ever).

    Two counts: the parsed line and headers (exact, checked as the parser hands each over), and, while a head is
    incomplete, the raw bytes received (the parser holds a header's pieces until its end, so a 10 MB header is
    refused once ``max_head_bytes`` and one read, 64 KiB, have arrived, not once it is whole)."""

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        _head_timer = None

        def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
            super().connection_made(transport)
            self._start_head()

        def connection_lost(self, exc) -> None:  # type: ignore[no-untyped-def]
            self._stop_head_timer()
            super().connection_lost(exc)

        def _start_head(self) -> None:
            self._in_head = True
            self._head_bytes = 0  # the request line and headers parsed so far
            self._raw_bytes = 0  # bytes received while the head was incomplete
            self._stop_head_timer()
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_timed_out)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self._in_head and not self.transport.is_closing():
                self._refuse(408, "Request Timeout", OpenAIError(
                    408, f"The request line and headers did not arrive within {head_timeout_s:g} s.",
                    code="request_timeout"))

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._start_head()

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

        def _count(self, size: int) -> None:
            self._head_bytes += size
            if self._head_bytes > max_head_bytes:
                raise _HeadTooLarge()  # the parser stops and reports a callback error: send_400_response below

        def data_received(self, data: bytes) -> None:
            counting = self._in_head
            super().data_received(data)
            if counting and self._in_head and not self.transport.is_closing():
                self._raw_bytes += len(data)
                if self._raw_bytes > max_head_bytes:
                    self._refuse_head()

        def send_400_response(self, msg: str) -> None:
            if self._head_bytes > max_head_bytes:
                self._refuse_head()
            else:
                super().send_400_response(msg)

        def _refuse_head(self) -> None:
            self._refuse(431, "Request Header Fields Too Large", OpenAIError(
                431, f"The request line and headers are larger than {max_head_bytes} bytes, the most this server "
                     "takes.", code="headers_too_large"))

        def _refuse(self, status: int, reason: str, error: OpenAIError) -> None:
            self._stop_head_timer()
            body = json.dumps(error.body()).encode()
            self.transport.write(f"HTTP/1.1 {status} {reason}\r\n".encode()
                                 + b"content-type: application/json\r\ncontent-length: "
                                 + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
            self.transport.close()

    return BoundedHttpToolsProtocol


class _HeadTooLarge(Exception):
    """Raised from a parser callback when the head passed its bound."""
