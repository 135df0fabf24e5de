"""KV snapshots between two engines (two processes' worth of state) on the demo LM, without a server."""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import socket
import time
import types

import pytest
import torch

from tests.unit.lora_adapter.conftest import serve
from warmup_tools.common.digests import tokenizer_fingerprint
from warmup_tools.demo.prompts import SYSTEM_PROMPTS
from warmup_tools.kv.blocks import BlockSource
from warmup_tools.kv.config import KVCacheConfig
from warmup_tools.kv.prefix_cache import PrefixCache
from warmup_tools.kv.snapshot import prefix_tokens, write_snapshot
from warmup_tools.kv.snapshot_files import snapshot_name
from warmup_tools.kv.snapshot_verify import SnapshotIdentity, list_snapshots, read_snapshot, salt_fingerprint
from warmup_tools.lora_adapter import snapshot_restore
from warmup_tools.lora_adapter.engines import make_engine as build_engine
from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams
from warmup_tools.lora_adapter.settings import EngineConfig, SnapshotConfig
from warmup_tools.lora_adapter.snapshot_restore import RestoreReport, SnapshotRestorer, engine_identity
from warmup_tools.lora_adapter.snapshots import SnapshotKeeper

PLAN = "plan-1"


def make_engine(demo_assets, **kv):
    return build_engine(EngineConfig(base_model=demo_assets.lm_dir, adapter_root=demo_assets.adapter_root,
                                   kv=KVCacheConfig(budget_bytes=64 << 20, **kv), num_threads=1))


@pytest.fixture(scope="module")
def writer(demo_assets):
    """An engine that warmed a planned prefix (support) and served a live one (sql)."""
    engine = make_engine(demo_assets)
    engine.prefix_cache.activate_plan(PLAN)
    run(engine, SYSTEM_PROMPTS["support"], "support", plan=PLAN)
    run(engine, SYSTEM_PROMPTS["sql"] + "User: list the tables\nAssistant:", "sql")
    return engine


@pytest.fixture(scope="module")
def reader(demo_assets):
    return make_engine(demo_assets)


@pytest.fixture()
def fresh(reader):
    reader.prefix_cache.clear()
    reader.prefix_cache.activate_plan(None)
    return reader


def run(engine, text, adapter, plan=None, max_tokens=8):
    ids = engine.encode(text)
    req = GenerateRequest(ids, adapter, "default", False, SamplingParams(max_tokens=max_tokens),
                          source=BlockSource.WARMUP if plan else BlockSource.LIVE, plan_id=plan)
    steps = serve(engine, req)
    return [s.token_id for s in steps], steps[-1].cached_tokens


def keeper(engine, folder, plan=PLAN, share=0.05, logs=None, **options):
    return SnapshotKeeper(engine, SnapshotConfig(folder=folder, verify_share=share, interval_s=0), instance="lora_0",
                          plan_id=plan, host="test", log=(logs.append if logs is not None else None), **options)


def test_a_second_engine_restores_the_snapshot_and_serves_the_same_greedy_output_warm(writer, fresh, tmp_path):
    info = keeper(writer, tmp_path).write()
    assert info is not None and info.blocks == len(writer.prefix_cache)
    assert keeper(writer, tmp_path).write() is not None  # a new keeper writes; the same one skips an unchanged set
    logs: list[str] = []
    report = keeper(fresh, tmp_path, logs=logs).restore()
    assert report.blocks == info.blocks and report.skipped == {} and logs == []
    assert report.verified >= 1
    cache = fresh.prefix_cache
    assert cache.active_plan == PLAN and cache.stats.pinned_bytes == writer.prefix_cache.stats.pinned_bytes > 0
    prompt = SYSTEM_PROMPTS["sql"] + "User: list the tables\nAssistant:"
    restored_tokens, cached = run(fresh, prompt, "sql")
    assert cached > 0
    cache.clear()
    assert run(fresh, prompt, "sql") == (restored_tokens, 0)  # recomputed from scratch: the same tokens
    assert run(writer, prompt, "sql")[0] == restored_tokens


