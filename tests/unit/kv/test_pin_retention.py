"""Pins as a bounded, expiring priority: deadlines, the warm share's cap, the shadow list and the live check."""

import pytest

from tests.unit.kv.test_prefix_cache import BS, SCOPE, Clock, block_bytes, kv_for
from warmup_tools.kv.blocks import BlockSource
from warmup_tools.kv.hashing import block_hashes
from warmup_tools.kv.prefix_cache import MIN_PIN_EVIDENCE_BLOCKS, PrefixCache


def cache_of(blocks, clock, **kwargs):
    kwargs.setdefault("warm_share", 1.0)
    kwargs.setdefault("live_reserve", 0.0)
    kwargs.setdefault("pin_check_s", 0.0)
    return PrefixCache(budget_bytes=blocks * block_bytes(), block_size=BS, clock=clock, eviction="lru", **kwargs)


def prompt(first, blocks=1):
    """Tokens of ``blocks`` full blocks whose ids start at ``first`` (distinct prompts never share a block)."""
    return list(range(first, first + blocks * BS))


def store(cache, tokens, **kwargs):
    return cache.store(block_hashes(tokens, BS, SCOPE), kv_for(tokens), **kwargs)


def warm(cache, tokens, plan="plan-a", **kwargs):
    return store(cache, tokens, source=BlockSource.WARMUP, plan_id=plan, **kwargs)


def hits(cache, tokens):
    match = cache.match(block_hashes(tokens, BS, SCOPE))
    cache.release(match)
    return len(match)


def flood(cache, start, count):
    for i in range(count):
        store(cache, prompt(start + i * BS))


def test_a_pin_holds_until_its_deadline_then_is_an_ordinary_block():
    clock = Clock()
    cache = cache_of(4, clock, pin_retention_s=100.0)
    planned = prompt(1000, 2)
    assert warm(cache, planned) == 2
    flood(cache, 0, 20)  # live traffic churns the two blocks the pins leave
    assert hits(cache, planned) == 2 and cache.stats.pinned_bytes == 2 * block_bytes()
    clock.now = 100.0
    report = cache.pin_report()
    assert report["state"] == "expired" and report["expired_blocks"] == 2 and report["pinned_blocks"] == 0
    assert cache.stats.expired_pins == 2 and cache.stats.pinned_bytes == 0 and cache.stats.warmup_bytes == 0
    flood(cache, 200, 8)  # now the live policy may take them like any other block
    assert hits(cache, planned) == 0


def test_a_pin_that_never_paid_is_first_in_line_when_it_ends():
    clock = Clock()
    cache = cache_of(4, clock, pin_retention_s=10.0)
    unhit = prompt(1000)
    warm(cache, unhit)
    flood(cache, 0, 3)  # three live blocks, older than the pin's end
    clock.now = 10.0
    cache.pin_report()  # the pin ends
    flood(cache, 200, 1)  # one eviction: the expired, never-hit block goes, not the oldest live one
    assert hits(cache, unhit) == 0
    assert hits(cache, prompt(0)) == 1


def test_the_retention_a_store_names_wins_over_the_default():
    clock = Clock()
    cache = cache_of(8, clock, pin_retention_s=1000.0)
    short, long = prompt(1000), prompt(2000)
    warm(cache, short, retention_s=5.0)
    warm(cache, long)
    clock.now = 6.0
    assert cache.pin_report()["pinned_blocks"] == 1
    assert cache.block(block_hashes(short, BS, SCOPE)[0]).plan_id is None
    assert cache.block(block_hashes(long, BS, SCOPE)[0]).plan_id == "plan-a"
    with pytest.raises(ValueError, match="retention_s"):
        warm(cache, prompt(3000), retention_s=float("nan"))


@pytest.mark.parametrize("refresh", [False, True])
def test_a_hit_moves_the_deadline_only_with_refresh_on_hit(refresh):
    clock = Clock()
    cache = cache_of(8, clock, pin_retention_s=10.0, pin_refresh_on_hit=refresh)
    planned = prompt(1000)
    warm(cache, planned)
    clock.now = 8.0
    assert hits(cache, planned) == 1
    clock.now = 12.0
    assert cache.pin_report()["pinned_blocks"] == (1 if refresh else 0)
    clock.now = 18.0
    assert cache.pin_report()["pinned_blocks"] == 0


