"""KV events from a real tritonserver's lora_adapter instance, read from its unix socket as the replica's gRPC worker
listeners read them (smg's SubscribeKvEvents): the warm-up samples' blocks in the state a new subscriber gets, a live
request's blocks as they are stored, and a resume from a number inside the replay window."""

from __future__ import annotations

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from transformers import AutoTokenizer

from warmup_tools.server.client import GenerateParams, StreamingClient
from warmup_tools.smg_worker.event_server import METHOD, OWNER_KEY, SERVICE, TENANT_KEY
from warmup_tools.smg_worker.kv_wire import to_int64

pytestmark = pytest.mark.integration

BLOCK = 16


@pytest.fixture()
def subscribe(triton):
    sockets = sorted(triton.kv_events_dir.glob("*.sock"))
    assert [s.name for s in sockets] == ["lora_adapter_0_0.sock"], sockets
    channel = grpc.insecure_channel(f"unix:{sockets[0]}")
    call = channel.unary_stream(f"/{SERVICE}/{METHOD}",
                                request_serializer=common_pb2.SubscribeKvEventsRequest.SerializeToString,
                                response_deserializer=common_pb2.KvEventBatch.FromString)

    def open_stream(start=0, owner=""):
        return call(common_pb2.SubscribeKvEventsRequest(start_sequence_number=start),
                    metadata=((OWNER_KEY, owner), (TENANT_KEY, "default")), timeout=300)

    try:
        yield open_stream
    finally:
        channel.close()


def snapshot_of(stream):
    batches = [next(stream)]
    while batches[-1].snapshot.index + 1 < batches[-1].snapshot.count:
        batches.append(next(stream))
    return batches


def test_a_new_subscriber_sees_the_warm_up_samples_blocks(subscribe):
    for owner in ("support", "legal", "sql"):  # the demo stanzas warm each adapter's system prompt
        stream = subscribe(owner=owner)
        chunks = snapshot_of(stream)
        stream.cancel()
        stored = [b for c in chunks for e in c.events if e.WhichOneof("data") == "stored" for b in e.stored.blocks]
        assert chunks[0].events[0].WhichOneof("data") == "cleared"
        assert len(stored) >= 2 and chunks[0].snapshot.blocks == len(stored), owner
        assert all(len(b.token_ids) == BLOCK and b.block_size == BLOCK for b in stored)


def test_a_live_requests_blocks_arrive_as_stored_and_a_resume_replays_them(triton, subscribe):
    tokenizer = AutoTokenizer.from_pretrained(str(triton.assets_dir / "lm"))
    prompt = ("KV events test: a prompt no other test sends, long enough for several blocks of sixteen tokens, "
              "about the tides of the northern sea and the lighthouses along its coast.")
    ids = tokenizer.encode(prompt, add_special_tokens=True)
    stream = subscribe()
    state = snapshot_of(stream)
    mark = state[-1].sequence_number
    with StreamingClient(triton.grpc_url, timeout_s=120) as client:
        client.generate(prompt, GenerateParams(max_tokens=2))
    expected = [ids[i:i + BLOCK] for i in range(0, (len(ids) - 1) // BLOCK * BLOCK, BLOCK)]
    seen: list[list[int]] = []
    last = mark
    for batch in stream:
        assert batch.sequence_number == last + 1  # no gap
        last = batch.sequence_number
        for event in batch.events:
            if event.WhichOneof("data") == "stored":
                seen += [list(b.token_ids) for b in event.stored.blocks]
        if seen[-len(expected):] == expected:
            break
    stream.cancel()
    # A subscriber that reconnects with the number it applied gets the events from that number on.
    resumed = subscribe(start=mark + 1)
    first = next(resumed)
    resumed.cancel()
    assert first.sequence_number == mark + 1 and not first.HasField("snapshot")
    # Outside the window (a number from the future): OUT_OF_RANGE, so the router starts over from 0.
    with pytest.raises(grpc.RpcError) as caught:
        next(subscribe(start=last + 10**9))
    assert caught.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert to_int64(b"\x00" * 24 + (1).to_bytes(8, "big")) == 1
