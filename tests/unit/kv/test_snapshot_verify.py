"""The snapshot verification in detail: each refusal's reason and message, the bounds at their edges, and
known answers for the digests, the MAC and the fingerprints (what the mutation run needs pinned)."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import random
from pathlib import Path

import pytest
import torch

from tests.unit.kv.test_snapshot import (
    ADAPTERS,
    BIG,
    BS,
    DIM,
    HEADS,
    IDENTITY,
    LAYERS,
    SCOPE,
    filled_cache,
    forge,
    kv_for,
    rewrite_digests,
    scope_for,
    write,
)
from warmup_tools.common import regular_file
from warmup_tools.kv import snapshot_verify
from warmup_tools.kv.blocks import BlockSource
from warmup_tools.kv.hashing import NONE_HASH, block_hashes
from warmup_tools.kv.prefix_cache import PrefixCache
from warmup_tools.kv.snapshot import write_snapshot
from warmup_tools.kv.snapshot_verify import (
    MANIFEST_SUFFIX,
    SnapshotIdentity,
    SnapshotRejected,
    block_digest,
    kv_close,
    list_snapshots,
    manifest_checksum,
    manifest_mac,
    read_snapshot,
    rederive_hashes,
    salt_fingerprint,
    sign_manifest,
    verification_sample,
    verify_tolerance,
)


def refusal(manifest, identity=IDENTITY, max_bytes=BIG, mac_key=b""):
    """``(reason, detail)`` of the refusal to read ``manifest``."""
    with pytest.raises(SnapshotRejected) as exc:
        read_snapshot(manifest, identity, max_payload_bytes=max_bytes, mac_key=mac_key)
    assert str(exc.value) == f"{exc.value.reason}: {exc.value.detail}"
    return exc.value.reason, exc.value.detail


def manifest_of(info):
    return json.loads(info.manifest.read_text())


# ---------------------------------------------------------------------------------- known answers
def test_a_rejection_carries_its_reason_and_detail():
    rejected = SnapshotRejected("checksum", "the manifest's checksum does not match")
    assert (rejected.reason, rejected.detail) == ("checksum", "the manifest's checksum does not match")
    assert str(rejected) == "checksum: the manifest's checksum does not match"


def test_block_digest_is_a_known_answer_over_the_hash_and_each_part_s_dtype_shape_and_bytes():
    block_hash = bytes(range(32))
    values = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    by_hand = hashlib.sha256(b"warmup-kv-snapshot-block:" + block_hash + b"torch.float32(2, 3)"
                             + values.numpy().tobytes()).hexdigest()
    assert block_digest(block_hash, [values]) == by_hand == \
        "693b48c633c2a012d0ca3db4a3492810e4ce85e4344bd196fe7810f5554a9537"
    int8 = [values.to(torch.int8), torch.ones(1, 2, dtype=torch.float16)]
    assert block_digest(block_hash, int8) == "d16e153dc4e5a3abb6d3e406173a91beccba75264d0db7eaa2591a44c9408914"
    assert block_digest(block_hash, [torch.zeros(0)]) == \
        "dc5777af513ae8cd6a6344ffe29d7e1dae9bdfd372bd70df5b955ebef9532b44"
    # The same bytes under another shape or dtype, or another block's hash, are another digest.
    assert block_digest(block_hash, [values.reshape(3, 2)]) != by_hand
    assert block_digest(block_hash, [values.view(torch.int32)]) != by_hand
    assert block_digest(bytes(32), [values]) != by_hand


def test_the_manifest_mac_is_a_known_answer_over_the_file_s_bytes_and_the_checksum_over_the_canonical_json():
    key = b"k" * 32
    raw = b'{"a":[1,2],"checksum":"x"}'
    signed = sign_manifest(raw, key)
    placeheld = b'{"a":[1,2],"checksum":"x","mac":"' + b"0" * 64 + b'"}'
    assert manifest_mac(placeheld, key) == hmac.new(key, placeheld, hashlib.sha256).hexdigest() == \
        "1e117757f93473e0eea253d0192918bb0930e0a9d39f8d6430b490400f602e85"
    assert signed == raw[:-1] + b',"mac":"1e117757f93473e0eea253d0192918bb0930e0a9d39f8d6430b490400f602e85"}'
    assert sign_manifest(raw, b"o" * 32) != signed
    with pytest.raises(ValueError, match="^a manifest is one JSON object$"):
        sign_manifest(b"[1]", key)
    # The checksum is over every key but itself and the MAC (the MAC, over the file, covers the checksum).
    assert manifest_checksum({"b": 1, "a": [1, 2], "mac": "y"}) == hashlib.sha256(b'{"a":[1,2],"b":1}').hexdigest() \
        == "94a786c3662bc7beeb598efa7d8cb58d7bea25d6c275ea9785a0230ff1f8c2ba"


def test_salt_fingerprint_is_a_known_answer_and_empty_without_a_salt():
    assert salt_fingerprint("") == ""
    assert salt_fingerprint("s") == hashlib.sha256(b"warmup-kv-snapshot-salt:s").hexdigest()[:16] == "78be6427bc1a2157"
    assert salt_fingerprint("salt with \u00fc") == "93f1bb6e125e0ce3"


def test_identity_json_round_trips_and_a_missing_salt_fingerprint_reads_as_none():
    data = IDENTITY.to_json()
    assert data == {"base_fingerprint": "base-1", "tokenizer_fingerprint": "tok-1", "dtype": "float32",
                    "storage": "fp", "block_size": BS, "kv_shape": [LAYERS, HEADS, DIM],
                    "salt_fingerprint": salt_fingerprint("s")}
    assert SnapshotIdentity.from_json(data) == IDENTITY
    del data["salt_fingerprint"]
    assert SnapshotIdentity.from_json(data) == dataclasses.replace(IDENTITY, salt_fingerprint="")
    with pytest.raises(ValueError, match="^kv_shape must hold 3 numbers$"):
        SnapshotIdentity.from_json({**data, "kv_shape": [LAYERS, HEADS]})


def test_identity_mismatch_names_the_first_field_that_differs_and_never_shows_a_salt():
    assert IDENTITY.mismatch(IDENTITY) is None
    theirs = dataclasses.replace(IDENTITY, base_fingerprint="base-2", tokenizer_fingerprint="tok-2")
    assert IDENTITY.mismatch(theirs) == ("base_model", "base_fingerprint 'base-2', this instance 'base-1'")
    assert IDENTITY.mismatch(dataclasses.replace(IDENTITY, kv_shape=(1, 1, 1))) == \
        ("base_model", "kv_shape (1, 1, 1), this instance (2, 1, 3)")
    assert IDENTITY.mismatch(dataclasses.replace(IDENTITY, tokenizer_fingerprint="tok-2", dtype="float16")) == \
        ("tokenizer", "tokenizer_fingerprint 'tok-2', this instance 'tok-1'")
    assert IDENTITY.mismatch(dataclasses.replace(IDENTITY, dtype="float16", storage="int8")) == \
        ("dtype", "dtype 'float16', this instance 'float32'")
    assert IDENTITY.mismatch(dataclasses.replace(IDENTITY, storage="int8", block_size=8)) == \
        ("storage", "storage 'int8', this instance 'fp'")
    assert IDENTITY.mismatch(dataclasses.replace(IDENTITY, block_size=8, salt_fingerprint="")) == \
        ("block_size", "block_size 8, this instance 4")
    assert IDENTITY.mismatch(dataclasses.replace(IDENTITY, salt_fingerprint="")) == \
        ("salt", "salt_fingerprint differs")


def test_verify_tolerance_is_the_dtype_s_rounding_at_least_1e_3_plus_one_int8_step():
    assert verify_tolerance("fp", torch.float32) == 1e-3
    assert verify_tolerance("fp", torch.float16) == 16 * torch.finfo(torch.float16).eps
    assert verify_tolerance("fp", torch.bfloat16) == 0.125
    assert verify_tolerance("int8", torch.float32) == 1e-3 + 1.0 / 127.0
    assert verify_tolerance("int8", torch.bfloat16) == 0.125 + 1.0 / 127.0


def test_kv_close_at_its_bounds():
    ref = torch.full((2, 2, 1, 4, 3), 4.0)
    assert kv_close(ref.clone(), ref, "fp")
    assert not kv_close(ref[..., :2], ref, "fp")  # another shape
    edge = ref.clone()
    edge[0, 0, 0, 0, 0] += 4 * 2 ** -10  # under 1e-3 of the largest value (4.0)
    assert kv_close(edge, ref, "fp")
    edge[0, 0, 0, 0, 0] = 4.0 + 4 * 2 ** -9  # over it
    assert not kv_close(edge, ref, "fp")
    assert kv_close(edge, ref, "int8")  # within one int8 step
    zeros = torch.zeros(2, 3)
    assert kv_close(zeros, zeros, "fp") and not kv_close(torch.full((2, 3), 1e-6), zeros, "fp")
    assert kv_close(torch.full((2, 3), 4.4, dtype=torch.bfloat16), torch.full((2, 3), 4.0, dtype=torch.bfloat16), "fp")
    # bfloat16's tolerance (0.125) times the largest value (4.0) is 0.5, exactly: the bound is inclusive.
    four = torch.full((2, 3), 4.0, dtype=torch.bfloat16)
    assert kv_close(torch.full((2, 3), 4.5), four, "fp")
    assert not kv_close(torch.full((2, 3), 4.5 + 2 ** -20), four, "fp")


# ------------------------------------------------------------------------------------------ sample
def test_the_sample_s_size_follows_the_share_rounded_up_with_at_least_one_block():
    blocks = list(range(40))
    for share, size in ((0.05, 2), (0.06, 3), (0.001, 1), (0.0, 1), (1.0, 40), (3.0, 40)):
        drawn = verification_sample(blocks, share, random.Random(3))
        assert len(drawn) == size and len(set(drawn)) == size and set(drawn) <= set(blocks)
    assert verification_sample([], 0.5, random.Random(3)) == []
    assert verification_sample(blocks, 0.25, random.Random(3)) == random.Random(3).sample(blocks, 10)
    assert len(verification_sample(tuple(blocks), 0.5)) == 20  # default generator; any sequence


# ------------------------------------------------------------------------------------- re-derivation
def test_rederive_keeps_exactly_the_blocks_in_scope_and_counts_each_drop_once(tmp_path):
    cache = filled_cache()
    other = [3, 3, 3, 3, 4, 4, 4, 4]  # a chain of an adapter this reader does not serve
    cache.store(block_hashes(other, BS, dataclasses.replace(SCOPE, adapter="gone")), kv_for(other), tenant="acme",
                owner="gone", tokens=other)
    third = [2, 2, 2, 2, 6, 6, 6, 6]
    cache.store(block_hashes(third, BS, SCOPE), kv_for(third), tenant="acme", owner="support", tokens=third)
    blocks = cache.snapshot_blocks(BIG)
    gone = [b for b in blocks if b.owner == "gone"]
    ours = [b for b in blocks if b.owner != "gone"]
    roots = [b for b in ours if b.parent == NONE_HASH]
    forged = [dataclasses.replace(root, tokens=root.tokens + 1) for root in roots[:2]]  # hashes that do not re-derive
    dropped = {root.block_hash for root in roots[:2]}
    for block in ours:
        if block.parent in dropped:
            dropped.add(block.block_hash)
    rest = [b for b in ours if b.block_hash not in dropped]
    kept, no_scope, mismatched = rederive_hashes(gone + forged + rest, scope_for)
    assert (no_scope, mismatched) == (1, 2)  # one count per root; their children are dropped without a count
    assert [b.block_hash for b in kept] == [b.block_hash for b in rest] and rest


# ------------------------------------------------------------------------------------ reading back
def test_a_snapshot_reads_back_with_its_name_identity_adapters_time_checksum_and_block_fields(tmp_path):
    cache = PrefixCache(BIG, BS, live_reserve=0.0)
    planned, live = list(range(1, 9)), [9] * 4
    cache.store(block_hashes(planned, BS, SCOPE), kv_for(planned), tokens=planned, source=BlockSource.WARMUP,
                plan_id="p1", tenant="acme", owner="support")
    cache.store(block_hashes(live, BS, SCOPE), kv_for(live), tokens=live, tenant="beta", owner="support")
    for _ in range(3):
        cache.release(cache.match(block_hashes(live, BS, SCOPE), "beta"))
    info = write_snapshot(tmp_path, "w", IDENTITY, ADAPTERS, cache.snapshot_blocks(BIG), created=12.5)
    snapshot = read_snapshot(info.manifest, IDENTITY, max_payload_bytes=BIG)
    assert (snapshot.name, snapshot.identity, snapshot.adapters, snapshot.created) == ("w", IDENTITY, ADAPTERS, 12.5)
    assert snapshot.checksum == manifest_of(info)["checksum"]
    fields = {b.tokens.tolist()[0]: (b.plan_id, b.source, b.tenant, b.owner, b.hits, b.tokens.tolist())
              for b in snapshot.blocks}
    assert fields == {1: ("p1", BlockSource.WARMUP, "acme", "support", 0, planned[:4]),
                      5: ("p1", BlockSource.WARMUP, "acme", "support", 0, planned[4:]),
                      9: (None, BlockSource.LIVE, "beta", "support", 3, live)}
    source_blocks = cache.snapshot_blocks(BIG)
    assert [(b.block_hash, b.parent, b.nbytes) for b in snapshot.blocks] == \
        [(b.block_hash, b.parent, b.nbytes) for b in source_blocks]
    assert sum(b.parent == NONE_HASH for b in snapshot.blocks) == 2
    assert all(b.tokens.dtype.name == "int32" and b.ref_count == 0 for b in snapshot.blocks)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_half_precision_snapshot_reads_back(tmp_path, dtype):
    identity = dataclasses.replace(IDENTITY, dtype=dtype)
    cache = PrefixCache(BIG, BS, live_reserve=0.0)
    tokens = list(range(1, 9))
    kv = [(k.to(getattr(torch, dtype)), v.to(getattr(torch, dtype))) for k, v in kv_for(tokens)]
    cache.store(block_hashes(tokens, BS, SCOPE), kv, tokens=tokens, owner="support", tenant="acme")
    info = write_snapshot(tmp_path, "h", identity, ADAPTERS, cache.snapshot_blocks(BIG), created=1.0)
    blocks = read_snapshot(info.manifest, identity, max_payload_bytes=BIG).blocks
    assert [b.payload.dtype for b in blocks] == [getattr(torch, dtype)] * 2
    assert refusal(info.manifest, dataclasses.replace(identity, dtype="float32"))[0] == "dtype"


def test_hits_read_back_never_negative_and_zero_when_absent(tmp_path):
    info = write(tmp_path)

    def edit(body):
        body["blocks"][0]["hits"] = -5
        del body["blocks"][1]["hits"]
        body["blocks"][2]["hits"] = 7

    forge(info, edit_manifest=edit)
    hits = [b.hits for b in read_snapshot(info.manifest, IDENTITY, max_payload_bytes=BIG).blocks]
    assert hits[:3] == [0, 0, 7]


def test_missing_adapters_read_as_none(tmp_path):
    info = write(tmp_path)
    forge(info, edit_manifest=lambda body: body.pop("adapters"))
    assert read_snapshot(info.manifest, IDENTITY, max_payload_bytes=BIG).adapters == {}


# --------------------------------------------------------------------------------- the manifest file
def test_the_manifest_size_bound_is_inclusive(tmp_path, monkeypatch):
    info = write(tmp_path)
    size = info.manifest.stat().st_size
    monkeypatch.setattr(snapshot_verify, "MAX_MANIFEST_BYTES", size)
    assert len(read_snapshot(info.manifest, IDENTITY, max_payload_bytes=BIG).blocks) == 6
    monkeypatch.setattr(snapshot_verify, "MAX_MANIFEST_BYTES", size - 1)
    assert refusal(info.manifest) == ("format", f"manifest of {size} bytes is over the {size - 1}-byte bound")


def test_a_manifest_that_is_missing_not_json_or_not_a_snapshot_is_refused_with_its_reason(tmp_path):
    missing = tmp_path / f"gone{MANIFEST_SUFFIX}"
    assert refusal(missing) == ("unreadable", "manifest: No such file or directory")
    cases = [(b"\xff\xfe{}", ("format", "manifest is not JSON (UnicodeDecodeError)")),
             (b"{", ("format", "manifest is not JSON (JSONDecodeError)")),
             (b"[" * 100_000 + b"]" * 100_000, ("format", "manifest is not JSON (RecursionError)")),
             (b"[1]", ("format", "not a KV snapshot manifest")),
             (b'{"version": 2}', ("format", "not a KV snapshot manifest")),
             (b'{"format": "other", "version": 2}', ("format", "not a KV snapshot manifest")),
             (b'{"format": "warmup-kv-snapshot"}', ("version", "format version None, this reader 2")),
             (b'{"format": "warmup-kv-snapshot", "version": 1}', ("version", "format version 1, this reader 2"))]
    for data, expected in cases:
        missing.write_bytes(data)
        assert refusal(missing) == expected


@pytest.mark.parametrize("where,detail", [
    ("top", "2 unknown key(s) at the top level"), ("identity", "2 unknown key(s) in identity"),
    ("payload", "2 unknown key(s) in payload"), ("block", "2 unknown key(s) in block 2"),
])
def test_unknown_keys_are_counted_where_they_are_found(tmp_path, where, detail):
    def add_keys(body):
        target = {"top": body, "block": body["blocks"][2], "identity": body["identity"], "payload": body["payload"]}
        target[where].update(nonce=1, other=2)

    info = write(tmp_path)
    forge(info, edit_manifest=add_keys)
    assert refusal(info.manifest) == ("unknown_key", f"{detail}; this reader knows format version 2 only")


@pytest.mark.parametrize("field,value,reason", [
    ("identity", 5, "format"), ("identity", ["a"], "format"), ("payload", 5, "format"), ("blocks", 5, "format"),
    ("blocks", [5] * 6, "format"), ("blocks", "abcdef", "format"), ("blocks", [5], "payload"),
])
def test_a_section_of_the_wrong_type_is_refused(tmp_path, field, value, reason):
    info = write(tmp_path)
    forge(info, edit_manifest=lambda body: body.update({field: value}))
    assert refusal(info.manifest)[0] == reason


def test_the_identity_and_the_fields_read_must_be_present(tmp_path):
    info = write(tmp_path)
    text = info.manifest.read_text()
    forge(info, edit_manifest=lambda body: body["identity"].pop("dtype"))
    reason, detail = refusal(info.manifest)
    assert reason == "format" and detail.startswith("identity is not readable (")
    for field in ("payload", "blocks", "name", "created"):
        info.manifest.write_text(text)
        forge(info, edit_manifest=lambda body, field=field: body.pop(field))
        reason, detail = refusal(info.manifest)
        assert reason == "format" and detail.startswith("manifest field missing or malformed ("), field


def test_a_missing_checksum_is_refused(tmp_path):
    info = write(tmp_path)
    body = manifest_of(info)
    del body["checksum"]
    info.manifest.write_text(json.dumps(body))
    assert refusal(info.manifest) == ("checksum", "the manifest's checksum does not match its content")


KEY = b"k" * 32
NO_MAC = ("mac", "the manifest has no valid MAC under this deployment's key (written without the deployment "
                 "secret, or changed since)")


@pytest.mark.parametrize("mac", [None, 5, "", "0" * 64, "\ud800"])
def test_a_trust_mode_reader_refuses_a_missing_malformed_or_wrong_mac(tmp_path, mac):
    info = write_snapshot(tmp_path, "w", IDENTITY, ADAPTERS, filled_cache().snapshot_blocks(BIG), created=1.0,
                          mac_key=KEY)
    assert len(read_snapshot(info.manifest, IDENTITY, max_payload_bytes=BIG, mac_key=KEY).blocks) == 6
    forge(info, edit_manifest=lambda body: body.pop("mac") if mac is None else body.update(mac=mac))
    assert refusal(info.manifest, mac_key=KEY) == NO_MAC


def _no_parsing(monkeypatch):
    def loads(*args, **kwargs):
        raise AssertionError("the manifest was parsed")

    monkeypatch.setattr(snapshot_verify.json, "loads", loads)


def test_a_trust_mode_reader_checks_the_mac_over_the_raw_bytes_before_it_parses_anything(tmp_path, monkeypatch):
    # A writer without the key wrote a large manifest of nested lists (a 63 MiB one took 6 s and 1.4 GiB to parse
    # before its MAC was checked): refused on its bytes, the parser never called.
    info = write_snapshot(tmp_path, "w", IDENTITY, ADAPTERS, filled_cache().snapshot_blocks(BIG), created=1.0,
                          mac_key=KEY)
    signed = info.manifest.read_bytes()
    info.manifest.write_bytes(b"[" + b"[]," * (1 << 20) + b"[]]")
    with monkeypatch.context() as patch:
        _no_parsing(patch)
        assert refusal(info.manifest, mac_key=KEY) == NO_MAC
        # A MAC of another key, or one digit changed anywhere in the file, is refused the same way.
        info.manifest.write_bytes(sign_manifest(signed[:signed.rindex(b',"mac"')] + b"}", b"o" * 32))
        assert refusal(info.manifest, mac_key=KEY) == NO_MAC
        info.manifest.write_bytes(signed.replace(b'"created":1.0', b'"created":2.0'))
        assert refusal(info.manifest, mac_key=KEY) == NO_MAC
        for short in (b"", b"{}", signed[-74:], signed[-73:]):  # shorter than a MAC, or nothing but one
            info.manifest.write_bytes(short)
            assert refusal(info.manifest, mac_key=KEY) == NO_MAC
    info.manifest.write_bytes(signed)
    assert len(read_snapshot(info.manifest, IDENTITY, max_payload_bytes=BIG, mac_key=KEY).blocks) == 6


def test_the_manifest_bound_follows_the_payload_bound_and_is_checked_before_parsing(tmp_path, monkeypatch):
    # The demo LM's KV (6 layers, 2 KV heads, head_dim 64, float32, 16-token blocks) under snapshot_bytes' 128 MiB:
    # 1,365 blocks of 98,304 bytes; their manifest weighs about 444 bytes a block (606,082 bytes, measured with
    # real-shaped records: 16 token ids under 32,000, tenant, adapter and plan names). The bound is 2.7 MB, not
    # the 64 MiB any snapshot got before.
    demo = SnapshotIdentity("b", "t", "float32", "fp", 16, (6, 2, 64))
    blocks = (128 << 20) // (6 * 2 * 2 * 16 * 64 * 4) + 1
    assert snapshot_verify.manifest_bound(demo, 128 << 20) == (1 << 20) + blocks * (1024 + 11 * 16) == 2_687_776
    int8 = dataclasses.replace(demo, storage="int8")  # a quarter of the bytes a block: four times the blocks
    assert snapshot_verify.manifest_bound(int8, 128 << 20) > 4 * snapshot_verify.manifest_bound(demo, 128 << 20) - \
        4 * (1 << 20)
    assert snapshot_verify.manifest_bound(demo, 1 << 40) == snapshot_verify.MAX_MANIFEST_BYTES  # the ceiling
    # Open mode: a manifest over the bound is refused before the parser sees it.
    info = write(tmp_path)
    bound = snapshot_verify.manifest_bound(IDENTITY, info.payload_bytes)
    assert info.manifest.stat().st_size < bound  # a real one is far under it
    assert len(read_snapshot(info.manifest, IDENTITY, max_payload_bytes=info.payload_bytes).blocks) == 6
    info.manifest.write_bytes(b"[" + b"[]," * (bound // 3) + b"[]]")
    _no_parsing(monkeypatch)
    assert refusal(info.manifest, max_bytes=info.payload_bytes) == (
        "format", f"manifest of {bound // 3 * 3 + 4} bytes is over the {bound}-byte bound")


def test_an_open_mode_reader_refuses_a_manifest_with_a_mac(tmp_path):
    info = write_snapshot(tmp_path, "w", IDENTITY, ADAPTERS, filled_cache().snapshot_blocks(BIG), created=1.0,
                          mac_key=KEY)
    assert refusal(info.manifest) == ("mac", "the manifest carries a MAC: it was written in trust mode, and this "
                                             "instance runs open mode (no deployment secret)")


# ----------------------------------------------------------------------------------- the payload file
def test_the_payload_bound_is_inclusive_and_applies_to_the_file_and_to_what_the_manifest_says(tmp_path):
    info = write(tmp_path)
    size = info.payload_bytes
    assert len(read_snapshot(info.manifest, IDENTITY, max_payload_bytes=size).blocks) == 6
    over = ("too_large", f"payload of {size} bytes is over the {size - 1}-byte bound")
    assert refusal(info.manifest, max_bytes=size - 1) == over
    text = info.manifest.read_text()
    forge(info, edit_manifest=lambda body: body["payload"].update(bytes=size - 1))  # the file is over the bound
    assert refusal(info.manifest, max_bytes=size - 1) == over
    info.manifest.write_text(text)
    forge(info, edit_manifest=lambda body: body["payload"].update(bytes=size + 1))  # the manifest says more
    assert refusal(info.manifest, max_bytes=size) == ("too_large", f"payload of {size + 1} bytes is over the "
                                                                   f"{size}-byte bound")
    assert refusal(info.manifest, max_bytes=size + 1) == ("truncated", f"payload has {size} bytes, the manifest "
                                                                       f"says {size + 1}")


def test_payload_damage_is_refused_with_its_reason(tmp_path):
    info = write(tmp_path)
    name = info.payload.name
    info.payload.write_bytes(bytes(info.payload_bytes))  # the right size, another content
    assert refusal(info.manifest) == ("checksum", f"payload {name} does not match its SHA-256")
    forge(info, edit_manifest=lambda body: body["payload"].update(sha256=hashlib.sha256(bytes(info.payload_bytes))
                                                                  .hexdigest()))
    reason, detail = refusal(info.manifest)  # consistent digests, but not a safetensors file
    assert reason == "payload" and detail.startswith("payload is not a readable safetensors file (")
    info.payload.unlink()
    assert refusal(info.manifest) == ("unreadable", f"payload {name}: No such file or directory")


def test_a_snapshot_file_that_grows_after_it_is_measured_is_read_only_up_to_the_bound(tmp_path, monkeypatch):
    # fstat says the file fits; the reads find more (the file grew): refused once one byte over the bound came.
    info = write(tmp_path)
    real_fstat, reads = regular_file.os.fstat, []

    def shrunk(fd):
        st = real_fstat(fd)
        return os.stat_result((st.st_mode, *st[1:6], 1, *st[7:]))

    real_read = regular_file.os.read
    monkeypatch.setattr(regular_file.os, "fstat", shrunk)
    monkeypatch.setattr(regular_file.os, "read", lambda fd, n: reads.append(n) or real_read(fd, n))
    monkeypatch.setattr(snapshot_verify, "MAX_MANIFEST_BYTES", 100)
    assert refusal(info.manifest) == ("format", "manifest of 101 bytes is over the 100-byte bound")
    assert sum(reads) == 101
    monkeypatch.setattr(snapshot_verify, "MAX_MANIFEST_BYTES", 64 << 20)
    size = info.payload_bytes
    forge(info, edit_manifest=lambda body: body["payload"].update(bytes=size - 1))
    assert refusal(info.manifest, max_bytes=size - 1) == ("too_large", f"payload of {size} bytes is over the "
                                                                       f"{size - 1}-byte bound")


def test_a_payload_that_cannot_be_opened_is_unreadable(tmp_path, monkeypatch):
    info = write(tmp_path)
    real_open = regular_file.os.open

    def refusing_open(path, flags, *args):
        if Path(path) == info.payload:
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, *args)

    monkeypatch.setattr(regular_file.os, "open", refusing_open)
    assert refusal(info.manifest) == ("unreadable", f"payload {info.payload.name}: Permission denied")


@pytest.mark.parametrize("which", ["manifest", "payload"])
@pytest.mark.parametrize("mac_key", [b"", KEY], ids=["open", "trust"])
def test_a_fifo_or_a_symbolic_link_in_place_of_a_snapshot_file_is_refused_without_blocking(tmp_path, which, mac_key):
    # A plain open() of a FIFO waits for a writer that never comes: the restore hung for good.
    info = write_snapshot(tmp_path, "w", IDENTITY, ADAPTERS, filled_cache().snapshot_blocks(BIG), created=1.0,
                          mac_key=mac_key)
    target = info.manifest if which == "manifest" else info.payload
    target.unlink()
    os.mkfifo(target)
    label = "manifest" if which == "manifest" else f"payload {target.name}"
    assert refusal(info.manifest, mac_key=mac_key) == ("unreadable", f"{label}: not a regular file (a FIFO)")
    target.unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"{}")
    target.symlink_to(elsewhere)
    assert refusal(info.manifest, mac_key=mac_key) == ("unreadable",
                                                       f"{label}: a symbolic link, not a regular file")
    target.unlink()
    target.mkdir()
    assert refusal(info.manifest, mac_key=mac_key) == ("unreadable", f"{label}: not a regular file (a directory)")


@pytest.mark.parametrize("file", ["../x.safetensors", "sub/x.safetensors", "x.json"])
def test_a_payload_outside_the_folder_or_of_another_kind_is_refused(tmp_path, file):
    info = write(tmp_path)
    forge(info, edit_manifest=lambda body: body["payload"].update(file=file))
    assert refusal(info.manifest) == ("format", "payload file name is not a plain file name")


# ---------------------------------------------------------------------------------------- the blocks
def test_a_storage_this_reader_has_no_codec_for_is_refused(tmp_path):
    info = write(tmp_path)
    forge(info, edit_manifest=lambda body: body["identity"].update(storage="fp8"))
    assert refusal(info.manifest, dataclasses.replace(IDENTITY, storage="fp8")) == \
        ("storage", "unknown kv_storage 'fp8'")
    forge(info, edit_manifest=lambda body: body["identity"].update(storage="fp", dtype="float64"))
    assert refusal(info.manifest, dataclasses.replace(IDENTITY, dtype="float64")) == \
        ("dtype", "dtype 'float64' is not one a snapshot holds")


def test_one_tensor_more_or_less_than_the_blocks_need_is_refused(tmp_path):
    info = write(tmp_path)

    def extra(tensors, body):
        tensors["b6.0"] = tensors["b0.0"].clone()

    forge(info, edit_tensors=extra)
    assert refusal(info.manifest) == ("payload", "7 tensors for 6 blocks")


def test_a_block_tensor_of_another_shape_or_dtype_is_refused(tmp_path):
    info = write(tmp_path)
    text, data = info.manifest.read_text(), info.payload.read_bytes()
    shape = (LAYERS, 2, HEADS, BS, DIM)

    def wider(tensors, body):
        tensors["b1.0"] = torch.zeros(LAYERS, 2, HEADS, BS, DIM + 1)
        rewrite_digests(tensors, body)

    forge(info, edit_tensors=wider)
    assert refusal(info.manifest) == ("payload", f"block 1: tensor {(LAYERS, 2, HEADS, BS, DIM + 1)} float32, "
                                                 f"expected {shape} float32")
    info.manifest.write_text(text)
    info.payload.write_bytes(data)

    def double(tensors, body):
        tensors["b1.0"] = tensors["b1.0"].double()
        rewrite_digests(tensors, body)

    forge(info, edit_tensors=double)
    assert refusal(info.manifest) == ("payload", f"block 1: tensor {shape} float64, expected {shape} "
                                                 f"float32")


def test_int8_block_scales_of_another_shape_are_refused(tmp_path):
    identity = dataclasses.replace(IDENTITY, storage="int8")
    info = write(tmp_path, filled_cache("int8"), identity)

    def wide_scales(tensors, body):
        tensors["b0.1"] = torch.ones(LAYERS, 2, HEADS, 2, DIM, dtype=torch.float16)

    forge(info, edit_tensors=wide_scales)
    reason, detail = refusal(info.manifest, identity)
    assert reason == "payload" and detail.startswith("block 0: tensor (2, 2, 1, 2, 3) float16")


@pytest.mark.parametrize("edit", ["no_hash", "short_hash", "few_tokens", "negative_token", "huge_token",
                                  "beyond_int64_token", "bad_source", "no_sha256"])
def test_a_malformed_block_record_is_a_format_refusal(tmp_path, edit):
    def change(body):
        record = body["blocks"][1]
        if edit == "no_hash":
            del record["hash"]
        elif edit == "short_hash":
            record["hash"] = record["hash"][:-2]
        elif edit == "few_tokens":
            record["tokens"] = record["tokens"][:-1]
        elif edit == "negative_token":
            record["tokens"][0] = -1
        elif edit == "huge_token":
            record["tokens"][0] = 2 ** 31
        elif edit == "beyond_int64_token":  # not even a 64-bit integer: the record is malformed
            record["tokens"][0] = 2 ** 63
        elif edit == "bad_source":
            record["source"] = "elsewhere"
        else:
            del record["sha256"]

    info = write(tmp_path)
    forge(info, edit_manifest=change)
    reason, detail = refusal(info.manifest)
    malformed = edit in ("short_hash", "few_tokens", "negative_token", "huge_token")
    assert reason == "format"
    assert detail == "block 1: token ids or hash malformed" if malformed else detail.startswith("block 1: record")


def test_token_ids_at_the_edges_of_int32_are_read(tmp_path):
    info = write(tmp_path)

    def edges(body):
        body["blocks"][0]["tokens"] = [0, 2 ** 31 - 1, 5, 6]

    forge(info, edit_manifest=edges)
    assert read_snapshot(info.manifest, IDENTITY, max_payload_bytes=BIG).blocks[0].tokens.tolist() == \
        [0, 2 ** 31 - 1, 5, 6]


def test_a_block_before_its_parent_or_written_twice_is_refused(tmp_path):
    info = write(tmp_path)
    text, data = info.manifest.read_text(), info.payload.read_bytes()
    body = json.loads(text)
    child = next(i for i, r in enumerate(body["blocks"]) if r["parent"] != NONE_HASH.hex())

    def child_first(tensors, body):
        records = body["blocks"]
        records.insert(0, records.pop(child))
        moved = tensors.pop(f"b{child}.0")
        for index in range(child, 0, -1):
            tensors[f"b{index}.0"] = tensors.pop(f"b{index - 1}.0")
        tensors["b0.0"] = moved

    forge(info, edit_tensors=child_first)
    assert refusal(info.manifest) == ("format", "block 0: parent not written before it, or written twice")
    info.manifest.write_text(text)
    info.payload.write_bytes(data)

    def twice(tensors, body):
        body["blocks"][1] = dict(body["blocks"][0])
        tensors["b1.0"] = tensors["b0.0"].clone()

    forge(info, edit_tensors=twice)
    assert refusal(info.manifest) == ("format", "block 1: parent not written before it, or written twice")


def test_a_forged_block_digest_and_non_finite_values_are_refused_with_the_block_named(tmp_path):
    info = write(tmp_path)
    text, data = info.manifest.read_text(), info.payload.read_bytes()
    forge(info, edit_manifest=lambda body: body["blocks"][4].update(sha256="0" * 64))
    assert refusal(info.manifest) == ("checksum", "block 4 does not match its SHA-256 (bound to its hash)")
    info.manifest.write_text(text)
    info.payload.write_bytes(data)

    def poison(tensors, body):
        tensors["b4.0"].view(-1)[0] = float("nan")
        rewrite_digests(tensors, body)

    forge(info, edit_tensors=poison)
    assert refusal(info.manifest) == ("not_finite", "block 4 holds NaN or infinite values")


# ------------------------------------------------------------------------------------------ listing
def test_list_snapshots_is_newest_first_by_name_on_a_tie_and_bounded(tmp_path):
    for index in range(18):
        path = tmp_path / f"s{index:02d}{MANIFEST_SUFFIX}"
        path.write_text("{}")
        os.utime(path, ns=(10 ** 18, (10 ** 18) + (index // 2) * 10 ** 9))  # pairs share a time
    (tmp_path / f"folder{MANIFEST_SUFFIX}").mkdir()
    names = [p.name.removesuffix(MANIFEST_SUFFIX) for p in list_snapshots(tmp_path)]
    assert names == [f"s{i:02d}" for i in (16, 17, 14, 15, 12, 13, 10, 11, 8, 9, 6, 7, 4, 5, 2, 3)]
    assert [p.name for p in list_snapshots(tmp_path, limit=3)] == [f"s{i}{MANIFEST_SUFFIX}" for i in (16, 17, 14)]
    assert list_snapshots(tmp_path / "nowhere") == []
    assert list_snapshots(tmp_path / f"s00{MANIFEST_SUFFIX}") == []  # a file, not a folder
