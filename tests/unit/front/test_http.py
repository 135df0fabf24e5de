"""The front's HTTP protocol on a real socket (uvicorn, httptools): a head larger than ``max_header_bytes`` is
answered 431 and the connection closed; body bytes and earlier requests on a kept-alive connection never count."""

from __future__ import annotations

import json
import socket

import pytest

from tests.unit.front.conftest import ScriptedEngine
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


def _answers(front: FrontServer, data: bytes, count: int) -> list[tuple[int, bytes]]:
    """Send ``data`` on one connection and read ``count`` answers (status, body); fewer if the server closes."""
    answers: list[tuple[int, bytes]] = []
    with socket.create_connection(("127.0.0.1", front.port), timeout=30) as sock:
        try:
            sock.sendall(data)
        except OSError:  # the server answered and closed before all was sent
            pass
        buffer = b""
        while len(answers) < count:
            head, sep, rest = buffer.partition(b"\r\n\r\n")
            if sep:
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length:")))
                if len(rest) >= length:
                    answers.append((int(head.split(b" ", 2)[1]), rest[:length]))
                    buffer = rest[length:]
                    continue
            try:
                chunk = sock.recv(65536)
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