def test_an_ended_pin_is_covered_and_not_pinned_again_by_its_plan_but_by_the_next():
    clock = Clock()
    cache = cache_of(8, clock, pin_retention_s=10.0)
    planned = prompt(1000, 2)
    hashes = block_hashes(planned, BS, SCOPE)
    warm(cache, planned)
    clock.now = 10.0
    assert cache.resident(hashes, "plan-a") == 0
    assert cache.covered(hashes, "plan-a") == 2  # readiness does not drop when a pin ends by design
    warm(cache, planned)  # the same plan warming it again (a reload's samples) does not pin it again
    assert cache.stats.pinned_bytes == 0
    cache.move_plan("plan-b", set())
    assert cache.covered(hashes, "plan-b") == 0
    warm(cache, planned, plan="plan-b")
    assert cache.resident(hashes, "plan-b") == 2


def test_warm_share_caps_what_warm_up_may_hold():
    cache = cache_of(20, Clock(), warm_share=0.25)
    assert cache.warmup_budget == 5 * block_bytes()
    assert warm(cache, prompt(1000, 8)) == 5
    capped = cache_of(20, Clock(), warm_share=0.9, live_reserve=0.5)
    assert capped.warmup_budget == 10 * block_bytes()  # the smaller cap wins


def test_the_shadow_list_counts_the_hits_blocks_evicted_for_pins_would_have_had():
    clock = Clock()
    cache = cache_of(4, clock, pin_retention_s=1e6)
    warm(cache, prompt(1000, 2))  # pins hold 2 of 4 blocks: the shadow list holds 2 blocks
    for first in (0, 100, 200, 300):
        store(cache, prompt(first))  # A, B, C, D: A and B are evicted while pins hold room
    assert hits(cache, prompt(0)) == 0 and hits(cache, prompt(100)) == 0  # A and B: in the shadow list
    assert cache.stats.shadow_hits == 2
    assert hits(cache, prompt(300)) == 1  # D is cached: a real hit, not a shadow one
    assert hits(cache, prompt(5000)) == 0  # never seen: no shadow hit
    store(cache, prompt(400))  # E evicts C; the shadow list keeps the newest 2 blocks' worth: B, C
    assert hits(cache, prompt(0)) == 0 and hits(cache, prompt(200)) == 0
    assert cache.stats.shadow_hits == 3  # A left the shadow list; C counts
    two_blocks = prompt(600, 2)
    store(cache, two_blocks)  # evicts D and E (leaf first): the run from the miss counts block by block
    assert hits(cache, prompt(300)) == 0 and cache.stats.shadow_hits == 4
    assert hits(cache, prompt(1000, 2)) == 2 and cache.stats.pin_hits == 2
    report = cache.pin_report()
    assert report["shadow_hits"] == 4 and report["pin_hits"] == 2 and report["adapters"]["base"]["pin_hits"] == 2


def test_no_shadow_list_without_pins():
    cache = cache_of(2, Clock())
    flood(cache, 0, 4)
    assert hits(cache, prompt(0)) == 0 and cache.stats.shadow_hits == 0


def live_churn(cache, clock, rounds, *, planned=None):
    """Live traffic cycling over 3 one-block prompts (a cache of 4 with 2 pinned holds 2 of them) and, with
    ``planned``, one request for the planned prefix per round; the clock moves a second a round."""
    for _ in range(rounds):
        for first in (0, 100, 200):
            if not hits(cache, prompt(first)):
                store(cache, prompt(first))
        if planned is not None:
            hits(cache, planned)
        clock.now += 1.0


def test_the_live_check_releases_pins_that_cost_more_than_they_give():
    clock = Clock()
    cache = cache_of(4, clock, pin_retention_s=1e6, pin_check_s=10.0)
    planned = prompt(1000, 2)
    warm(cache, planned)
    live_churn(cache, clock, 9)
    assert cache.pin_report()["state"] == "pinned"  # the window is not over yet
    live_churn(cache, clock, 3)
    report = cache.pin_report()
    assert report["state"] == "released" and report["releases"] == 1 and report["released_blocks"] == 2
    assert "would have given" in report["reason"]
    assert cache.stats.pinned_bytes == 0 and cache.stats.pin_releases == 1
    before = cache.stats.hit_blocks
    live_churn(cache, clock, 5)
    assert cache.stats.hit_blocks - before >= 10  # with the pins gone, the live working set fits again
    warm(cache, planned)  # the plan pins nothing more once released
    assert cache.stats.pinned_bytes == 0