def test_blocks_of_another_plan_come_back_as_live_kv_outside_the_warmup_cap(writer, fresh, tmp_path):
    keeper(writer, tmp_path).write()
    report = keeper(fresh, tmp_path, plan="plan-2").restore()
    assert report.blocks == len(writer.prefix_cache)
    assert fresh.prefix_cache.stats.pinned_bytes == 0 and fresh.prefix_cache.stats.warmup_bytes == 0


def test_the_writer_s_own_keeper_skips_an_unchanged_set(writer, tmp_path):
    own = keeper(writer, tmp_path)
    assert own.write() is not None and own.write() is None


def test_a_snapshot_rewritten_with_other_weights_is_rejected_by_recomputation(writer, fresh, tmp_path):
    """The payload is the legal adapter's KV under the support blocks' names, with consistent checksums."""
    own = keeper(writer, tmp_path)
    blocks = writer.prefix_cache.snapshot_blocks(1 << 30)
    support = [b for b in blocks if b.owner == "support"]
    by_hash = {b.block_hash: b for b in support}
    codec = writer.prefix_cache.codec
    forged = []
    for block in support:
        tokens = prefix_tokens(block, by_hash)
        kv = writer.compute_kv("legal", tokens)
        start = len(tokens) - writer.prefix_cache.block_size
        tensor = torch.stack([torch.stack((k[0, :, start:], v[0, :, start:])) for k, v in kv])
        forged.append(dataclasses.replace(block, payload=codec.encode(tensor)[0]))
    write_snapshot(tmp_path, own.name, own.identity, dict(writer.adapter_fingerprints), forged, created=1.0)
    logs: list[str] = []
    report = keeper(fresh, tmp_path, logs=logs).restore()
    assert report.skipped == {"verify": 1} and report.blocks == 0 and len(fresh.prefix_cache) == 0
    assert len(logs) == 1 and "verify" in logs[0]


def test_blocks_of_an_adapter_with_other_weights_are_dropped_and_the_rest_restored(writer, fresh, tmp_path):
    own = keeper(writer, tmp_path)
    adapters = {**writer.adapter_fingerprints, "sql": "retrained"}
    blocks = writer.prefix_cache.snapshot_blocks(1 << 30)
    write_snapshot(tmp_path, own.name, own.identity, adapters, blocks, created=1.0)
    logs: list[str] = []
    report = keeper(fresh, tmp_path, logs=logs).restore()
    assert report.skipped == {"adapter": 1} and len(logs) == 1
    assert report.blocks == sum(1 for b in blocks if b.owner != "sql") > 0


