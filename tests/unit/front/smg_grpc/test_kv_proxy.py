"""SubscribeKvEvents relayed from an instance's event socket: the scope metadata, every batch, the final status
(a refusal before headers stays one), one socket only, a subscriber that leaves ends the instance's call.

The instance here is a small gRPC server in the test, on a unix socket (lora_adapter's own event server is tested
end to end in tests/integration/)."""

import asyncio
import shutil
import tempfile
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc

from warmup_tools.front.smg_grpc.kv_proxy import OWNER_KEY, TENANT_KEY, KvEventsProxy


class Instance(vllm_engine_pb2_grpc.VllmEngineServicer):
    """An instance's event server: ``mode`` says what it answers."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.metadata: dict[str, str] = {}
        self.requests: list[common_pb2.SubscribeKvEventsRequest] = []
        self.left = asyncio.Event()

    async def SubscribeKvEvents(self, request, context):
        self.metadata = {key: value for key, value in context.invocation_metadata()}
        self.requests.append(request)
        if self.mode == "out_of_range":
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, "sequence 5 is before the replay window")
        await context.send_initial_metadata(())
        if self.mode == "forever":
            try:
                await asyncio.sleep(3600)
            finally:
                self.left.set()
        for number in (request.start_sequence_number, request.start_sequence_number + 1):
            yield common_pb2.KvEventBatch(sequence_number=number)
        if self.mode == "data_loss":
            await context.abort(grpc.StatusCode.DATA_LOSS, "the cache was rebuilt")


class Front(vllm_engine_pb2_grpc.VllmEngineServicer):
    def __init__(self, proxy: KvEventsProxy, owner: str) -> None:
        self.proxy = proxy
        self.owner = owner

    async def SubscribeKvEvents(self, request, context):
        await self.proxy.relay(request, context, self.owner)


async def serve(servicer, address: str) -> grpc.aio.Server:
    server = grpc.aio.server()
    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(servicer, server)
    server.add_insecure_port(address)
    await server.start()
    return server


@pytest.fixture
def folder():
    path = Path(tempfile.mkdtemp(prefix="kv", dir="/tmp"))  # NOTE: a unix socket's path is short
    path.chmod(0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def run(folder, mode, *, sockets=1, start=0, cancel_after=None):
    instances = []
    servers = []
    try:
        for i in range(sockets if folder is not None else 0):
            instances.append(Instance(mode))
            servers.append(await serve(instances[-1], f"unix://{folder}/lora_adapter_{i}.sock"))
        front = grpc.aio.server()
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(Front(KvEventsProxy(folder), "sql"), front)
        port = front.add_insecure_port("127.0.0.1:0")
        await front.start()
        servers.append(front)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = vllm_engine_pb2_grpc.VllmEngineStub(channel).SubscribeKvEvents(
                common_pb2.SubscribeKvEventsRequest(start_sequence_number=start, load_records_before_first_batch=True),
                timeout=60)
            got = []
            if cancel_after is not None:
                await call.initial_metadata()  # the relay sent its headers: the instance's call is open
                call.cancel()
                await asyncio.wait_for(instances[0].left.wait(), 60)
                return instances, got, grpc.StatusCode.CANCELLED, ""
            try:
                async for batch in call:
                    got.append(batch.sequence_number)
            except grpc.aio.AioRpcError as exc:
                return instances, got, exc.code(), exc.details()
            return instances, got, await call.code(), await call.details()
    finally:
        await asyncio.gather(*(s.stop(0) for s in servers))


def test_every_batch_is_relayed_with_the_listeners_scope(folder):
    instances, got, code, _ = asyncio.run(run(folder, "ok", start=7))
    assert code == grpc.StatusCode.OK and got == [7, 8]
    assert instances[0].metadata[OWNER_KEY] == "sql" and instances[0].metadata[TENANT_KEY] == "default"
    assert instances[0].requests[0].load_records_before_first_batch


@pytest.mark.parametrize("mode, expected", [("out_of_range", grpc.StatusCode.OUT_OF_RANGE),
                                            ("data_loss", grpc.StatusCode.DATA_LOSS)])
def test_the_instances_final_status_and_details_reach_the_subscriber(folder, mode, expected):
    _, got, code, details = asyncio.run(run(folder, mode))
    assert code == expected
    assert got == ([] if mode == "out_of_range" else [0, 1])
    assert details == ("sequence 5 is before the replay window" if mode == "out_of_range" else "the cache was rebuilt")


def test_a_subscriber_that_leaves_ends_the_instances_call(folder):
    instances, got, _, _ = asyncio.run(run(folder, "forever", cancel_after=0))
    assert instances[0].left.is_set() and got == []


def test_no_folder_several_sockets_or_none_yet(folder):
    assert asyncio.run(run(None, "ok"))[2] == grpc.StatusCode.UNIMPLEMENTED
    assert asyncio.run(run(folder, "ok", sockets=0))[2] == grpc.StatusCode.UNAVAILABLE
    _, _, code, details = asyncio.run(run(folder, "ok", sockets=2))
    assert code == grpc.StatusCode.UNIMPLEMENTED and "one lora_adapter instance" in details
