"""Draining on SIGTERM: /health fails first, requests are still taken during the grace, then refused with 503,
and the drain returns once the requests in flight are done (waits on conditions, never on the clock)."""

from __future__ import annotations

import asyncio
import threading

from fastapi.testclient import TestClient

from tests.unit.front.conftest import TemplateTokenizer
from tests.waiting import wait_for
from warmup_tools.front.app import build_app
from warmup_tools.front.chat_template import ChatRenderer
from warmup_tools.front.drain import Drain
from warmup_tools.front.settings import FrontSettings


def _client(engine, drain: Drain) -> TestClient:
    return TestClient(build_app(FrontSettings(), engine, ChatRenderer(TemplateTokenizer()), drain),
                      raise_server_exceptions=False)


def test_health_fails_first_then_new_requests_are_refused_with_503(engine):
    drain = Drain()
    with _client(engine, drain) as client:
        body = {"model": "base", "prompt": "x"}
        assert client.get("/health").status_code == 200
        drain.draining = True  # what run() does first
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "draining"
        assert client.post("/v1/completions", json=body).status_code == 200  # the grace: still served
        drain.refusing = True
        refused = client.post("/v1/completions", json=body)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "draining"
        assert refused.json()["error"]["type"] == "service_unavailable"
        assert client.get("/v1/models").status_code == 200  # only generation requests are refused
        assert drain.active == 0


def test_the_drain_waits_for_the_requests_in_flight():
    drain = Drain()
    assert drain.enter()
    left: list[int] = []
    runner = threading.Thread(target=lambda: left.append(drain.run(grace_s=0, timeout_s=600)))
    runner.start()
    refusing = threading.Event()
    while not refusing.wait(0.01):  # until run() refuses new requests
        if drain.refusing:
            refusing.set()
    assert not drain.enter()
    assert runner.is_alive() and not left
    drain.leave()
    runner.join(60)
    assert left == [0]


def test_a_drain_that_times_out_says_how_many_were_left():
    drain = Drain()
    assert drain.enter() and drain.enter()
    assert drain.run(grace_s=0, timeout_s=0.01) == 2
    assert drain.draining and drain.refusing


def test_a_stop_event_cuts_the_grace_short():
    drain = Drain()
    stop = threading.Event()
    stop.set()
    assert drain.run(grace_s=3600, timeout_s=600, stop=stop) == 0


def test_the_gate_counts_a_generation_in_flight_and_the_drain_waits_for_it(engine):
    release = threading.Event()
    generating = threading.Event()
    pieces = engine.generate

    async def held(request):
        generating.set()
        while not release.is_set():  # the test holds the generation open until it has checked the count
            await asyncio.sleep(0.01)
        async for chunk in pieces(request):
            yield chunk

    engine.generate = held
    drain = Drain()
    answers: list[int] = []
    left: list[int] = []
    with _client(engine, drain) as client:
        sender = threading.Thread(target=lambda: answers.append(
            client.post("/v1/completions", json={"model": "base", "prompt": "x"}).status_code), daemon=True)
        sender.start()
        try:
            wait_for(generating.is_set, "the generation started")
            # The gate counts a request before the engine sees it.
            assert (drain.active, drain.total) == (1, 1)
            runner = threading.Thread(target=lambda: left.append(drain.run(grace_s=0, timeout_s=600)), daemon=True)
            runner.start()
            wait_for(lambda: drain.refusing, "new requests refused")
            assert runner.is_alive() and not left  # it waits for the request the gate counted
        finally:
            release.set()
            sender.join(60)
        runner.join(60)
    assert answers == [200] and left == [0] and drain.active == 0
