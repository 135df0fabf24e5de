"""The requests the front sends tritonserver, and its unary inferences' answers and errors.

Against an in-process gRPC servicer standing in for tritonserver's ``ModelInfer``; the real server is exercised
through the front's integration tests (tests/integration/test_front.py)."""

import asyncio
import contextlib
import http.server
import json
import threading

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import deserialize_bytes_tensor

from warmup_tools.front.engine.engine import EngineError, GenerateInput
from warmup_tools.front.engine.protocol import infer_request
from warmup_tools.front.engine.triton_engine import TritonEngine


def test_a_request_carries_its_tensors_and_parameters_as_triton_reads_them():
    text = np.array(["héllo".encode()], dtype=object)
    request = infer_request("tokenizer_cache", "u1", [("text_input", "BYTES", text),
                                                      ("max_tokens", "INT32", np.array([7], dtype=np.int32))],
                            outputs=("cluster_id",), parameters={"chat_roles": "[]"})
    assert (request.model_name, request.id) == ("tokenizer_cache", "u1")
    assert [(t.name, t.datatype, list(t.shape)) for t in request.inputs] == [("text_input", "BYTES", [1]),
                                                                           ("max_tokens", "INT32", [1])]
    assert deserialize_bytes_tensor(request.raw_input_contents[0]).tolist() == ["héllo".encode()]
    assert np.frombuffer(request.raw_input_contents[1], dtype=np.int32).tolist() == [7]
    assert [o.name for o in request.outputs] == ["cluster_id"]
    assert request.parameters["chat_roles"].string_param == "[]"


class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Echoes input ``x``; model ``bad`` answers INVALID_ARGUMENT with a model's message, ``slow`` never answers,
    ``internal`` INVALID_ARGUMENT with tritonserver's own text; a stream answers tritonserver's text of a python
    model's failure."""

    async def ModelStreamInfer(self, request_iterator, context):
        async for request in request_iterator:
            yield service_pb2.ModelStreamInferResponse(error_message=(
                f"in ensemble '{request.model_name}', Failed to process the request(s) for model instance "
                "'lora_adapter_0_0', message: TypeError: bad"))

    async def ModelInfer(self, request, context):
        if request.model_name == "bad":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "[invalid] input 'x' is wrong: use 0 to 9")
        if request.model_name == "internal":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "[request id: <id_unknown>] unexpected shape for "
                                "input 'x' for model 'internal'. Expected [-1], got [2]")
        if request.model_name == "slow":
            await asyncio.sleep(30)
        response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
        response.outputs.add(name="echo", datatype="INT32", shape=[1])
        response.raw_output_contents.append(request.raw_input_contents[0])
        return response


@contextlib.asynccontextmanager
async def served(timeout_s: float = 30.0, sidecar_url: str = ""):
    """A servicer on a free port and a started engine whose gRPC goes there; everything closed after."""
    server = grpc.aio.server()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(Servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    engine = TritonEngine(f"127.0.0.1:{port}", "http://127.0.0.1:1/metrics", timeout_s=timeout_s,
                          poll_interval_s=3600, sidecar_url=sidecar_url)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.close()
        await server.stop(None)


def _value(n: int):
    return [("x", "INT32", np.array([n], dtype=np.int32))]


def test_concurrent_unary_inferences_each_get_their_answer():
    async def run():
        async with served() as engine:
            results = await asyncio.gather(*(engine._unary("m", _value(n)) for n in range(5)))
            assert [int(r.as_numpy("echo")[0]) for r in results] == [0, 1, 2, 3, 4]
    asyncio.run(run())


def test_a_model_s_error_is_its_caller_s_with_the_kind_it_carries():
    async def run():
        async with served() as engine:
            with pytest.raises(EngineError) as bad:
                await engine._unary("bad", _value(4))
            assert (bad.value.kind, bad.value.message) == ("invalid", "input 'x' is wrong: use 0 to 9")
            assert int((await engine._unary("m", _value(3))).as_numpy("echo")[0]) == 3
    asyncio.run(run())


def test_tritonservers_own_text_is_an_internal_error_on_a_unary_call_and_on_a_stream():
    async def run():
        async with served() as engine:
            with pytest.raises(EngineError) as unary:
                await engine._unary("internal", _value(4))
            assert unary.value.kind == "internal"
            engine.pipeline = "ensemble"
            with pytest.raises(EngineError) as streamed:
                async for _ in engine.generate(GenerateInput("hi", adapter=None, tenant=None)):
                    pass
            assert streamed.value.kind == "internal"
    asyncio.run(run())


def test_no_answer_in_time_is_a_timeout():
    async def run():
        async with served(timeout_s=0.1) as engine:
            with pytest.raises(EngineError) as late:
                await engine._unary("slow", _value(1))
            assert late.value.kind == "timeout"
    asyncio.run(run())


class NotReady(http.server.BaseHTTPRequestHandler):
    """A sidecar whose /ready fails with its reason, which names tritonserver's internals."""

    def do_GET(self):
        body = json.dumps({"ready": False, "reason": "lora_adapter: unhealthy (Stub process 'lora_adapter_0_0' is "
                                                     "not healthy.)"}).encode()
        self.send_response(503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_sidecars_reason_for_not_ready_reaches_no_client():
    """The reason is what a request's 503 and /health say; the sidecar's /status has the details for operators."""
    sidecar = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotReady)
    thread = threading.Thread(target=sidecar.serve_forever, daemon=True)
    thread.start()

    async def run():
        async with served(sidecar_url=f"http://127.0.0.1:{sidecar.server_address[1]}") as engine:
            return await engine.readiness(refresh=True)

    try:
        readiness = asyncio.run(run())
    finally:
        sidecar.shutdown()
        sidecar.server_close()
    assert not readiness.ready and readiness.reason
    assert "lora_adapter" not in readiness.reason and "Stub" not in readiness.reason
