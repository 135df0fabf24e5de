"""An instance's KV event server on a real unix socket, read by a real gRPC client as smg reads it."""

import shutil
import tempfile
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2

from tests.unit.smg_worker.test_kv_wire import BS, make_cache, put
from warmup_tools.smg_worker.event_server import (
    METHOD,
    OWNER_KEY,
    SERVICE,
    TENANT_KEY,
    KvEventServer,
    socket_path,
)


@pytest.fixture()
def served():
    folder = Path(tempfile.mkdtemp(prefix="wkv-"))  # NOTE: short: a unix socket path has at most 107 bytes
    cache, journal = make_cache()
    server = KvEventServer(journal, cache.event_state, BS, socket_path(folder, "lora_adapter_0_0"), poll_s=0.05)
    server.start()
    channel = grpc.insecure_channel(f"unix:{server.path}")
    call = channel.unary_stream(f"/{SERVICE}/{METHOD}",
                                request_serializer=common_pb2.SubscribeKvEventsRequest.SerializeToString,
                                response_deserializer=common_pb2.KvEventBatch.FromString)
    try:
        yield cache, journal, server, call
    finally:
        channel.close()
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def subscribe(call, start=0, owner="", tenant="default"):
    return call(common_pb2.SubscribeKvEventsRequest(start_sequence_number=start),
                metadata=((OWNER_KEY, owner), (TENANT_KEY, tenant)), timeout=60)


def test_a_subscriber_gets_headers_the_snapshot_then_live_events(served):
    cache, journal, _, call = served
    put(cache, list(range(2 * BS)))
    stream = subscribe(call)
    assert stream.initial_metadata() is not None  # headers came before any event
    snapshot = next(stream)
    assert snapshot.snapshot.blocks == 2 and snapshot.sequence_number == journal.last_seq
    put(cache, list(range(500, 500 + BS)))
    live = next(stream)
    assert live.sequence_number == journal.last_seq and list(live.events[0].stored.blocks[0].token_ids)[0] == 500
    stream.cancel()


def test_a_number_outside_the_window_is_out_of_range_before_headers(served):
    cache, journal, _, call = served
    put(cache, list(range(BS)))
    with pytest.raises(grpc.RpcError) as caught:
        next(subscribe(call, start=journal.last_seq + 5))
    assert caught.value.code() == grpc.StatusCode.OUT_OF_RANGE and "resubscribe from 0" in caught.value.details()


def test_a_malformed_scope_is_refused_and_the_server_keeps_serving(served):
    cache, journal, _, call = served
    with pytest.raises(grpc.RpcError) as caught:
        next(subscribe(call, owner="../../etc"))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    put(cache, list(range(BS)))
    assert next(subscribe(call)).snapshot.blocks == 1


def test_an_adapters_listener_sees_that_adapters_blocks(served):
    cache, journal, _, call = served
    put(cache, list(range(BS)), adapter="sql")
    put(cache, list(range(100, 100 + BS)))
    assert next(subscribe(call, owner="sql")).snapshot.blocks == 1
    assert next(subscribe(call)).snapshot.blocks == 1


def test_the_socket_path_is_bounded():
    with pytest.raises(ValueError, match="shorter folder"):
        socket_path(Path("/tmp/" + "x" * 120), "lora_adapter_0_0")
