"""KV events: the journal's numbering and replay window, and every change the prefix cache makes, recorded."""

import threading

from tests.unit.kv.test_pin_retention import cache_of, prompt, store, warm
from tests.unit.kv.test_prefix_cache import BS, SCOPE, Clock, block_bytes, kv_for
from warmup_tools.kv.blocks import BlockSource
from warmup_tools.kv.events import KvEventJournal
from warmup_tools.kv.hashing import NONE_HASH, block_hashes


def kinds(events):
    return [(e.kind, e.reason) for e in events]


def test_events_are_numbered_from_one_and_read_after_a_number():
    journal = KvEventJournal(100, first_seq=1)
    assert journal.read(0).events == () and not journal.read(0).resync
    for kind in ("stored", "removed", "cleared"):
        journal.append(kind)
    read = journal.read(0)
    assert [e.seq for e in read.events] == [1, 2, 3] and read.last_seq == 3 and not read.resync
    assert [e.seq for e in journal.read(2).events] == [3]
    assert [e.seq for e in journal.read(0, max_events=2).events] == [1, 2]
    assert journal.read(3).events == ()


def test_a_number_outside_the_window_asks_for_a_resync_and_the_window_stays_bounded():
    journal = KvEventJournal(window_blocks=10, first_seq=1)
    for _ in range(1000):  # a flood: the window moves, it never grows
        journal.append("removed", "evicted", hashes=(b"x",))
    assert len(journal._events) == 10 and journal.dropped == 990 and journal.first_seq == 991
    assert journal.read(990).events[0].seq == 991 and not journal.read(990).resync
    assert journal.read(5).resync  # fell out of the window
    assert journal.read(2000).resync  # ahead of the last: another journal's number (a restarted cache)


def test_a_reader_waits_for_the_next_event():
    journal = KvEventJournal()
    assert journal.read(0).resync  # a number from before this journal: take the full state
    got, start = [], journal.last_seq
    reader = threading.Thread(target=lambda: got.append(journal.read(start, timeout_s=60)))
    reader.start()
    journal.append("cleared")
    reader.join(60)
    assert got and got[0].events[0].kind == "cleared"


def test_the_cache_records_stores_evictions_unpins_and_clears():
    clock = Clock()
    journal = KvEventJournal(first_seq=1)
    cache = cache_of(5, clock, pin_retention_s=100.0, events=journal)
    planned = prompt(1000, 2)
    cache.store(block_hashes(planned, BS, SCOPE), kv_for(planned), source=BlockSource.WARMUP, plan_id="plan-a",
                tokens=planned)
    store(cache, prompt(0, 2), tenant="acme", owner="sql")
    first = journal.read(0).events
    assert kinds(first) == [("stored", "warmup"), ("stored", "live")]
    hashes = block_hashes(planned, BS, SCOPE)
    assert [b.block_hash for b in first[0].blocks] == hashes and first[0].parent == NONE_HASH
    assert first[0].blocks[1].tokens == tuple(planned[BS:])
    assert first[1].blocks[0].owner == "sql" and first[1].blocks[0].tenant == "acme"
    store(cache, prompt(500, 2))  # full: a live block is evicted
    assert ("removed", "evicted") in kinds(journal.read(2).events)
    clock.now = 100.0  # the pins expire
    cache.pin_report()
    assert ("unpinned", "expired") in kinds(journal.read(2).events)
    cache.move_plan("plan-b", keep=())
    cache.clear()
    assert kinds(journal.read(journal.last_seq - 1).events) == [("cleared", "")]


def test_a_plan_change_and_a_restore_are_recorded():
    clock = Clock()
    source = cache_of(8, clock)
    tokens = prompt(1000, 2)
    warm(source, tokens, plan="plan-a")
    journal = KvEventJournal(first_seq=1)
    target = cache_of(8, clock, events=journal)
    hashes = block_hashes(tokens, BS, SCOPE)
    for block_hash in hashes:
        assert target.restore(source.block(block_hash))
    assert kinds(journal.read(0).events) == [("stored", "restore")] * 2
    warm(target, prompt(2000), plan="plan-x")
    target.move_plan("plan-y", keep=())
    assert kinds(journal.read(3).events) == [("unpinned", "plan_change")]


def test_the_full_state_lists_every_block_parents_first_at_the_last_number():
    clock = Clock()
    journal = KvEventJournal(first_seq=1)
    cache = cache_of(8, clock, events=journal)
    store(cache, prompt(0, 3))
    store(cache, prompt(0, 2) + prompt(900))  # a branch off the second block
    seq, blocks = cache.event_state()
    assert seq == journal.last_seq == 2
    assert len(blocks) == 4
    seen = {NONE_HASH}
    for block, parent, source in blocks:
        assert parent in seen and source == "live"
        seen.add(block.block_hash)
    assert cache.stats.bytes_used == 4 * block_bytes()


def test_a_new_journal_numbers_past_the_one_before_it():
    """Numbered from the wall clock in milliseconds: a subscriber's number from a cache that restarted is behind
    the new journal's window, so it resyncs instead of reading another life's events as its own."""
    old = KvEventJournal(first_seq=None, clock=lambda: 1000.0)
    for _ in range(5):
        old.append("cleared")
    new = KvEventJournal(first_seq=None, clock=lambda: 1001.0)
    new.append("cleared")
    assert new.last_seq > old.last_seq and new.read(old.last_seq).resync
