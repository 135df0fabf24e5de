"""KV snapshot files: round trip, every kind of mismatch and damage, and the budgets of write and restore."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random

import pytest
import safetensors.torch
import torch

from warmup_tools.kv.blocks import BlockSource
from warmup_tools.kv.hashing import NONE_HASH, CacheScope, block_hashes
from warmup_tools.kv.prefix_cache import PrefixCache
from warmup_tools.kv.snapshot import write_snapshot
from warmup_tools.kv.snapshot_verify import (
    MANIFEST_SUFFIX,
    SnapshotIdentity,
    SnapshotRejected,
    block_digest,
    kv_close,
    list_snapshots,
    read_snapshot,
    rederive_hashes,
    salt_fingerprint,
    verification_sample,
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


def test_verification_sample_comes_from_the_reader_s_generator_and_is_never_empty():
    blocks = list(range(40))
    assert verification_sample(blocks, 0.05, random.Random(7)) == verification_sample(blocks, 0.05, random.Random(7))
    assert verification_sample(blocks, 0.25, random.Random(1)) != verification_sample(blocks, 0.25, random.Random(2))
    assert len(verification_sample(blocks, 0.05)) == 2  # default: the system's randomness
    assert len(verification_sample(blocks[:3], 0.01, random.Random(7))) == 1


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


# ------------------------------------------------------- a writer of the folder who forges a snapshot
def forge(info, edit_manifest=None, edit_tensors=None):
    """Rewrite a snapshot the way a writer of the folder without any key can: edit the payload's tensors
    and the manifest, then make every unkeyed checksum match again."""
    body = json.loads(info.manifest.read_text())
    body.pop("checksum")
    if edit_tensors is not None:
        tensors = safetensors.torch.load(info.payload.read_bytes())
        edit_tensors(tensors, body)
        data = safetensors.torch.save(tensors, metadata={"format": body["format"], "version": str(body["version"])})
        info.payload.write_bytes(data)
        body["payload"].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    if edit_manifest is not None:
        edit_manifest(body)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")
    info.manifest.write_text(json.dumps({**body, "checksum": hashlib.sha256(canonical).hexdigest()}))


def rewrite_digests(tensors, body):
    """What a forger who knows the format does: recompute every block's digest for its new payload."""
    for index, record in enumerate(body["blocks"]):
        record["sha256"] = block_digest(bytes.fromhex(record["hash"]), [tensors[f"b{index}.0"]])


@pytest.mark.parametrize("poison", ["all_nan", "one_inf", "one_negative_inf"])
def test_a_block_holding_nan_or_infinite_kv_is_refused_with_its_digests_consistent(tmp_path, poison):
    def edit(tensors, body):
        if poison == "all_nan":
            tensors["b3.0"] = torch.full_like(tensors["b3.0"], float("nan"))
        else:  # one value of the block, the rest untouched
            tensors["b3.0"].view(-1)[5] = float("inf") if poison == "one_inf" else float("-inf")
        rewrite_digests(tensors, body)

    info = write(tmp_path)
    forge(info, edit_tensors=edit)
    assert rejected(info) == "not_finite"


def test_int8_scales_that_are_not_finite_are_refused(tmp_path):
    identity = dataclasses.replace(IDENTITY, storage="int8")
    info = write(tmp_path, filled_cache("int8"), identity)

    def poison(tensors, body):
        tensors["b1.1"][0, 0, 0, 0, 0] = float("nan")
        for index, record in enumerate(body["blocks"]):
            record["sha256"] = block_digest(bytes.fromhex(record["hash"]), [tensors[f"b{index}.0"],
                                                                             tensors[f"b{index}.1"]])

    forge(info, edit_tensors=poison)
    assert rejected(info, identity) == "not_finite"


@pytest.mark.parametrize("where", ["top", "block", "identity", "payload"])
def test_a_manifest_key_the_format_does_not_name_is_refused_not_ignored(tmp_path, where):
    def add_key(body):
        target = {"top": body, "block": body["blocks"][2], "identity": body["identity"],
                  "payload": body["payload"]}[where]
        target["sample_nonce"] = 12345  # an unchecked field a writer could vary at will

    info = write(tmp_path)
    forge(info, edit_manifest=add_key)
    with pytest.raises(SnapshotRejected) as exc:
        read_snapshot(info.manifest, IDENTITY, max_payload_bytes=BIG)
    assert exc.value.reason == "unknown_key" and "sample_nonce" not in str(exc.value)


def test_a_payload_swapped_between_two_blocks_with_its_digest_is_refused(tmp_path):
    """Each block's digest is bound to its hash: moving a payload and its digest to another block fails."""
    def swap(tensors, body):
        tensors["b0.0"], tensors["b1.0"] = tensors["b1.0"], tensors["b0.0"]
        first, second = body["blocks"][0], body["blocks"][1]
        first["sha256"], second["sha256"] = second["sha256"], first["sha256"]

    info = write(tmp_path)
    forge(info, edit_tensors=swap)
    assert rejected(info) == "checksum"


KEY = hashlib.sha256(b"a key derived from the deployment secret").digest()


def test_trust_mode_manifests_carry_a_mac_that_a_writer_without_the_key_cannot_make(tmp_path):
    cache = filled_cache()
    signed = write_snapshot(tmp_path, "signed", IDENTITY, ADAPTERS, cache.snapshot_blocks(BIG), created=1.0,
                            mac_key=KEY)
    assert len(read_snapshot(signed.manifest, IDENTITY, max_payload_bytes=BIG, mac_key=KEY).blocks) == 6
    assert rejected(signed, max_bytes=BIG) == "mac"  # an open-mode reader never takes a trust-mode manifest

    def swap(tensors, body):  # a forger who knows the format and recomputes every unkeyed digest
        tensors["b0.0"], tensors["b1.0"] = tensors["b1.0"], tensors["b0.0"]
        rewrite_digests(tensors, body)

    forge(signed, edit_tensors=swap)
    with pytest.raises(SnapshotRejected) as exc:
        read_snapshot(signed.manifest, IDENTITY, max_payload_bytes=BIG, mac_key=KEY)
    assert exc.value.reason == "mac"

    unsigned = write(tmp_path, cache, name="unsigned")
    other_key = write_snapshot(tmp_path, "other", IDENTITY, ADAPTERS, cache.snapshot_blocks(BIG), created=1.0,
                               mac_key=hashlib.sha256(b"another deployment").digest())
    for info in (unsigned, other_key):
        with pytest.raises(SnapshotRejected) as exc:
            read_snapshot(info.manifest, IDENTITY, max_payload_bytes=BIG, mac_key=KEY)
        assert exc.value.reason == "mac"
