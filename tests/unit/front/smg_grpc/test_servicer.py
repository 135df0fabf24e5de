"""The VllmEngine RPCs of one listener over a scripted engine (no tritonserver): what each answers, how engine
errors map to gRPC status codes, the trace context and the tenant bound. The same RPCs on a real tritonserver behind a
real smg: tests/integration/test_smg_grpc_worker.py."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from tests.unit.front.conftest import ScriptedEngine
from warmup_tools.common.errors import ConfigError
from warmup_tools.common.wire import ErrorKind
from warmup_tools.front.auth import TenantResolver
from warmup_tools.front.engine.engine import EngineError
from warmup_tools.front.engine.triton_engine import TokenChunk
from warmup_tools.front.serving import FrontState
from warmup_tools.front.settings import FrontSettings
from warmup_tools.front.smg_grpc.kv_proxy import KvEventsProxy
from warmup_tools.front.smg_grpc.listeners import check_trust
from warmup_tools.front.smg_grpc.sampling import GenerateLimits
from warmup_tools.front.smg_grpc.servicer import LmInfo, ModelServicer, WorkerContext

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@dataclasses.dataclass
class TokenEngine(ScriptedEngine):
    """Answers each generation with three tokens, or raises ``error``; ``hold`` keeps it open after the first."""

    calls: list[tuple] = dataclasses.field(default_factory=list)
    texts: list = dataclasses.field(default_factory=list)
    hold: asyncio.Event | None = None
    closed_generations: int = 0
    tracer: object | None = None

    async def generate_tokens(self, input_ids, adapter, tenant, sampling, trace=None, *, text=None):
        self.calls.append((tuple(input_ids), adapter, tenant, dict(sampling), trace))
        self.texts.append(text)
        try:
            if self.error is not None:
                raise self.error
            yield TokenChunk((11,), prompt_tokens=len(input_ids), cached_tokens=16, output_tokens=1)
            if self.hold is not None:
                await self.hold.wait()
            yield TokenChunk((12,), prompt_tokens=len(input_ids), cached_tokens=16, output_tokens=2)
            yield TokenChunk((13,), prompt_tokens=len(input_ids), cached_tokens=16, output_tokens=3,
                             finish_reason="length")
        finally:
            self.closed_generations += 1


async def serve(engine: TokenEngine, adapter: str | None = None, **settings):
    state = FrontState(FrontSettings(**settings), engine, TenantResolver(None), None)
    shared = WorkerContext(state, GenerateLimits(max_prompt_tokens=64, vocab_size=100), LmInfo(vocab_size=100),
                           block_size=16, max_num_seqs=8, tokenizer_path=None, kv=KvEventsProxy(None))
    server = grpc.aio.server()
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(ModelServicer(shared, adapter or "base", adapter), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port, shared


def generate(request_id="r1", stream=True, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
                              stream=stream, sampling_params=pb.SamplingParams(**sampling))


async def call(engine, request, adapter=None, metadata=None, **settings):
    server, port, _ = await serve(engine, adapter, **settings)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            try:
                return [a async for a in stub.Generate(request, metadata=metadata, timeout=60)], None
            except grpc.aio.AioRpcError as exc:
                return None, exc
    finally:
        await server.stop(0)


def test_a_streamed_generation_sends_each_token_then_the_complete_answer():
    engine = TokenEngine(tracer=object())
    answers, error = asyncio.run(call(engine, generate(max_tokens=3, temperature=0.5), adapter="sql",
                                      metadata=(("traceparent", TRACEPARENT),)))
    assert error is None
    assert [list(a.chunk.token_ids) for a in answers[:-1]] == [[11], [12], [13]]
    assert answers[1].chunk.completion_tokens == 2 and answers[1].chunk.cached_tokens == 16
    complete = answers[-1].complete
    assert list(complete.output_ids) == [11, 12, 13] and complete.finish_reason == "length"
    assert (complete.prompt_tokens, complete.completion_tokens, complete.cached_tokens) == (3, 3, 16)
    ids, adapter, tenant, sampling, trace = engine.calls[0]
    assert ids == (1, 2, 3) and adapter == "sql" and tenant == "default"
    assert sampling == {"max_tokens": 3, "temperature": pytest.approx(0.5)}
    assert trace is not None and trace.traceparent == TRACEPARENT  # the caller's trace continues


def test_a_non_streamed_generation_sends_the_complete_answer_alone():
    answers, _ = asyncio.run(call(TokenEngine(), generate(stream=False)))
    assert len(answers) == 1 and list(answers[0].complete.output_ids) == [11, 12, 13]


@pytest.mark.parametrize("kind, code, words", [
    (ErrorKind.INVALID, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens is above 512"),
    (ErrorKind.BUSY, grpc.StatusCode.RESOURCE_EXHAUSTED, "max_tokens is above 512"),
    (ErrorKind.RATE_LIMITED, grpc.StatusCode.RESOURCE_EXHAUSTED, "max_tokens is above 512"),
    (ErrorKind.NOT_FOUND, grpc.StatusCode.NOT_FOUND, "max_tokens is above 512"),
    (ErrorKind.TIMEOUT, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline"),
    (ErrorKind.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE, "cannot serve the request now"),
    (ErrorKind.INTERNAL, grpc.StatusCode.INTERNAL, "internal error"),
])
def test_engine_errors_keep_their_kind_and_server_side_text_stays_in_the_log(kind, code, words):
    engine = TokenEngine(error=EngineError(kind, "max_tokens is above 512"))
    _, error = asyncio.run(call(engine, generate()))
    assert error.code() == code and words in error.details()


def test_not_ready_not_live_and_over_the_tenant_bound_are_refused_before_the_engine():
    _, error = asyncio.run(call(TokenEngine(ready=False), generate()))
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "not ready" in error.details()
    _, error = asyncio.run(call(TokenEngine(), generate(), adapter="legal"))  # legal is warming
    assert error.code() == grpc.StatusCode.NOT_FOUND and "'legal'" in error.details()
    engine = TokenEngine(hold=asyncio.Event())

    async def two_at_once():
        server, port, _ = await serve(engine, tenant_max_in_flight=1)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
                first = stub.Generate(generate("a"), timeout=60)
                await first.read()  # the first holds the tenant's one place
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    [a async for a in stub.Generate(generate("b"), timeout=60)]
                first.cancel()
                return raised.value
        finally:
            await server.stop(0)

    error = asyncio.run(two_at_once())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(engine.calls) == 1


def test_abort_and_a_cancelled_call_end_the_generation_and_forget_its_id():
    engine = TokenEngine(hold=asyncio.Event())

    async def scenario():
        server, port, shared = await serve(engine)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
                held = stub.Generate(generate("held"), timeout=60)
                await held.read()
                assert "held" in shared.running
                with pytest.raises(grpc.aio.AioRpcError) as raised:  # the same id twice at once
                    [a async for a in stub.Generate(generate("held"), timeout=60)]
                assert raised.value.code() == grpc.StatusCode.ALREADY_EXISTS
                await stub.Abort(pb.AbortRequest(request_ids=["unknown", "held"]), timeout=60)
                rest = []
                while (answer := await held.read()) is not grpc.aio.EOF:
                    rest.append(answer)
                assert rest[-1].complete.finish_reason == "abort"
                assert "held" not in shared.running and engine.closed_generations == 1
                cancelled = stub.Generate(generate("gone"), timeout=60)
                await cancelled.read()
                cancelled.cancel()
                while "gone" in shared.running or engine.closed_generations < 2:
                    await asyncio.sleep(0.01)  # until the handler saw the cancellation (no time bound)
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def test_health_model_and_server_info():
    async def scenario(engine, adapter=None):
        server, port, _ = await serve(engine, adapter)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
                try:
                    health = await stub.HealthCheck(pb.HealthCheckRequest(), timeout=60)
                except grpc.aio.AioRpcError as exc:
                    health = exc.code()
                info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
                server_info = await stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=60)
                loads = await stub.GetLoads(pb.GetLoadsRequest(), timeout=60)
                return health, info, server_info, loads
        finally:
            await server.stop(0)

    health, info, server_info, loads = asyncio.run(scenario(TokenEngine(), "sql"))
    assert health.healthy and info.served_model_name == "sql" and info.model_path == "" and info.vocab_size == 100
    assert server_info.block_size == 16 and server_info.max_num_seqs == 8
    assert (loads.loads[0].num_running_reqs, loads.loads[0].num_waiting_reqs) == (3, 1)
    assert loads.loads[0].token_usage == pytest.approx(0.25)
    assert asyncio.run(scenario(TokenEngine(ready=False)))[0] == grpc.StatusCode.UNAVAILABLE
    assert asyncio.run(scenario(TokenEngine(), "legal"))[0] == grpc.StatusCode.UNAVAILABLE  # not live


def test_trust_mode_refuses_the_listeners_and_the_ports_must_fit():
    with pytest.raises(ConfigError, match="cannot prove a request's tenant"):
        check_trust(FrontSettings(grpc_worker_port=9100, tenant_keys_file=Path("/keys.json")))
    check_trust(FrontSettings(tenant_keys_file=Path("/keys.json")))  # off: nothing to refuse
    with pytest.raises(ConfigError, match="no room"):
        FrontSettings(grpc_worker_port=65530, grpc_worker_models=16)


def test_grpc_workers_is_404_without_listeners():
    from tests.unit.front.conftest import make_client

    with make_client(TokenEngine()) as client:
        assert client.get("/grpc-workers").status_code == 404


def test_an_abort_during_a_write_waits_for_it_before_its_own_answer():
    """Abort cancels the generation's task; a write it was inside goes on (gRPC's core still holds it) and the
    abort's answer goes out only once it is done: two writes at once had failed with TOO_MANY_OPERATIONS and left
    the stream open (tests/integration/test_smg_grpc_worker.py::test_abort_ends_a_running_generation_by_its_request_id
    against the real server)."""
    from warmup_tools.front.smg_grpc.servicer import Running

    class HeldContext:
        """A call's context whose first write is held until released; every write's start and end recorded."""

        def __init__(self) -> None:
            self.release = asyncio.Event()
            self.events: list[str] = []

        async def write(self, message: str) -> None:
            self.events.append(f"start {message}")
            if message == "chunk":
                await self.release.wait()
            self.events.append(f"end {message}")

    async def scenario():
        context, running = HeldContext(), Running()
        running.task = asyncio.ensure_future(running.write(context, "chunk"))
        while context.events != ["start chunk"]:
            await asyncio.sleep(0)
        running.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running.task
        answered = asyncio.ensure_future(running.written())
        await asyncio.sleep(0)
        assert not answered.done()  # the chunk is still being written
        context.release.set()
        await answered
        await context.write("abort")
        assert context.events == ["start chunk", "end chunk", "start abort", "end abort"]

    asyncio.run(scenario())