def test_a_damaged_snapshot_is_skipped_with_one_log_line_and_others_still_restore(writer, fresh, tmp_path):
    keeper(writer, tmp_path).write()
    info = SnapshotKeeper(writer, SnapshotConfig(folder=tmp_path, interval_s=0), instance="lora_1",
                          host="test").write()
    data = bytearray(info.payload.read_bytes())
    data[len(data) // 2] ^= 0x40
    info.payload.write_bytes(bytes(data))
    logs: list[str] = []
    report = keeper(fresh, tmp_path, logs=logs).restore()
    assert report.skipped == {"checksum": 1} and len(logs) == 1 and info.manifest.name in logs[0]
    assert report.snapshots_used == 1 and report.blocks == len(writer.prefix_cache)


def test_restore_stays_within_the_reader_s_budget(writer, reader, tmp_path, monkeypatch):
    keeper(writer, tmp_path).write()
    block = next(iter(writer.prefix_cache.snapshot_blocks(1 << 30))).nbytes
    monkeypatch.setattr(reader, "prefix_cache", PrefixCache(5 * block, 16, live_reserve=0.5))
    report = keeper(reader, tmp_path).restore()
    stats = reader.prefix_cache.stats
    assert stats.bytes_used <= 5 * block and stats.warmup_bytes <= reader.prefix_cache.warmup_budget
    assert report.blocks <= 5 and report.not_placed == len(writer.prefix_cache) - report.blocks
    assert stats.evictions == 0


def test_a_snapshot_is_bounded_by_snapshot_bytes(writer, tmp_path):
    block = next(iter(writer.prefix_cache.snapshot_blocks(1 << 30))).nbytes
    small = SnapshotKeeper(writer, SnapshotConfig(folder=tmp_path, max_bytes=3 * block, interval_s=0),
                           instance="lora_0", host="test")
    assert small.write().blocks == 3
    assert len(list_snapshots(tmp_path)) == 1


def test_int8_blocks_restore_and_pass_verification_of_every_block(demo_assets, tmp_path):
    writer8, reader8 = make_engine(demo_assets, storage="int8"), make_engine(demo_assets, storage="int8")
    prompt = SYSTEM_PROMPTS["legal"] + "User: Clause 3 says what?\nAssistant:"
    expected, _ = run(writer8, prompt, "legal")
    keeper(writer8, tmp_path).write()
    report = keeper(reader8, tmp_path, share=1.0).restore()
    assert report.skipped == {} and report.verified == report.blocks == len(writer8.prefix_cache) > 0
    tokens, cached = run(reader8, prompt, "legal")
    assert cached > 0 and tokens == expected


def test_one_forged_block_deep_in_the_chain_is_caught_when_every_block_is_checked(writer, fresh, tmp_path):
    own = keeper(writer, tmp_path)
    blocks = writer.prefix_cache.snapshot_blocks(1 << 30)
    deep = max(range(len(blocks)), key=lambda i: i if blocks[i].parent in {b.block_hash for b in blocks} else -1)
    payload = blocks[deep].payload.clone()
    payload[3] += 0.5  # layer 3 only: recomputed from the stored ancestors, the block's upper layers differ
    blocks[deep] = dataclasses.replace(blocks[deep], payload=payload)
    write_snapshot(tmp_path, own.name, own.identity, dict(writer.adapter_fingerprints), blocks, created=1.0)
    report = keeper(fresh, tmp_path, share=1.0).restore()
    assert report.skipped == {"verify": 1} and len(fresh.prefix_cache) == 0


def test_snapshot_settings_come_from_the_config_parameters_with_one_set_of_defaults(tmp_path):
    from warmup_tools.common.errors import ConfigError
    from warmup_tools.lora_adapter.settings import DEFAULT_SNAPSHOTS, LoraAdapterSettings
    from warmup_tools.triton.params import ModelParameters

    def settings(**values):
        params = {"base_model": {"string_value": "lm"}, **{k: {"string_value": v} for k, v in values.items()}}
        return LoraAdapterSettings.from_parameters(ModelParameters({"name": "lora_adapter", "parameters": params},
                                                                   base_dir=tmp_path)).snapshots

    assert settings() == DEFAULT_SNAPSHOTS and DEFAULT_SNAPSHOTS.folder is None
    got = settings(snapshot_dir="snaps", snapshot_bytes="1000", snapshot_interval_s="0", snapshot_verify_share="1")
    assert got == SnapshotConfig(folder=tmp_path / "snaps", max_bytes=1000, interval_s=0.0, verify_share=1.0)
    with pytest.raises(ConfigError, match="snapshot_verify_share"):
        settings(snapshot_dir="snaps", snapshot_verify_share="0")


class RecordingRandom(random.Random):
    """A seeded generator that remembers what it drew (to show where the verification sample comes from)."""

    def __init__(self, seed):
        super().__init__(seed)
        self.draws = []

    def sample(self, population, k, **kwargs):
        drawn = super().sample(population, k, **kwargs)
        self.draws.append(drawn)
        return drawn


def checked_prefixes(engine, monkeypatch):
    """The token ids every verification recompute of ``engine`` prefills, in order."""
    seen = []
    original = engine.compute_kv

    def recording(adapter, ids):
        seen.append(tuple(ids))
        return original(adapter, ids)

    monkeypatch.setattr(engine, "compute_kv", recording)
    return seen


def test_the_verification_sample_is_drawn_by_the_reader_not_seeded_by_the_manifest(writer, fresh, tmp_path,
                                                                                   monkeypatch):
    """Two restores of the very same files draw their own samples; the files cannot steer either draw."""
    keeper(writer, tmp_path).write()
    seen = checked_prefixes(fresh, monkeypatch)
    picks = []
    for seed in (1, 2):
        fresh.prefix_cache.clear()
        rng, start = RecordingRandom(seed), len(seen)
        report = keeper(fresh, tmp_path, rng=rng).restore()
        assert report.skipped == {} and report.verified >= 1 and len(rng.draws) == 1
        first, by_hash = rng.draws[0][0], {b.block_hash: b for b in rng.draws[0]}
        assert seen[start] == tuple(prefix_tokens(first, by_hash))  # the first recompute is the rng's first pick
        picks.append(first.block_hash)
    assert picks[0] != picks[1]  # same snapshot, same manifest digest: different samples
    assert isinstance(keeper(fresh, tmp_path)._rng, random.SystemRandom)  # by default: the system's randomness


def test_a_nan_block_is_never_restored_whichever_blocks_the_sample_checks(writer, fresh, tmp_path):
    own = keeper(writer, tmp_path)
    blocks = writer.prefix_cache.snapshot_blocks(1 << 30)
    leaf = next(i for i, b in enumerate(blocks) if b.block_hash not in {c.parent for c in blocks})
    blocks[leaf] = dataclasses.replace(blocks[leaf], payload=torch.full_like(blocks[leaf].payload, float("nan")))
    write_snapshot(tmp_path, own.name, own.identity, dict(writer.adapter_fingerprints), blocks, created=1.0)
    logs: list[str] = []
    # A generator that draws the other blocks first: the sample alone would not look at the NaN block.
    never_first = RecordingRandom(0)
    never_first.sample = lambda population, k: sorted(population, key=lambda b: b.block_hash == blocks[leaf].block_hash)
    report = keeper(fresh, tmp_path, logs=logs, rng=never_first).restore()
    assert report.skipped == {"not_finite": 1} and report.blocks == 0 and len(fresh.prefix_cache) == 0
    assert len(logs) == 1 and "not_finite" in logs[0]


def test_trust_mode_snapshots_are_signed_and_a_manifest_without_the_deployment_s_mac_is_refused(writer, fresh,
                                                                                                 tmp_path):
    key, other = b"k" * 32, b"o" * 32
    info = keeper(writer, tmp_path, mac_key=key).write()
    assert '"mac"' in info.manifest.read_text()
    report = keeper(fresh, tmp_path, mac_key=key).restore()
    assert report.skipped == {} and report.blocks == info.blocks
    for reader_key in (other, b""):  # another deployment's key; open mode
        fresh.prefix_cache.clear()
        logs: list[str] = []
        report = keeper(fresh, tmp_path, logs=logs, mac_key=reader_key).restore()
        assert report.skipped == {"mac": 1} and report.blocks == 0 and len(logs) == 1
    keeper(writer, tmp_path).write()  # an open-mode writer (no MAC) into the trust-mode folder
    fresh.prefix_cache.clear()
    report = keeper(fresh, tmp_path, mac_key=key).restore()
    assert report.skipped == {"mac": 1} and report.blocks == 0


@pytest.mark.parametrize("mac_key", [b"", b"k" * 32], ids=["open", "trust"])
def test_a_restore_skips_a_snapshot_whose_payload_is_a_fifo_and_does_not_block(writer, fresh, tmp_path, mac_key):
    import os

    info = keeper(writer, tmp_path, mac_key=mac_key).write()
    info.payload.unlink()
    os.mkfifo(info.payload)  # a plain open() waits for a writer that never comes: the load hung for good
    logs: list[str] = []
    report = keeper(fresh, tmp_path, logs=logs, mac_key=mac_key).restore()
    assert report.skipped == {"unreadable": 1} and report.blocks == 0
    assert len(logs) == 1 and "not a regular file (a FIFO)" in logs[0]


# ------------------------------------------------- the restore's rules in detail (pinned for mutation testing)
def test_a_restorer_needs_a_prefix_cache_and_a_folder_and_is_named_after_its_instance_and_host(writer, tmp_path):
    message = "^a snapshot keeper needs a KV prefix cache and a snapshot folder$"
    with pytest.raises(ValueError, match=message):
        SnapshotKeeper(writer, SnapshotConfig(folder=None), instance="lora_0")
    with pytest.raises(ValueError, match=message):
        SnapshotRestorer(types.SimpleNamespace(prefix_cache=None), SnapshotConfig(folder=tmp_path), instance="lora_0")
    assert keeper(writer, tmp_path).name == "lora_0_test"
    assert SnapshotRestorer(writer, SnapshotConfig(folder=tmp_path), instance="lora_0").name == \
        snapshot_name("lora_0", socket.gethostname())


def test_the_identity_is_the_engine_s_own(writer, monkeypatch):
    cache, model = writer.prefix_cache, writer.model_config
    layers, heads = model.num_hidden_layers, model.num_key_value_heads
    dim = getattr(model, "head_dim", None) or model.hidden_size // model.num_attention_heads
    assert engine_identity(writer) == SnapshotIdentity(
        writer.base_fingerprint, tokenizer_fingerprint(writer.tokenizer), "float32", cache.storage, cache.block_size,
        (layers, heads, dim), "")
    monkeypatch.setattr(writer, "config", dataclasses.replace(writer.config, cache_salt="s"))
    assert engine_identity(writer).salt_fingerprint == salt_fingerprint("s")


class ByDepth(random.Random):
    """A generator whose sample puts the blocks with the fewest ancestors first (``deepest``: the most)."""

    def __init__(self, deepest=False):
        super().__init__(0)
        self.deepest = deepest

    def sample(self, population, k, **kwargs):
        by_hash = {b.block_hash: b for b in population}
        depth = {b.block_hash: len(prefix_tokens(b, by_hash)) for b in population}
        return sorted(population, key=lambda b: depth[b.block_hash], reverse=self.deepest)[:k]


def test_the_verified_count_follows_the_share_rounded_up_with_at_least_one_block(writer, fresh, tmp_path,
                                                                                  monkeypatch):
    keeper(writer, tmp_path).write()
    total = len(writer.prefix_cache)
    seen = checked_prefixes(fresh, monkeypatch)
    for share, verified in ((1e-6, 1), (1.2 / total, 2), (1.0, total)):
        fresh.prefix_cache.clear()
        report = keeper(fresh, tmp_path, share=share, rng=ByDepth()).restore()
        assert report.skipped == {} and report.verified == verified and report.blocks == total
    fresh.prefix_cache.clear()
    del seen[:]
    report = keeper(fresh, tmp_path, share=1.0, rng=ByDepth(deepest=True)).restore()
    assert report.verified == total  # a drawn block already checked with a deeper one is passed over
    assert len(seen) < total  # each prefill checked a whole chain


def test_verified_blocks_add_up_over_snapshots_and_each_skip_is_counted(writer, fresh, tmp_path):
    keeper(writer, tmp_path).write()
    SnapshotKeeper(writer, SnapshotConfig(folder=tmp_path, interval_s=0), instance="lora_1", host="test").write()
    report = keeper(fresh, tmp_path, share=1.0).restore()
    assert report.snapshots_used == 2 and report.verified == 2 * len(writer.prefix_cache)
    assert report.blocks == report.not_placed == len(writer.prefix_cache)
    for info in (tmp_path / "lora_0_test.manifest.json", tmp_path / "lora_1_test.manifest.json"):
        info.write_text(info.read_text().replace('"tenant":"default"', '"tenant":"defaulT"', 1))
    fresh.prefix_cache.clear()
    report = keeper(fresh, tmp_path).restore()
    assert report.skipped == {"checksum": 2} and report.snapshots_used == 0


def test_this_writer_s_own_snapshot_is_restored_first(writer, fresh, tmp_path):
    """The own snapshot's plan blocks come back pinned, though another, newer one (whose name sorts first)
    holds the same blocks unpinned."""
    own = keeper(writer, tmp_path)
    own.write()
    unplanned = [dataclasses.replace(b, plan_id=None, source=BlockSource.LIVE)
                 for b in writer.prefix_cache.snapshot_blocks(1 << 30)]
    other = write_snapshot(tmp_path, "a_replica_test", own.identity, dict(writer.adapter_fingerprints), unplanned,
                           created=2.0)
    newer = (tmp_path / "lora_0_test.manifest.json").stat().st_mtime_ns + 10 ** 9
    os.utime(other.manifest, ns=(newer, newer))
    report = keeper(fresh, tmp_path).restore()
    assert report.snapshots_used == 2 and report.not_placed == len(writer.prefix_cache)
    assert fresh.prefix_cache.stats.pinned_bytes == writer.prefix_cache.stats.pinned_bytes > 0


def test_a_rejected_or_failing_snapshot_first_does_not_stop_the_others(writer, fresh, tmp_path, caplog):
    own = keeper(writer, tmp_path).write()
    SnapshotKeeper(writer, SnapshotConfig(folder=tmp_path, interval_s=0), instance="lora_1", host="test").write()
    own.manifest.write_text("{")
    with caplog.at_level(logging.WARNING, logger="warmup_tools.lora_adapter.snapshot_restore"):
        report = SnapshotRestorer(fresh, SnapshotConfig(folder=tmp_path, verify_share=0.05), instance="lora_0",
                                  host="test").restore()  # no log given: the module's logger
    assert report.skipped == {"format": 1} and report.snapshots_used == 1
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == \
        ["KV snapshot lora_0_test.manifest.json skipped (format): manifest is not JSON (JSONDecodeError)"]
    keeper(writer, tmp_path).write()
    calls = []

    def run_once_failing(fn):
        calls.append(fn)
        if len(calls) == 1:
            raise RuntimeError("engine busy")
        return fn()

    fresh.prefix_cache.clear()
    logs: list[str] = []
    report = keeper(fresh, tmp_path, logs=logs, run_on_engine=run_once_failing).restore()
    assert report.skipped == {"error": 1} and report.snapshots_used == 1 and len(calls) >= 2
    assert logs == ["KV snapshot lora_0_test.manifest.json skipped (error): RuntimeError: engine busy"]


def test_a_hash_that_does_not_re_derive_and_a_recompute_that_differs_are_refused_with_their_messages(
        writer, fresh, tmp_path):
    own = keeper(writer, tmp_path)
    blocks = writer.prefix_cache.snapshot_blocks(1 << 30)
    leaf = next(i for i, b in enumerate(blocks) if b.block_hash not in {c.parent for c in blocks})
    rewritten = list(blocks)
    rewritten[leaf] = dataclasses.replace(blocks[leaf], tokens=blocks[leaf].tokens[::-1].copy())
    write_snapshot(tmp_path, own.name, own.identity, dict(writer.adapter_fingerprints), rewritten, created=1.0)
    logs: list[str] = []
    report = keeper(fresh, tmp_path, logs=logs).restore()
    assert report.skipped == {"hash": 1} and report.blocks == 0
    assert logs == ["KV snapshot lora_0_test.manifest.json skipped (hash): 1 block hash(es) do not re-derive from "
                    "their token ids"]
    forged = list(blocks)
    forged[leaf] = dataclasses.replace(blocks[leaf], payload=blocks[leaf].payload + 1.0)
    write_snapshot(tmp_path, own.name, own.identity, dict(writer.adapter_fingerprints), forged, created=1.0)
    logs.clear()
    report = keeper(fresh, tmp_path, logs=logs, share=1.0).restore()
    assert report.skipped == {"verify": 1}
    assert logs == [f"KV snapshot lora_0_test.manifest.json skipped (verify): block "
                    f"{blocks[leaf].block_hash.hex()[:12]} recomputed with adapter {blocks[leaf].owner} differs from "
                    "the stored KV"]


def test_dropped_adapter_blocks_are_logged_once_with_their_count(writer, fresh, tmp_path):
    own = keeper(writer, tmp_path)
    blocks = writer.prefix_cache.snapshot_blocks(1 << 30)
    retired = [dataclasses.replace(b, owner="retired") if b.owner == "sql" else b for b in blocks]
    adapters = {**writer.adapter_fingerprints, "retired": "old"}
    write_snapshot(tmp_path, own.name, own.identity, adapters, retired, created=1.0)
    logs: list[str] = []
    report = keeper(fresh, tmp_path, logs=logs).restore()
    roots = sum(1 for b in blocks if b.owner == "sql" and b.parent not in {c.block_hash for c in blocks})
    assert report.skipped == {"adapter": 1} and report.blocks == sum(1 for b in blocks if b.owner != "sql")
    assert logs == [f"KV snapshot lora_0_test.manifest.json skipped (adapter): {roots} block(s) of adapters this "
                    "instance does not serve with the same weights dropped; the rest is used"]


def test_restored_blocks_keep_the_plan_only_when_it_is_this_instance_s_and_go_to_the_engine_s_device(
        writer, fresh, tmp_path, monkeypatch, caplog):
    keeper(writer, tmp_path).write()
    blocks = writer.prefix_cache.snapshot_blocks(1 << 30)
    placed = []
    restore = fresh.prefix_cache.restore
    monkeypatch.setattr(fresh.prefix_cache, "restore", lambda block: placed.append(block) or restore(block))
    with caplog.at_level(logging.INFO, logger="warmup_tools.lora_adapter.snapshot_restore"):
        start = time.perf_counter()
        report = keeper(fresh, tmp_path).restore()
        elapsed = time.perf_counter() - start
    assert 0 <= report.seconds <= elapsed
    assert report.bytes == sum(b.nbytes for b in blocks) == fresh.prefix_cache.stats.bytes_used
    plan = {b.block_hash for b in blocks if b.plan_id == PLAN}
    assert plan and [b.block_hash in plan for b in placed] == sorted((b.block_hash in plan for b in placed),
                                                                     reverse=True)  # the plan's blocks first
    for block in placed:
        mine = block.block_hash in plan
        assert (block.source, block.plan_id) == ((BlockSource.WARMUP, PLAN) if mine else (BlockSource.LIVE, None))
        assert block.payload.device == fresh.device
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "restored" in r.getMessage()] == \
        [f"KV snapshots: {len(blocks)} block(s), {report.bytes} bytes restored from 1 snapshot(s) in "
         f"{report.seconds:.2f} s ({report.verified} verified)"]

    placed.clear()
    fresh.prefix_cache.clear()
    fresh.prefix_cache.activate_plan("p-live")
    report = keeper(fresh, tmp_path, plan=None).restore()  # no plan of its own: the active one stays
    assert fresh.prefix_cache.active_plan == "p-live" and report.blocks == len(blocks)
    assert all((b.source, b.plan_id) == (BlockSource.LIVE, None) for b in placed)


