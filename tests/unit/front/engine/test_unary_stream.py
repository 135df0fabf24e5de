"""Unary inferences multiplexed over one stream: answers reach their callers by id, whatever their order, errors
included; a broken stream fails who waits on it and the next inference opens a new one.

Against an in-process gRPC servicer standing in for tritonserver's stream; the real server is exercised through
the front's integration tests (tests/integration/test_front.py)."""

import asyncio
import contextlib

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import deserialize_bytes_tensor

from warmup_tools.front.engine.engine import EngineError
from warmup_tools.front.engine.unary_stream import UnaryError, UnaryStream, infer_request


def test_a_request_carries_its_tensors_as_triton_reads_them():
    text = np.array(["héllo".encode()], dtype=object)
    request = infer_request("tokenizer_cache", "u1", [("text_input", "BYTES", text),
                                                      ("max_tokens", "INT32", np.array([7], dtype=np.int32))],
                            outputs=("cluster_id",))
    assert (request.model_name, request.id) == ("tokenizer_cache", "u1")
    assert [(t.name, t.datatype, list(t.shape)) for t in request.inputs] == [("text_input", "BYTES", [1]),
                                                                           ("max_tokens", "INT32", [1])]
    assert deserialize_bytes_tensor(request.raw_input_contents[0]).tolist() == ["héllo".encode()]
    assert np.frombuffer(request.raw_input_contents[1], dtype=np.int32).tolist() == [7]
    assert [o.name for o in request.outputs] == ["cluster_id"]


class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Holds requests until ``release`` says how many to answer, then answers them in reverse order; a request
    for model ``bad`` gets an error answer, one for ``break`` ends the stream."""

    def __init__(self) -> None:
        self.streams = 0
        self.held: list[service_pb2.ModelInferRequest] = []
        self.release: asyncio.Queue = asyncio.Queue()
        self.seen: asyncio.Queue = asyncio.Queue()

    async def ModelStreamInfer(self, request_iterator, context):
        self.streams += 1
        async for request in request_iterator:
            self.seen.put_nowait(request.id)
            if request.model_name == "break":
                return  # the stream ends under its callers (as when tritonserver goes away)
            self.held.append(request)
            if len(self.held) < await self.release.get():
                continue
            for held in reversed(self.held):
                yield self._answer(held)
            self.held = []

    @staticmethod
    def _answer(request: service_pb2.ModelInferRequest) -> service_pb2.ModelStreamInferResponse:
        if request.model_name == "bad":
            return service_pb2.ModelStreamInferResponse(error_message=f"input 'x' is wrong ({request.id})",
                                                        infer_response=service_pb2.ModelInferResponse(id=request.id))
        echo = request.raw_input_contents[0]
        response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
        response.outputs.add(name="echo", datatype="INT32", shape=[1])
        response.raw_output_contents.append(echo)
        return service_pb2.ModelStreamInferResponse(infer_response=response)


@contextlib.asynccontextmanager
async def served():
    """A servicer on a free port and a UnaryStream to it; everything closed after."""
    server = grpc.aio.server()
    servicer = Servicer()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    unary = UnaryStream(channel)
    try:
        yield servicer, unary
    finally:
        await unary.close()
        await channel.close()
        await server.stop(None)


def _value(n: int):
    return [("x", "INT32", np.array([n], dtype=np.int32))]


def test_answers_out_of_order_reach_their_callers_on_one_stream():
    async def run():
        async with served() as (servicer, unary):
            calls = [asyncio.create_task(unary.infer("m", _value(n), timeout_s=30)) for n in range(5)]
            for _ in range(5):
                await servicer.release.put(5)  # one release per request read; the fifth answers all
            results = await asyncio.gather(*calls)
            assert [int(r.as_numpy("echo")[0]) for r in results] == [0, 1, 2, 3, 4]
            assert servicer.streams == 1 and unary.waiting == 0
    asyncio.run(run())


def test_an_error_answer_is_its_caller_s_only():
    async def run():
        async with served() as (servicer, unary):
            good = asyncio.create_task(unary.infer("m", _value(3), timeout_s=30))
            bad = asyncio.create_task(unary.infer("bad", _value(4), timeout_s=30))
            await servicer.release.put(2)
            await servicer.release.put(2)
            with pytest.raises(UnaryError, match=r"input 'x' is wrong"):
                await bad
            assert int((await good).as_numpy("echo")[0]) == 3
    asyncio.run(run())


def test_a_broken_stream_fails_its_waiters_and_the_next_call_opens_a_new_one():
    async def run():
        async with served() as (servicer, unary):
            waiting = asyncio.create_task(unary.infer("m", _value(1), timeout_s=30))
            await servicer.release.put(2)  # held: waits for a second request
            await servicer.seen.get()
            with pytest.raises(EngineError) as broken:
                await unary.infer("break", _value(2), timeout_s=30)
            assert broken.value.kind == "unavailable"
            with pytest.raises(EngineError) as lost:
                await waiting
            assert lost.value.kind == "unavailable"
            servicer.held = []
            after = asyncio.create_task(unary.infer("m", _value(9), timeout_s=30))
            await servicer.release.put(1)
            assert int((await after).as_numpy("echo")[0]) == 9
            assert servicer.streams == 2 and unary.waiting == 0
    asyncio.run(run())


def test_no_answer_in_time_is_a_timeout_and_leaves_nothing_waiting():
    async def run():
        async with served() as (servicer, unary):
            with pytest.raises(EngineError) as late:
                await unary.infer("m", _value(1), timeout_s=0.05)
            assert late.value.kind == "timeout" and unary.waiting == 0
    asyncio.run(run())
