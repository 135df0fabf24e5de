"""Block names must never change between versions: plans, snapshots and every instance rely on them."""

from warmup_tools.kv.hashing import NONE_HASH, CacheScope, block_hashes


def test_block_names_are_a_fixed_known_answer():
    # NOTE: recorded before the package was re-laid out; a refactor that changes it renames every block.
    scope = CacheScope("base-1", "support", "a1", "acme")
    hashes = block_hashes(list(range(32)), 16, scope)
    assert hashes[1].hex() == "c270ffb1cafc211f70969d696934459d13f6be5525080ca046e5b8c6b5c91e64"
    assert len(NONE_HASH) == 32


def test_a_partial_trailing_block_has_no_name():
    assert len(block_hashes(list(range(31)), 16, CacheScope("b"))) == 1
