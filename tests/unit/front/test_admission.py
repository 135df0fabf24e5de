"""A tenant over its bound of requests in flight in one front is refused at the door: 429 ``rate_limit_exceeded``
with Retry-After before anything reaches the engine, while other tenants are served. A request's place is given
back when its answer ends, whatever ends it (success, an error, its client leaving mid-stream); a tenant with
nothing in flight keeps no entry; the sidecar's probe tenant is never refused."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Iterator

import httpx
import pytest

from tests.unit.front.conftest import ScriptedEngine, make_client
from tests.waiting import wait_for
from warmup_tools.common.records import PROBE_TENANT
from warmup_tools.common.wire import ErrorKind
from warmup_tools.front.admission import TenantLimit, tenant_bound
from warmup_tools.front.engine.engine import EngineError, GenerateChunk, GenerateInput
from warmup_tools.front.server import FrontServer, with_repository
from warmup_tools.front.settings import FrontSettings
from warmup_tools.lora_adapter.admission import TenantShares
from warmup_tools.lora_adapter.settings import SchedulerConfig
from warmup_tools.triton.trust import add_tenant_key


@dataclasses.dataclass
class StreamHoldingEngine(ScriptedEngine):
    """Sends a first piece, then holds a generation whose prompt says ``hold`` until ``release`` is set."""

    release: threading.Event = dataclasses.field(default_factory=threading.Event)
    holding: int = 0

    async def generate(self, request):
        self.requests.append(request)
        try:
            yield GenerateChunk("Hel", prompt_tokens=4, output_tokens=1)
            if "hold" in request.prompt:
                self.holding += 1
                try:
                    while not self.release.is_set():  # NOTE: polled, so a client's leaving cancels it at once
                        await asyncio.sleep(0.01)
                finally:
                    self.holding -= 1
            yield GenerateChunk("lo", prompt_tokens=4, output_tokens=2, finish_reason="length")
        finally:
            self.closed += 1


def _body(prompt: str, stream: bool = True) -> dict:
    return {"model": "base", "prompt": prompt, "max_tokens": 2, "stream": stream}


def _tenant(name: str) -> dict[str, str]:
    return {"X-Tenant-Id": name}


@pytest.fixture()
def held():
    engine = StreamHoldingEngine()
    with FrontServer(FrontSettings(port=0, tenant_max_in_flight=2), engine=engine) as front:
        try:
            yield engine, front
        finally:
            engine.release.set()


@dataclasses.dataclass
class OpenStream:
    """A streamed answer read up to its first event; :meth:`close` is its client going away."""

    response: httpx.Response
    lines: Iterator[str]  # NOTE: kept: the iterator's end closes the response

    def close(self) -> None:
        self.response.close()


def _open_stream(client: httpx.Client, url: str, tenant: str) -> OpenStream:
    """A streamed completion of ``tenant`` held open after its first event (the caller closes it)."""
    response = client.send(client.build_request("POST", f"{url}/v1/completions", json=_body("hold"),
                                                headers=_tenant(tenant)), stream=True)
    assert response.status_code == 200
    lines = response.iter_lines()
    assert next(lines).startswith("data: ")  # its first event has arrived: it is mid-stream
    return OpenStream(response, lines)


def test_a_tenant_over_its_bound_gets_429_with_retry_after_before_the_engine_while_another_is_served(held):
    engine, front = held
    with httpx.Client(timeout=60) as client:
        streams = [_open_stream(client, front.url, "flooder") for _ in range(2)]
        try:
            sent = len(engine.requests)
            for stream in (True, False):
                refused = client.post(f"{front.url}/v1/completions", json=_body("more", stream),
                                      headers=_tenant("flooder"))
                assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
                error = refused.json()["error"]
                assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
                assert "2 requests in flight" in error["message"]
            assert len(engine.requests) == sent  # nothing of the refused requests reached the engine
            served = client.post(f"{front.url}/v1/completions", json=_body("quiet", False), headers=_tenant("quiet"))
            assert served.status_code == 200 and served.json()["choices"][0]["text"] == "Hello"
            assert front.app.state.front.tenants.held("flooder") == 2
        finally:
            for stream in streams:
                stream.close()


def test_a_client_leaving_mid_stream_gives_its_place_back(held):
    engine, front = held
    tenants = front.app.state.front.tenants
    with httpx.Client(timeout=60) as client:
        streams = [_open_stream(client, front.url, "acme") for _ in range(2)]
        assert tenants.held("acme") == 2
        streams[0].close()  # the client goes away mid-stream
        wait_for(lambda: tenants.held("acme") == 1, "the place of the stream whose client left given back")
        streams[1].close()
        wait_for(lambda: len(tenants) == 0, "no entry left once the tenant has nothing in flight")
        wait_for(lambda: engine.holding == 0, "both generations cancelled on the engine")
        again = [_open_stream(client, front.url, "acme") for _ in range(2)]  # its whole bound again
        for stream in again:
            stream.close()
    wait_for(lambda: len(tenants) == 0, "every place given back")


def test_a_flood_of_unique_tenants_leaves_no_entry(held):
    engine, front = held
    tenants = front.app.state.front.tenants
    with httpx.Client(timeout=60) as client:
        streams = [_open_stream(client, front.url, f"tenant-{i}") for i in range(16)]
        assert len(tenants) == 16
        for stream in streams:
            stream.close()
        for i in range(64):
            answer = client.post(f"{front.url}/v1/completions", json=_body("x", i % 2 == 0),
                                 headers=_tenant(f"once-{i}"))
            assert answer.status_code == 200
    wait_for(lambda: len(tenants) == 0, "no entry left for tenants with nothing in flight")


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [True, False])
def test_the_place_is_given_back_after_a_success_a_refusal_and_an_error_mid_stream(engine, stream, route):
    def body() -> dict:
        if route == "/v1/completions":
            return _body("x", stream)
        return {"model": "base", "messages": [{"role": "user", "content": "x"}], "stream": stream}

    with make_client(engine, tenant_max_in_flight=1) as client:
        headers = _tenant("acme")
        for _ in range(3):  # a bound of 1: each request gets the place the previous one gave back
            assert client.post(route, json=body(), headers=headers).status_code == 200
        engine.error = EngineError(ErrorKind.RATE_LIMITED, "too many concurrent requests from this tenant")
        assert client.post(route, json=body(), headers=headers).status_code == 429
        engine.error = EngineError(ErrorKind.UNAVAILABLE, "the stream broke")
        engine.error_after = 1
        answer = client.post(route, json=body(), headers=headers)
        assert answer.status_code == (200 if stream else 503)  # streamed: the error is the stream's last event
        engine.error, engine.error_after = None, None
        assert client.post(route, json=body(), headers=headers).status_code == 200
        assert len(client.app.state.front.tenants) == 0


def test_the_probe_tenant_proven_by_its_key_is_never_refused_and_other_tenants_are(tmp_path):
    keys_file, secret = tmp_path / "tenant_keys.json", tmp_path / "deployment.secret"
    probe_key = add_tenant_key(keys_file, secret, PROBE_TENANT)
    acme_key = add_tenant_key(keys_file, secret, "acme")
    limit = TenantLimit(1)
    assert limit.acquire(PROBE_TENANT, proven=True) is None and limit.acquire(PROBE_TENANT, proven=True) is None
    assert len(limit) == 0
    limit.acquire(PROBE_TENANT, proven=False)  # open mode: a name anyone can send counts as any tenant
    with pytest.raises(Exception, match="too many concurrent"):
        limit.acquire(PROBE_TENANT, proven=False)
    engine = StreamHoldingEngine()
    settings = FrontSettings(port=0, tenant_max_in_flight=1, tenant_keys_file=keys_file)
    with FrontServer(settings, engine=engine) as front, httpx.Client(timeout=60) as client:
        try:
            def open_as(key: str) -> httpx.Response:
                request = client.build_request("POST", f"{front.url}/v1/completions", json=_body("hold"),
                                               headers={"Authorization": f"Bearer {key}"})
                return client.send(request, stream=True)

            probes = [open_as(probe_key) for _ in range(3)]
            assert [p.status_code for p in probes] == [200, 200, 200]
            first = open_as(acme_key)
            second = open_as(acme_key)
            assert (first.status_code, second.status_code) == (200, 429)
            for response in (*probes, first, second):
                response.close()
        finally:
            engine.release.set()
    wait_for(lambda: len(front.app.state.front.tenants) == 0, "every place given back")


def test_the_default_bound_is_what_lora_adapter_holds_for_one_tenant():
    assert tenant_bound(0) == TenantShares.of(SchedulerConfig()).max_held == 8 + 32
    small = SchedulerConfig(max_num_seqs=4, max_queue=8)
    assert tenant_bound(0, small) == 8 and tenant_bound(5, small) == 5
    environ = {"WARMUP_MAX_NUM_SEQS": "4", "WARMUP_MAX_QUEUE": "8", "WARMUP_TENANT_QUEUE_SHARE": "0.25"}
    settings, _ = with_repository(FrontSettings(), environ)
    assert settings.tenant_max_in_flight == 4 + 2  # read from the repository's lora_adapter
    assert with_repository(FrontSettings(tenant_max_in_flight=3), environ)[0].tenant_max_in_flight == 3
    with pytest.raises(Exception, match="tenant_max_in_flight"):
        FrontSettings(tenant_max_in_flight=-1)


def test_a_stream_that_fails_before_its_first_byte_gives_its_place_back():
    from warmup_tools.front.generation import Generation, GenerationStream, InFlight

    async def scenario() -> TenantLimit:
        limit = TenantLimit(1)
        request = GenerateInput(prompt="hold", adapter=None, tenant="acme", tenant_key=None, sampling={})
        generation = Generation(StreamHoldingEngine(), request, (), "base", InFlight(), limit)
        await generation.start()
        assert limit.held("acme") == 1

        async def body():
            async for piece in generation.pieces():
                yield piece.encode()

        async def receive() -> dict:
            await asyncio.Event().wait()  # the client says nothing
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            raise ConnectionResetError("the client went away before the answer began")

        with pytest.raises(ConnectionResetError):
            await GenerationStream(generation, body())({"type": "http", "asgi": {"spec_version": "2.3"}},
                                                       receive, send)
        return limit

    assert len(asyncio.run(scenario())) == 0
