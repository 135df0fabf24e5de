"""The front's HTTP protocol on a real socket (uvicorn, httptools): a head larger than ``max_header_bytes`` is
answered 431 and the connection closed (body bytes and earlier requests on a kept-alive connection never count),
a head not whole within ``head_timeout_s`` 408, a connection beyond ``max_connections`` 503; a chunked body over
``max_body_bytes`` 413."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading

import pytest

from tests.unit.front.conftest import ScriptedEngine
from tests.waiting import wait_for
from warmup_tools.front.server import FrontServer
from warmup_tools.front.settings import FrontSettings

LIMIT = 4096


@pytest.fixture(scope="module")
def front():
    with FrontServer(FrontSettings(port=0, max_header_bytes=LIMIT), engine=ScriptedEngine()) as server:
        yield server


def _request(padding: int, body: bytes = b'{"model": "base", "prompt": "hi"}') -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"X-Pad: " + b"a" * padding + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def _parse(data: bytes) -> list[tuple[int, bytes]]:
    """The answers (status, body) that make up ``data`` exactly."""
    answers = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        answers.append((int(head.split(b" ", 2)[1]), rest[:length]))
        data = rest[length:]
    return answers


def _answers(front: FrontServer, data: bytes, count: int) -> list[tuple[int, bytes]]:
    """Send ``data`` on one connection and read ``count`` answers (status, body); fewer if the server closes."""
    with socket.create_connection(("127.0.0.1", front.port), timeout=30) as sock:
        try:
            sock.sendall(data)
        except OSError:  # the server answered and closed before all was sent
            pass
        return _read_answers(sock, count)


def _read_answers(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """The next ``count`` answers (status, body) on ``sock``; fewer if the server closes."""
    answers: list[tuple[int, bytes]] = []
    buffer = b""
    while len(answers) < count:
        head, sep, rest = buffer.partition(b"\r\n\r\n")
        missing = 65536
        if sep:
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:")))
            if len(rest) >= length:
                answers.append((int(head.split(b" ", 2)[1]), rest[:length]))
                buffer = rest[length:]
                continue
            missing = length - len(rest)  # never past this answer: the next one's bytes stay on the socket
        try:
            chunk = sock.recv(missing)
        except ConnectionResetError:
            break
        if not chunk:
            break
        buffer += chunk
    return answers


def test_a_head_larger_than_the_limit_is_answered_431_with_an_openai_error(front):
    [(status, body)] = _answers(front, _request(LIMIT + 10), 2)
    assert status == 431
    error = json.loads(body)["error"]
    assert error["code"] == "headers_too_large" and str(LIMIT) in error["message"]


def test_a_head_sent_in_small_pieces_is_counted_whole(front):
    with socket.create_connection(("127.0.0.1", front.port), timeout=30) as sock:
        data = _request(LIMIT * 4)
        try:
            for start in range(0, len(data), 512):
                sock.sendall(data[start:start + 512])
        except OSError:
            pass
        assert sock.recv(65536).startswith(b"HTTP/1.1 431 ")


def test_body_bytes_and_earlier_requests_do_not_count_toward_the_head(front):
    large_body = json.dumps({"model": "base", "prompt": "x" * 60_000}).encode()
    # a head just under the limit with a 60 kB body in the same write, then two more on the same connection
    data = _request(LIMIT - 200, large_body) + _request(LIMIT - 200) + _request(LIMIT - 200)
    answers = _answers(front, data, 3)
    assert [status for status, _ in answers] == [200, 200, 200]
    # the connection and the server serve on
    assert [status for status, _ in _answers(front, _request(10), 1)] == [200]


@pytest.fixture(scope="module")
def strict_front():
    """A front with a short head deadline."""
    settings = FrontSettings(port=0, max_header_bytes=LIMIT, head_timeout_s=0.5)
    with FrontServer(settings, engine=ScriptedEngine()) as server:
        yield server


def _until_closed(sock: socket.socket) -> bytes:
    """All the server sends until it closes the connection (a hang fails at the socket's timeout)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _timed_out(data: bytes) -> bool:
    head, _, body = data.partition(b"\r\n\r\n")
    return (head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower()
            and json.loads(body)["error"]["code"] == "request_timeout")


def test_a_head_that_never_ends_is_answered_408_and_its_connection_closed(strict_front):
    half = _request(10)[:40]  # part of the request line and headers, then nothing
    with socket.create_connection(("127.0.0.1", strict_front.port), timeout=60) as sock:
        sock.sendall(half)
        assert _timed_out(_until_closed(sock))
    # A connection that sends nothing at all is closed the same way.
    with socket.create_connection(("127.0.0.1", strict_front.port), timeout=60) as sock:
        assert _timed_out(_until_closed(sock))
    # A whole request still works, and so does a second one on the same connection after the first answer.
    assert [status for status, _ in _answers(strict_front, _request(10) * 2, 2)] == [200, 200]


def test_a_kept_alive_connection_idles_past_the_head_deadline_and_a_stray_byte_after_it_starts_one():
    # NOTE: a keep-alive timeout (300 s) only a hang reaches: the connection is idle as long as the test needs.
    settings = FrontSettings(port=0, max_header_bytes=LIMIT, head_timeout_s=0.5, keep_alive_s=300)
    with FrontServer(settings, engine=ScriptedEngine()) as front, \
            socket.create_connection(("127.0.0.1", front.port), timeout=60) as kept:
        kept.sendall(_request(10))
        assert [status for status, _ in _read_answers(kept, 1)] == [200]
        # Idle between requests is bounded by keep_alive_s, not by the head deadline: once a connection made after
        # the answer has had its 408, the kept-alive one still takes a request.
        with socket.create_connection(("127.0.0.1", front.port), timeout=60) as later:
            assert _timed_out(_until_closed(later))
        kept.sendall(_request(10))
        assert [status for status, _ in _read_answers(kept, 1)] == [200]
        # A byte that starts no request (llhttp skips an empty line) ends uvicorn's keep-alive timeout all the same:
        # the head deadline runs from it.
        kept.sendall(b"\r\n")
        assert _timed_out(_until_closed(kept))


@dataclasses.dataclass
class HeldEngine(ScriptedEngine):
    """Holds each generation until ``release`` is set."""

    release: threading.Event = dataclasses.field(default_factory=threading.Event)
    held: int = 0

    async def generate(self, request):
        self.held += 1
        await asyncio.to_thread(self.release.wait, 300)
        async for chunk in super().generate(request):
            yield chunk


def test_a_pipelined_head_that_never_ends_leaves_the_answer_in_progress_whole():
    engine = HeldEngine()
    settings = FrontSettings(port=0, max_header_bytes=LIMIT, head_timeout_s=0.5)
    with FrontServer(settings, engine=engine) as front, \
            socket.create_connection(("127.0.0.1", front.port), timeout=60) as sock:
        # A request answered while the next one's head stays half sent behind it (one write: one read on the server,
        # so the half head has begun once the generation is held).
        sock.sendall(_request(10) + _request(10)[:40])
        wait_for(lambda: engine.held == 1, "the first request's generation held")
        with socket.create_connection(("127.0.0.1", front.port), timeout=60) as later:
            assert _timed_out(_until_closed(later))  # the half head's deadline has passed too
        engine.release.set()
        data = _until_closed(sock)
    # The answer in progress is whole and nothing follows it; the connection closes after it.
    [(status, body)] = _parse(data)
    assert status == 200 and json.loads(body)["choices"][0]["text"] == "Hello world"


def test_connections_beyond_the_bound_are_answered_503_at_once_and_those_within_keep_working():
    # NOTE: the held connections' head deadline (300 s) is one only a hang reaches: they are all open when the
    # next ones arrive, however slow the machine.
    settings = FrontSettings(port=0, max_header_bytes=LIMIT, head_timeout_s=300, max_connections=8)
    with FrontServer(settings, engine=ScriptedEngine()) as small:
        held = [socket.create_connection(("127.0.0.1", small.port), timeout=60) for _ in range(8)]
        try:
            for sock in held:
                sock.sendall(_request(10)[:20])  # each holds a connection with a half head
            # One more is answered before it sends anything (no head deadline to wait for) and closed.
            with socket.create_connection(("127.0.0.1", small.port), timeout=60) as beyond:
                head, _, body = _until_closed(beyond).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503 ") and b"connection: close" in head.lower()
            assert json.loads(body)["error"]["code"] == "too_many_connections"
            # One that sends a whole request gets no 200 (the 503; or a reset once its unread request is dropped).
            assert [status for status, _ in _answers(small, _request(10), 1)] in ([503], [])
            # The connections within the bound are served.
            held[0].sendall(_request(10)[20:])
            assert [status for status, _ in _read_answers(held[0], 1)] == [200]
        finally:
            for sock in held:
                sock.close()
        # Once their clients close them the front takes new connections again.
        wait_for(lambda: [s for s, _ in _answers(small, _request(10), 1)] == [200], "a request served again")


def test_a_chunked_body_larger_than_the_limit_is_answered_413_while_it_is_read():
    """No Content-Length to refuse it by: the bound holds on the bytes read (17 chunks of 64 KiB, 1 MiB allowed)."""
    settings = FrontSettings(port=0, max_body_bytes=1 << 20)
    with FrontServer(settings, engine=ScriptedEngine()) as small:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")
        piece = b'{"model": "base", "prompt": "' + b"a" * (64 << 10)
        chunk = hex(len(piece))[2:].encode() + b"\r\n" + piece + b"\r\n"
        [(status, body)] = _answers(small, head + chunk * 17 + b"0\r\n\r\n", 1)
        assert status == 413 and json.loads(body)["error"]["message"]
        chunked_ok = b'{"model": "base", "prompt": "hi"}'
        ok = head + hex(len(chunked_ok))[2:].encode() + b"\r\n" + chunked_ok + b"\r\n0\r\n\r\n"
        assert [s for s, _ in _answers(small, ok, 1)] == [200]
