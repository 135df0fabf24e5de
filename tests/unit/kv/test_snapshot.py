"""KV snapshot files: round trip, every kind of mismatch and damage, and the budgets of write and restore."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from warmup_tools.kv.blocks import BlockSource
from warmup_tools.kv.hashing import NONE_HASH, CacheScope, block_hashes
from warmup_tools.kv.prefix_cache import PrefixCache
from warmup_tools.kv.snapshot import (
    MANIFEST_SUFFIX,
    SnapshotIdentity,
    SnapshotRejected,
    kv_close,
    list_snapshots,
    read_snapshot,
    rederive_hashes,
    salt_fingerprint,
    verification_sample,
    write_snapshot,
)

BS = 4
LAYERS, HEADS, DIM = 2, 1, 3
SCOPE = CacheScope(base_fingerprint="base-1", adapter="support", adapter_fingerprint="a1", tenant="acme")
IDENTITY = SnapshotIdentity("base-1", "tok-1", "float32", "fp", BS, (LAYERS, HEADS, DIM), salt_fingerprint("s"))
ADAPTERS = {"support": "a1"}
BIG = 1 << 30


def kv_for(tokens):
    t = torch.tensor(tokens, dtype=torch.float32)
    layers = []
    for layer in range(LAYERS):
        k = (t * 10 + layer).view(1, 1, -1, 1).expand(1, HEADS, -1, DIM).clone()
        layers.append((k, -k))
    return layers


def block_bytes(storage="fp"):
    values = LAYERS * 2 * HEADS * BS * DIM
    return (values * 4 if storage == "fp" else values + LAYERS * 2 * HEADS * DIM * 2) + BS * 4  # + token ids


def filled_cache(storage="fp", budget=BIG):
    cache = PrefixCache(budget, BS, storage=storage, live_reserve=0.0)
    for tokens in (list(range(1, 14)), list(range(1, 9)) + [50, 51, 52, 53], [7, 7, 7, 7, 8, 8, 8, 8]):
        cache.store(block_hashes(tokens, BS, SCOPE), kv_for(tokens), tenant="acme", owner="support", tokens=tokens)
    return cache


def scope_for(owner, tenant):
    return dataclasses.replace(SCOPE, tenant=tenant) if owner == "support" else None


def write(tmp_path, cache=None, identity=IDENTITY, name="lora_adapter_0_0@host"):
    cache = cache or filled_cache(identity.storage)
    return write_snapshot(tmp_path, name, identity, ADAPTERS, cache.snapshot_blocks(BIG), created=1.0)


def rejected(info, identity=IDENTITY, max_bytes=BIG):
    with pytest.raises(SnapshotRejected) as exc:
        read_snapshot(info.manifest, identity, max_payload_bytes=max_bytes)
    return exc.value.reason


@pytest.mark.parametrize("storage", ["fp", "int8"])
def test_round_trip_restores_every_block_with_its_kv_tokens_and_parents_first(tmp_path, storage):
    source = filled_cache(storage)
    identity = dataclasses.replace(IDENTITY, storage=storage)
    info = write(tmp_path, source, identity)
    assert info.blocks == len(source) == 6
    snapshot = read_snapshot(info.manifest, identity, max_payload_bytes=BIG)
    kept, no_scope, mismatched = rederive_hashes(snapshot.blocks, scope_for)
    assert (len(kept), no_scope, mismatched) == (6, 0, 0)
    target = PrefixCache(BIG, BS, storage=storage)
    assert all(target.restore(b) for b in kept)  # parents always come first
    tokens = list(range(1, 14))
    hashes = block_hashes(tokens, BS, SCOPE)
    match = target.match(hashes, "acme")
    assert len(match) == 3
    restored, original = target.load(match, torch.float32), source.load(source.match(hashes), torch.float32)
    for (k1, v1), (k2, v2) in zip(restored, original):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert target.block(hashes[2]).tokens.tolist() == tokens[8:12]
    assert target.stats.bytes_used == source.stats.bytes_used == 6 * block_bytes(storage)


@pytest.mark.parametrize("field,value,reason", [
    ("base_fingerprint", "base-2", "base_model"), ("kv_shape", (LAYERS, HEADS, DIM + 1), "base_model"),
    ("tokenizer_fingerprint", "tok-2", "tokenizer"), ("dtype", "bfloat16", "dtype"),
    ("storage", "int8", "storage"), ("block_size", 8, "block_size"),
    ("salt_fingerprint", salt_fingerprint("another deployment"), "salt"),
])
def test_a_snapshot_of_another_model_tokenizer_dtype_storage_block_size_or_salt_is_refused(tmp_path, field, value,
                                                                                        reason):
    info = write(tmp_path)
    assert rejected(info, dataclasses.replace(IDENTITY, **{field: value})) == reason


def test_the_manifest_never_holds_the_salt(tmp_path):
    info = write(tmp_path)
    assert "s" != IDENTITY.salt_fingerprint and '"s"' not in info.manifest.read_text()


def test_truncated_payload_flipped_byte_and_missing_payload_are_refused(tmp_path):
    info = write(tmp_path)
    data = info.payload.read_bytes()
    info.payload.write_bytes(data[:-7])
    assert rejected(info) == "truncated"
    flipped = bytearray(data)
    flipped[-5] ^= 0x01
    info.payload.write_bytes(bytes(flipped))
    assert rejected(info) == "checksum"
    info.payload.unlink()
    assert rejected(info) == "unreadable"


def test_bad_json_flipped_manifest_byte_and_foreign_versions_are_refused(tmp_path):
    info = write(tmp_path)
    text = info.manifest.read_text()
    info.manifest.write_text(text[: len(text) // 2])
    assert rejected(info) == "format"
    info.manifest.write_text(text.replace('"tenant":"acme"', '"tenant":"acmf"', 1))
    assert rejected(info) == "checksum"
    data = json.loads(text)
    data["version"] = 99
    info.manifest.write_text(json.dumps(data))
    assert rejected(info) == "version"
    info.manifest.write_text("[1, 2, 3]")
    assert rejected(info) == "format"


def test_payload_over_the_read_bound_is_not_read(tmp_path):
    info = write(tmp_path)
    assert rejected(info, max_bytes=info.payload_bytes - 1) == "too_large"


def test_consistently_rewritten_tokens_fail_the_hash_rederivation(tmp_path):
    cache = filled_cache()
    blocks = cache.snapshot_blocks(BIG)
    blocks[1] = dataclasses.replace(blocks[1], tokens=blocks[1].tokens + 1)  # checksums rewritten to match
    info = write_snapshot(tmp_path, "x", IDENTITY, ADAPTERS, blocks, created=1.0)
    snapshot = read_snapshot(info.manifest, IDENTITY, max_payload_bytes=BIG)
    kept, no_scope, mismatched = rederive_hashes(snapshot.blocks, scope_for)
    assert mismatched == 1 and no_scope == 0
    assert blocks[1].block_hash not in {b.block_hash for b in kept}


def test_blocks_of_an_adapter_not_served_are_dropped_with_their_descendants(tmp_path):
    snapshot = read_snapshot(write(tmp_path).manifest, IDENTITY, max_payload_bytes=BIG)
    kept, no_scope, mismatched = rederive_hashes(snapshot.blocks, lambda owner, tenant: None)
    assert (kept, mismatched) == ([], 0) and no_scope == 2  # the two roots; their children go with them


def test_snapshot_blocks_takes_pinned_first_then_hottest_with_ancestors_within_the_budget():
    cache = PrefixCache(BIG, BS, live_reserve=0.0)
    hot, cold, planned = list(range(1, 9)), [9] * 8, [5] * 8
    for tokens in (hot, cold):
        cache.store(block_hashes(tokens, BS, SCOPE), kv_for(tokens), tokens=tokens)
    cache.store(block_hashes(planned, BS, SCOPE), kv_for(planned), tokens=planned, source=BlockSource.WARMUP,
                plan_id="p1")
    for _ in range(3):
        cache.release(cache.match(block_hashes(hot, BS, SCOPE)))
    chosen = cache.snapshot_blocks(4 * block_bytes())
    names = [b.block_hash for b in chosen]
    assert set(names) == set(block_hashes(planned, BS, SCOPE)) | set(block_hashes(hot, BS, SCOPE))
    for index, block in enumerate(chosen):  # parents before children
        assert block.parent == NONE_HASH or block.parent in names[:index]
    only_pinned = cache.snapshot_blocks(2 * block_bytes())
    assert [b.block_hash for b in only_pinned] == block_hashes(planned, BS, SCOPE)
    assert len(cache.snapshot_blocks(block_bytes() - 1)) == 0


def test_restore_never_evicts_keeps_the_warmup_cap_and_pins_only_the_active_plan(tmp_path):
    blocks = read_snapshot(write(tmp_path).manifest, IDENTITY, max_payload_bytes=BIG).blocks
    small = PrefixCache(2 * block_bytes(), BS, live_reserve=0.0)
    placed = [small.restore(b) for b in blocks]
    assert placed.count(True) == 2 and small.stats.evictions == 0 and small.stats.bytes_used <= 2 * block_bytes()

    capped = PrefixCache(BIG, BS, live_reserve=0.5)
    capped.budget_bytes = 4 * block_bytes()
    warm = [dataclasses.replace(b, source=BlockSource.WARMUP, plan_id="p1") for b in blocks]
    capped.activate_plan("p1")
    assert [capped.restore(b) for b in warm].count(True) == 2  # the warm-up cap is half of 4 blocks
    assert capped.stats.pinned_bytes == 2 * block_bytes()

    other = PrefixCache(BIG, BS)
    other.activate_plan("p2")
    assert all(other.restore(b) for b in warm)
    assert other.stats.pinned_bytes == 0  # another plan's pins are not taken over


def test_verification_sample_is_deterministic_and_never_empty():
    blocks = list(range(40))
    assert verification_sample(blocks, 0.05, "seed") == verification_sample(blocks, 0.05, "seed")
    assert len(verification_sample(blocks, 0.05, "seed")) == 2
    assert len(verification_sample(blocks[:3], 0.01, "seed")) == 1


def test_kv_close_accepts_rounding_and_rejects_other_values():
    ref = torch.randn(2, 2, 1, 4, 3)
    assert kv_close(ref + 1e-6, ref, "fp")
    assert not kv_close(ref * 1.1, ref, "fp")
    scale = ref.abs().amax(dim=3, keepdim=True) / 127
    quantised = torch.round(ref / scale) * scale
    assert kv_close(quantised, ref, "int8") and not kv_close(quantised, ref, "fp")


def test_list_snapshots_finds_manifests_only(tmp_path):
    write(tmp_path, name="a")
    write(tmp_path, name="b")
    (tmp_path / "notes.json").write_text("{}")
    assert sorted(p.name for p in list_snapshots(tmp_path)) == [f"a{MANIFEST_SUFFIX}", f"b{MANIFEST_SUFFIX}"]


def test_snapshot_files_are_private_to_the_server_s_user(tmp_path):
    info = write(tmp_path)
    assert info.manifest.stat().st_mode & 0o777 == 0o600 and info.payload.stat().st_mode & 0o777 == 0o600


def test_rewrites_keep_one_previous_payload_and_leave_other_writers_alone(tmp_path):
    cache = filled_cache()
    blocks = cache.snapshot_blocks(BIG)
    write_snapshot(tmp_path, "a.b", IDENTITY, ADAPTERS, blocks, created=1.0)
    for count in (2, 4, 6):
        info = write_snapshot(tmp_path, "a", IDENTITY, ADAPTERS, blocks[:count], created=float(count))
    mine = sorted(p.name for p in tmp_path.glob("a.*.safetensors") if not p.name.startswith("a.b."))
    assert len(mine) == 2 and info.payload.name in mine
    assert len(list(tmp_path.glob("a.b.*.safetensors"))) == 1
    assert read_snapshot(info.manifest, IDENTITY, max_payload_bytes=BIG).blocks[-1].block_hash == blocks[5].block_hash
