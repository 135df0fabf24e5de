"""Block names must never change between versions: plans, snapshots and every instance rely on them."""

import dataclasses

import numpy as np
import pytest

from warmup_tools.kv.hashing import NONE_HASH, PUBLIC_TENANT, CacheScope, block_hashes

SCOPE = CacheScope("base-1", "support", "a1", "acme")


def test_block_names_are_a_fixed_known_answer():
    # NOTE: recorded before the package was re-laid out; a refactor that changes it renames every block.
    hashes = block_hashes(list(range(32)), 16, SCOPE)
    assert hashes[1].hex() == "c270ffb1cafc211f70969d696934459d13f6be5525080ca046e5b8c6b5c91e64"
    assert len(NONE_HASH) == 32


def test_a_partial_trailing_block_has_no_name():
    assert len(block_hashes(list(range(31)), 16, CacheScope("b"))) == 1


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint16, np.int8])
def test_the_same_token_ids_name_the_same_blocks_whatever_integer_type_carries_them(dtype):
    # Triton hands a model int32 tensors, the planner Python lists: both must name the same blocks.
    tokens = list(range(0, 96, 3))
    assert block_hashes(np.array(tokens, dtype=dtype), 16, SCOPE) == block_hashes(tokens, 16, SCOPE)


def test_a_public_prefix_is_named_in_the_public_tenant_and_what_follows_in_the_tenants_own():
    tokens = list(range(48))
    hashes = block_hashes(tokens, 16, SCOPE, public_blocks=2)
    public = block_hashes(tokens, 16, dataclasses.replace(SCOPE, tenant=PUBLIC_TENANT))
    other = block_hashes(tokens, 16, dataclasses.replace(SCOPE, tenant="globex"), public_blocks=2)
    assert hashes[:2] == public[:2] == other[:2]  # every tenant shares the public blocks
    assert hashes[2] not in (public[2], other[2], block_hashes(tokens, 16, SCOPE)[2])
    # NOTE: recorded when public prefixes were introduced; a change renames every public block.
    assert [h.hex() for h in hashes[1:]] == [
        "9aa768427af65c1362b681a4028a94b3b316ea8dd3d78a60b3516720e30e46b6",
        "14f8962f51376f19f15e51d31c5b928ace7fa632f935d7e92b7d78801ee6ed7e",
    ]


def test_no_public_prefix_names_every_block_in_the_tenants_scope():
    assert block_hashes(list(range(32)), 16, SCOPE, public_blocks=0) == block_hashes(list(range(32)), 16, SCOPE)


def test_the_scope_is_encoded_as_a_compact_versioned_json_list():
    assert SCOPE.extra_keys() == b'["v1","base-1","support","a1","acme"]'
    assert CacheScope("b").extra_keys() == b'["v1","b","","","default"]'
