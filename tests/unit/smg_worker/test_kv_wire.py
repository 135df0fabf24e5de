"""smg's SubscribeKvEvents from a real prefix cache's journal: numbering, the replay window, the state snapshot,
and which blocks a worker listener publishes (its model, its tenant, public prefixes)."""

import pytest

from tests.unit.kv.test_prefix_cache import BS, Clock, kv_for
from warmup_tools.kv.blocks import BlockSource
from warmup_tools.kv.events import KvEventJournal
from warmup_tools.kv.hashing import CacheScope, block_hashes
from warmup_tools.kv.prefix_cache import PrefixCache
from warmup_tools.smg_worker.kv_wire import KvEventStream, OutOfWindow, StreamScope, to_int64


def make_cache(blocks=64, window=10_000):
    journal = KvEventJournal(window, first_seq=100)
    return PrefixCache(blocks * BS, BS, bytes_per_token=1, clock=Clock(), warm_share=1.0, live_reserve=0.0,
                       pin_check_s=0.0, events=journal), journal


def put(cache, tokens, tenant="default", adapter=None, **kwargs):
    scope = CacheScope("base", adapter=adapter or "", tenant=tenant)
    hashes = block_hashes(tokens, BS, scope)
    cache.store(hashes, kv_for(tokens), tokens=tokens, tenant=tenant, owner=adapter or "", **kwargs)
    return hashes


def stream(cache, journal, start=0, scope=None):
    s = KvEventStream(journal, cache.event_state, scope or StreamScope(), BS, start)
    s.open()
    return s


def take(s, n):
    out = []
    for batch in s.batches(stopped=lambda: len(out) >= n, poll_s=0.0):
        out.append(batch)
        if len(out) >= n:
            break
    return out


def drain(s, journal):
    """Every batch up to the journal's last event."""
    out = []
    for batch in s.batches(stopped=lambda: bool(out) and out[-1].sequence_number >= journal.last_seq, poll_s=0.0):
        out.append(batch)
        if batch.sequence_number >= journal.last_seq:
            break
    return out


def test_a_subscriber_from_zero_gets_the_state_then_every_event_under_its_number():
    cache, journal = make_cache()
    first = put(cache, list(range(3 * BS)))
    s = stream(cache, journal)
    snapshot, = take(s, 1)
    assert snapshot.snapshot.count == 1 and snapshot.snapshot.blocks == 3
    assert snapshot.sequence_number == journal.last_seq
    kinds = [e.WhichOneof("data") for e in snapshot.events]
    assert kinds == ["cleared", "stored", "stored", "stored"] and all(e.event_id == 0 for e in snapshot.events)
    assert [e.stored.blocks[0].block_hash for e in snapshot.events[1:]] == [to_int64(h) for h in first]
    assert snapshot.events[2].stored.parent_block_hash == to_int64(first[0])
    put(cache, list(range(3 * BS)) + list(range(500, 500 + BS)))  # one more block on the chain
    live, = take(s, 1)
    assert live.sequence_number == journal.last_seq
    stored = live.events[0].stored
    assert [list(b.token_ids) for b in stored.blocks] == [list(range(500, 500 + BS))]
    assert stored.parent_block_hash == to_int64(first[2]) and not stored.HasField("lora_name")
    assert not stored.HasField("cache_salt") and stored.blocks[0].block_size == BS


def test_a_subscriber_resumes_inclusive_from_its_number_and_one_outside_the_window_resubscribes():
    cache, journal = make_cache(window=4)
    put(cache, list(range(BS)))
    mark = journal.last_seq
    put(cache, list(range(1000, 1000 + BS)))
    resumed = take(stream(cache, journal, start=mark), 2)
    assert [b.sequence_number for b in resumed] == [mark, mark + 1]
    for i in range(10):  # the window moves past mark
        put(cache, list(range(2000 + i * BS, 2000 + (i + 1) * BS)))
    with pytest.raises(OutOfWindow):
        stream(cache, journal, start=mark)
    with pytest.raises(OutOfWindow):  # a number from a former life of the cache (ahead of this journal)
        stream(cache, journal, start=journal.last_seq + 10)


def test_a_listener_publishes_its_models_blocks_of_its_tenant_and_public_prefixes_only():
    cache, journal = make_cache()
    start = journal.last_seq
    put(cache, list(range(BS)))  # base, tenant default: published
    put(cache, list(range(100, 100 + BS)), tenant="acme")  # another tenant: never hit through the listener
    put(cache, list(range(200, 200 + BS)), adapter="sql")  # another model: its own listener
    put(cache, list(range(300, 300 + 2 * BS)), tenant="acme", public_blocks=1)  # a public prefix, then acme's own
    batches = take(stream(cache, journal, start=start + 1), 4)
    assert [b.sequence_number for b in batches] == [start + 1, start + 2, start + 3, start + 4]  # no gap
    published = [[list(b.token_ids)[0] for e in batch.events for b in e.stored.blocks] for batch in batches]
    assert published == [[0], [], [], [300]]
    sql = take(stream(cache, journal, start=start + 1, scope=StreamScope(owner="sql")), 3)
    assert [len(b.events) for b in sql] == [0, 0, 1]


def test_removals_go_out_for_published_blocks_and_unpins_change_nothing():
    cache, journal = make_cache(blocks=3)
    s = stream(cache, journal)
    take(s, 1)  # the (empty) state
    mine = put(cache, list(range(BS)))
    put(cache, list(range(100, 100 + BS)), tenant="acme")
    put(cache, list(range(200, 200 + 2 * BS)))  # the cache is full: the oldest blocks go
    events = [e for b in drain(s, journal) for e in b.events]
    removed = [h for e in events if e.WhichOneof("data") == "removed" for h in e.removed.block_hashes]
    assert to_int64(mine[0]) in removed and len(removed) == 1  # acme's removal is not this stream's
    cache.store(block_hashes(list(range(900, 900 + BS)), BS, CacheScope("base")), kv_for(list(range(900, 900 + BS))),
                source=BlockSource.WARMUP, plan_id="p", tokens=list(range(900, 900 + BS)))
    cache.move_plan("q", keep=())
    last = drain(s, journal)
    assert last[-1].events == [] and journal.read(last[-1].sequence_number - 1).events[0].kind == "unpinned"


def test_the_snapshot_is_chunked_with_consecutive_numbers_ending_at_the_state():
    from warmup_tools.smg_worker import kv_wire

    cache, journal = make_cache()
    for i in range(5):
        put(cache, list(range(i * 1000, i * 1000 + BS)))
    original, kv_wire.SNAPSHOT_CHUNK_BLOCKS = kv_wire.SNAPSHOT_CHUNK_BLOCKS, 2
    try:
        chunks = list(stream(cache, journal).snapshot(*cache.event_state()))
    finally:
        kv_wire.SNAPSHOT_CHUNK_BLOCKS = original
    assert [c.snapshot.index for c in chunks] == [0, 1, 2] and {c.snapshot.count for c in chunks} == {3}
    assert [c.sequence_number for c in chunks] == [journal.last_seq - 2, journal.last_seq - 1, journal.last_seq]
    assert chunks[0].events[0].WhichOneof("data") == "cleared"
    assert sum(len(c.events) for c in chunks) == 6 and chunks[0].snapshot.blocks == 5