def test_restored_payloads_are_moved_to_the_engine_s_device(writer, fresh, tmp_path, monkeypatch):
    info = keeper(writer, tmp_path).write()
    identity = keeper(fresh, tmp_path).identity
    blocks = read_snapshot(info.manifest, identity, max_payload_bytes=1 << 30).blocks
    int8 = [dataclasses.replace(b, payload=(b.payload.to(torch.int8), b.payload[:, :, :, :1].half())) for b in blocks]
    placed = []
    monkeypatch.setattr(fresh.model, "device", torch.device("meta"))  # the loaded model's, which the engine serves
    monkeypatch.setattr(fresh.prefix_cache, "restore", lambda block: placed.append(block) or True)
    report = RestoreReport()
    keeper(fresh, tmp_path)._place(blocks + int8, report)
    assert report.blocks == 2 * len(blocks) and report.bytes == 2 * sum(b.nbytes for b in blocks)
    tuples = [b.payload for b in placed if isinstance(b.payload, tuple)]
    tensors = [b.payload for b in placed if not isinstance(b.payload, tuple)]
    assert len(tuples) == len(tensors) == len(blocks)
    assert all(t.is_meta for t in tensors) and all(p.is_meta for parts in tuples for p in parts)


def test_a_snapshot_is_read_up_to_snapshot_bytes_plus_room_for_its_header(writer, fresh, tmp_path):
    info = keeper(writer, tmp_path).write()
    assert info.payload_bytes > 1
    small = SnapshotKeeper(fresh, SnapshotConfig(folder=tmp_path, max_bytes=1, interval_s=0), instance="lora_0",
                           host="test")
    assert small.restore().blocks == info.blocks


