"""A live plan change moves the pins: kept blocks stay pinned under the new plan, dropped ones become evictable."""

from tests.unit.kv.test_prefix_cache import BS, block_bytes, kv_for
from warmup_tools.kv.blocks import BlockSource
from warmup_tools.kv.hashing import CacheScope, block_hashes
from warmup_tools.kv.prefix_cache import PrefixCache

SCOPE = CacheScope(base_fingerprint="base-1", adapter="support", adapter_fingerprint="a1", tenant="acme")


def warm(cache, tokens, plan_id):
    hashes = block_hashes(tokens, BS, SCOPE)
    cache.store(hashes, kv_for(tokens), source=BlockSource.WARMUP, plan_id=plan_id)
    return hashes


def test_move_plan_repins_kept_blocks_and_unpins_dropped_ones():
    cache = PrefixCache(budget_bytes=20 * block_bytes(), block_size=BS, live_reserve=0.0)
    kept = warm(cache, list(range(1, 9)), "plan-a")
    dropped = warm(cache, list(range(50, 58)), "plan-a")
    assert cache.resident(kept + dropped, "plan-a") == 4

    assert cache.move_plan("plan-b", set(kept)) == (2, 2)
    assert cache.active_plan == "plan-b"
    assert all(cache.block(h).plan_id == "plan-b" for h in kept)
    assert all(cache.block(h).plan_id is None for h in dropped)
    assert cache.stats.pinned_bytes == cache.stats.warmup_bytes == 2 * block_bytes()
    # Dropped blocks are ordinary blocks now: resident until something needs the room, then evictable.
    assert cache.resident(dropped) == 2 and cache.resident(dropped, "plan-b") == 0
    assert cache.block(dropped[-1]).evictable and not cache.block(kept[-1]).evictable
    # A store under the (already active) new plan does not unpin the kept blocks again.
    added = warm(cache, list(range(90, 98)), "plan-b")
    assert cache.resident(kept + added, "plan-b") == 4


def test_a_match_counts_the_blocks_the_active_plan_pins():
    cache = PrefixCache(budget_bytes=20 * block_bytes(), block_size=BS, live_reserve=0.0)
    planned = warm(cache, list(range(1, 9)), "plan-a")
    tokens = list(range(1, 9)) + list(range(300, 308))
    live = block_hashes(tokens, BS, SCOPE)
    cache.store(live, kv_for(tokens))  # the plan's two blocks, then two of live traffic's
    match = cache.match(live)
    assert (len(match), match.planned, match.planned_tokens) == (4, 2, 2 * BS)
    cache.release(match)
    cache.move_plan("plan-b", set())  # a plan that keeps none of them: resident still, pinned no more
    match = cache.match(planned)
    assert (len(match), match.planned) == (2, 0)
    cache.release(match)


def test_resident_counts_only_cached_blocks():
    cache = PrefixCache(budget_bytes=20 * block_bytes(), block_size=BS)
    hashes = warm(cache, list(range(1, 9)), None)
    missing = block_hashes(list(range(200, 208)), BS, SCOPE)
    assert cache.resident(hashes + missing) == 2
    assert cache.resident([]) == 0


def test_a_store_for_an_older_plan_after_a_plan_change_keeps_the_current_plan_s_pins(caplog):
    """A warm-up sample of plan A still in flight when plan B became current: its pin action is ignored."""
    cache = PrefixCache(budget_bytes=20 * block_bytes(), block_size=BS, live_reserve=0.0)
    kept = warm(cache, list(range(1, 9)), "plan-a")
    assert cache.active_plan == "plan-a"  # with no plan active, the first warm-up store activates its plan
    cache.move_plan("plan-b", set(kept))
    added = warm(cache, list(range(90, 98)), "plan-b")
    pinned, warmup = cache.stats.pinned_bytes, cache.stats.warmup_bytes
    assert pinned == 4 * block_bytes()

    with caplog.at_level("WARNING", logger="warmup_tools.kv.prefix_cache"):
        late = warm(cache, list(range(50, 58)), "plan-a")  # the sample's own prefix, not in plan B
        warm(cache, list(range(1, 9)), "plan-a")  # a prefix plan B kept
    assert cache.active_plan == "plan-b"
    assert cache.resident(kept + added, "plan-b") == 4 and cache.stats.pinned_bytes == pinned
    assert cache.resident(late) == 2 and cache.resident(late, "plan-a") == 0
    assert all(cache.block(h).plan_id is None and cache.block(h).source is BlockSource.LIVE for h in late)
    assert cache.block(late[-1]).evictable
    assert cache.stats.warmup_bytes == warmup  # the late blocks do not take the warm-up cap either
    assert cache.stats.stale_plan_blocks == 4
    assert len([r for r in caplog.records if "plan-a" in r.getMessage()]) == 1  # logged once, not per store