def test_the_live_check_keeps_pins_that_pay():
    clock = Clock()
    cache = cache_of(4, clock, pin_retention_s=1e6, pin_check_s=10.0)
    planned = prompt(1000, 2)
    warm(cache, planned)
    for _ in range(30):
        for _ in range(3):
            hits(cache, planned)  # 6 pinned block hits a round
        if not hits(cache, prompt(0)):
            store(cache, prompt(0))
        if not hits(cache, prompt(100)):
            store(cache, prompt(100))
        if not hits(cache, prompt(200)):
            store(cache, prompt(200))
        clock.now += 1.0
    report = cache.pin_report()
    assert report["state"] == "pinned" and report["releases"] == 0
    assert report["pin_hits"] > report["shadow_hits"] > 0


def test_the_live_check_waits_for_evidence():
    clock = Clock()
    cache = cache_of(4, clock, pin_retention_s=1e6, pin_check_s=1.0)
    warm(cache, prompt(1000, 2))
    for first in (0, 100, 200):
        store(cache, prompt(first))
    assert hits(cache, prompt(0)) == 0  # one shadow hit
    clock.now = 1000.0
    for _ in range(MIN_PIN_EVIDENCE_BLOCKS - 2):
        assert hits(cache, prompt(5000)) == 0  # lookups without evidence either way
    assert cache.pin_report()["state"] == "pinned"


def test_restore_pins_a_block_of_the_active_plan_for_its_retention():
    clock = Clock()
    source = cache_of(8, clock)
    planned = prompt(1000)
    hashes = block_hashes(planned, BS, SCOPE)
    warm(source, planned, retention_s=7.0)
    block = source.block(hashes[0])
    target = cache_of(8, clock, pin_retention_s=1000.0)
    target.activate_plan("plan-a")
    clock.now = 50.0
    assert target.restore(block)
    assert target.block(hashes[0]).pin_until == 57.0
    clock.now = 57.0
    assert target.pin_report()["pinned_blocks"] == 0


def test_live_traffic_that_cannot_fit_otherwise_ends_pins_earliest_deadline_first():
    clock = Clock()
    cache = cache_of(4, clock, pin_retention_s=1e6)
    soon, later = prompt(1000, 2), prompt(2000, 2)
    warm(cache, soon, retention_s=100.0)
    warm(cache, later, retention_s=200.0)
    assert cache.stats.pinned_bytes == 4 * block_bytes()
    assert store(cache, prompt(0)) == 1  # the cache holds only pins: one ends (the leaf of the earliest deadline)
    assert cache.reserve(block_bytes())  # a running sequence's KV may end another
    assert hits(cache, later) == 2 and cache.resident(block_hashes(later, BS, SCOPE), "plan-a") == 2
    report = cache.pin_report()
    assert report["released_blocks"] == 2 and report["releases"] == 0  # not the live check's doing
    assert cache.reserve(block_bytes())  # the live block goes: now the cache is pins and running KV only
    assert warm(cache, prompt(3000)) == 0  # warm-up never ends a pin to make room
    assert cache.resident(block_hashes(later, BS, SCOPE), "plan-a") == 2


def test_a_warm_prompts_running_kv_never_ends_a_pin():
    """A warm prompt's running KV may evict unpinned blocks but never ends a pin: one plan item cannot push out
    another's pins (which would count them covered while they are gone), so a plan too big for the budget fails
    its item instead."""
    clock = Clock()
    cache = cache_of(4, clock, pin_retention_s=1e6)
    planned = prompt(1000, 2)
    warm(cache, planned)
    store(cache, prompt(0))
    assert cache.reserve(2 * block_bytes(), end_pins=False)  # the free block, then the live block
    assert cache.stats.evictions == 1
    assert not cache.reserve(block_bytes(), end_pins=False)  # only pins are left: nothing reserved
    assert cache.stats.running_bytes == 2 * block_bytes() and cache.stats.pinned_bytes == 2 * block_bytes()
    assert cache.pin_report()["released_blocks"] == 0
    assert cache.reserve(block_bytes())  # a live request's KV still may
    assert cache.pin_report()["released_blocks"] >= 1