def test_a_base_model_block_that_differs_is_refused_naming_the_base_model(fresh, tmp_path):
    run(fresh, SYSTEM_PROMPTS["support"], None)  # the base model's own blocks (owner "")
    own = keeper(fresh, tmp_path)
    blocks = fresh.prefix_cache.snapshot_blocks(1 << 30)
    assert blocks and all(b.owner == "" for b in blocks)
    leaf = next(i for i, b in enumerate(blocks) if b.block_hash not in {c.parent for c in blocks})
    forged = list(blocks)
    forged[leaf] = dataclasses.replace(blocks[leaf], payload=blocks[leaf].payload + 1.0)
    write_snapshot(tmp_path, own.name, own.identity, dict(fresh.adapter_fingerprints), forged, created=1.0)
    fresh.prefix_cache.clear()
    logs: list[str] = []
    report = keeper(fresh, tmp_path, logs=logs, share=1.0).restore()
    assert report.skipped == {"verify": 1} and len(fresh.prefix_cache) == 0
    assert logs == [f"KV snapshot lora_0_test.manifest.json skipped (verify): block "
                    f"{blocks[leaf].block_hash.hex()[:12]} recomputed with adapter base differs from the stored KV"]


def test_the_stored_kv_is_compared_in_the_engine_s_dtype_whatever_device_the_recompute_ran_on(writer, fresh, tmp_path,
                                                                                              monkeypatch):
    """Stand-ins for a GPU engine in half precision: the recomputed KV on the meta device, the engine's dtype
    bfloat16; beside the real CPU engine's recompute checked by the tests above. kv_close compares on the host
    (:meth:`~warmup_tools.kv.arrays.KVArrays.as_float32`), so the stored block stays where the cache holds it."""
    keeper(writer, tmp_path).write()
    restorer = keeper(fresh, tmp_path, share=1.0)  # the identity (float32, as written) is read here
    compute_kv = fresh.compute_kv
    monkeypatch.setattr(fresh, "compute_kv", lambda adapter, ids: [(k.to("meta"), v.to("meta"))
                                                                   for k, v in compute_kv(adapter, ids)])
    monkeypatch.setattr(fresh.model, "dtype", torch.bfloat16)
    compared = []

    def kv_close(stored, recomputed, storage):
        compared.append((stored.dtype, recomputed.device))
        return True

    monkeypatch.setattr(snapshot_restore, "kv_close", kv_close)
    report = restorer.restore()
    assert report.verified == len(writer.prefix_cache.snapshot_blocks(1 << 30)) and compared
    assert set(compared) == {(torch.bfloat16, torch.device("meta"))}
