"""Restoring one ``lora_adapter`` instance's prefix cache from KV snapshots, and checking them first.

The file checks are in :mod:`warmup_tools.kv.snapshot_verify`; this module ties them to an engine: its
identity (base model, tokenizer, dtype, storage, block size, KV shape, salt fingerprint), its adapters'
fingerprints, its hash scopes, and its forward, which recomputes a sample of every snapshot's blocks
before any block of it is trusted. Writing snapshots is
:class:`warmup_tools.lora_adapter.snapshots.SnapshotKeeper`, which restores through this module.

Restore (:meth:`SnapshotRestorer.restore`, from ``initialize`` before Triton runs the warm-up samples):
every snapshot in the folder (this writer's own first, then newest first, at most
:data:`~warmup_tools.kv.snapshot_verify.MAX_SNAPSHOTS`) that matches the instance is checked and its blocks
are put in the prefix cache, parents first, without evicting anything:

* blocks pinned by the instance's own plan (the plan its warm-up samples carry) come back as warm-up
  blocks pinned under that plan, within the warm-up cap; the samples then match them and pin them again;
* every other block (live ones, blocks of another plan, adapter warm prompts) comes back as live KV:
  evictable, outside the warm-up cap, so a stale plan's blocks never crowd out the current plan's.

A snapshot is skipped whole (one log line, one ``reason``) when it does not match or is damaged (a key
the format does not name, a block value that is NaN or infinite, and in trust mode a manifest without
a valid MAC under the key derived from the deployment secret included), when a block hash does not
re-derive from its token ids, parent and scope, or when a recomputed sample block differs beyond the
storage codec's tolerance. The sample is drawn from the instance's own randomness
(:class:`random.SystemRandom` unless a test injects a generator), never from the files. Blocks of an
adapter this instance does not serve, or serves with other weights, are dropped (one log line, reason
``adapter``); the rest is restored.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from pathlib import Path
from typing import Callable, TypeVar

from warmup_tools.common.digests import tokenizer_fingerprint
from warmup_tools.common.names import replica_name
from warmup_tools.kv.arrays import dtype_name
from warmup_tools.kv.blocks import BlockSource, CachedBlock
from warmup_tools.kv.config import KVShape
from warmup_tools.kv.hashing import NONE_HASH, CacheScope
from warmup_tools.kv.snapshot_files import snapshot_name
from warmup_tools.kv.snapshot_verify import (
    Snapshot,
    SnapshotIdentity,
    SnapshotRejected,
    kv_close,
    list_snapshots,
    read_snapshot,
    rederive_hashes,
    salt_fingerprint,
    verification_sample,
)
from warmup_tools.lora_adapter.engine_api import SnapshotEngine
from warmup_tools.lora_adapter.settings import SnapshotConfig

LOGGER = logging.getLogger(__name__)
T = TypeVar("T")

#: Room for the safetensors header beyond ``snapshot_bytes`` when reading a payload.
_HEADER_SLACK = 4 << 20


@dataclasses.dataclass(slots=True)
class RestoreReport:
    """What :meth:`SnapshotRestorer.restore` did."""

    snapshots_used: int = 0
    blocks: int = 0
    bytes: int = 0
    #: Blocks recomputed and found equal.
    verified: int = 0
    #: Checked blocks not placed: cached already (another snapshot had them), or over a budget.
    not_placed: int = 0
    #: Snapshots (or, for ``adapter``, snapshots with dropped blocks) by reason.
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0


class SnapshotRestorer:
    """Restores an instance's prefix cache from a snapshot folder, checking every snapshot first."""

    def __init__(self, engine: SnapshotEngine, config: SnapshotConfig, *, instance: str, plan_id: str | None = None,
                 run_on_engine: Callable[[Callable[[], T]], T] | None = None,
                 log: Callable[[str], None] | None = None, host: str | None = None, mac_key: bytes = b"",
                 rng: random.Random | None = None) -> None:
        if engine.prefix_cache is None or config.folder is None:
            raise ValueError("a snapshot keeper needs a KV prefix cache and a snapshot folder")
        self.engine = engine
        self.cache = engine.prefix_cache
        self.config = config
        self.folder = Path(config.folder)
        self.plan_id = plan_id
        self.name = snapshot_name(instance, replica_name(host))
        self.identity = engine_identity(engine)
        self._run = run_on_engine or (lambda fn: fn())
        self._log = log or LOGGER.warning
        #: Trust mode: the key manifests are signed and checked with (derived from the deployment secret).
        self._mac_key = mac_key
        self._rng = rng or random.SystemRandom()

    # ----------------------------------------------------------------------------------- restore
    def restore(self) -> RestoreReport:
        """Restore every matching snapshot's blocks into the prefix cache (see the module docstring)."""
        start = time.perf_counter()
        report = RestoreReport()
        if self.plan_id is not None and self.cache.active_plan != self.plan_id:
            self.cache.activate_plan(self.plan_id)
        paths = list_snapshots(self.folder)
        paths.sort(key=lambda p: p.name != f"{self.name}.manifest.json")  # our own first, then newest first
        for path in paths:
            try:
                snapshot = read_snapshot(path, self.identity, mac_key=self._mac_key, arrays=self.cache.arrays,
                                         max_payload_bytes=self.config.max_bytes + _HEADER_SLACK)
                blocks = self._checked_blocks(snapshot, report, path)
            except SnapshotRejected as rejected:
                self._skip(report, path, rejected.reason, rejected.detail)
                continue
            except Exception as exc:  # noqa: BLE001 - an untrusted file never fails the load
                self._skip(report, path, "error", f"{type(exc).__name__}: {exc}")
                continue
            if blocks:
                report.snapshots_used += 1
                self._place(blocks, report)
        report.seconds = time.perf_counter() - start
        LOGGER.info("KV snapshots: %d block(s), %d bytes restored from %d snapshot(s) in %.2f s (%d verified)",
                    report.blocks, report.bytes, report.snapshots_used, report.seconds, report.verified)
        return report

    def _checked_blocks(self, snapshot: Snapshot, report: RestoreReport, path: Path) -> list[CachedBlock]:
        """The snapshot's blocks that may be served here, after the hash and recompute checks."""
        engine = self.engine

        def scope_for(owner: str, tenant: str) -> CacheScope | None:
            if owner and (owner not in engine.adapter_fingerprints
                          or snapshot.adapters.get(owner) != engine.adapter_fingerprints[owner]):
                return None
            return engine.scope(owner or None, tenant)

        blocks, no_scope, mismatched = rederive_hashes(snapshot.blocks, scope_for)
        if mismatched:
            raise SnapshotRejected("hash", f"{mismatched} block hash(es) do not re-derive from their token ids")
        by_hash = {b.block_hash: b for b in blocks}
        report.verified += self._verify(blocks, by_hash)
        if no_scope:  # after the verification, so a rejected snapshot gets one line, not two
            self._skip(report, path, "adapter", f"{no_scope} block(s) of adapters this instance does not serve "
                                                "with the same weights dropped; the rest is used")
        return blocks

    def _verify(self, blocks: list[CachedBlock], by_hash: dict) -> int:
        """Recompute at least ``verify_share`` of ``blocks`` (one at least) with the engine's forward and
        their adapter; raise ``verify`` at the first block that differs beyond the codec's tolerance.

        NOTE: blocks are drawn in a random order (this instance's generator, unknown to any writer) and
        each drawn block is checked with its whole chain of ancestors, in one prefill of their token ids
        from scratch: a prefill checks every block of the chain for about the price of its tokens, where
        recomputing blocks one by one on top of the stored KV costs several times more per token (a
        16-token forward is mostly fixed cost) and would trust the stored ancestors. The share is counted
        in distinct blocks checked.
        """
        target = min(len(blocks), max(1, math.ceil(self.config.verify_share * len(blocks))))
        size, engine, arrays, checked = self.cache.block_size, self.engine, self.cache.arrays, set()
        for drawn in verification_sample(blocks, 1.0, self._rng):
            if len(checked) >= target:
                break
            if drawn.block_hash in checked:
                continue
            chain = [drawn]
            while chain[-1].parent != NONE_HASH:
                chain.append(by_hash[chain[-1].parent])
            chain.reverse()
            tokens = [int(t) for b in chain for t in b.tokens]
            kv = self._run(lambda owner=drawn.owner, ids=tokens: engine.compute_kv(owner or None, ids))
            for index, block in enumerate(chain):
                recomputed = arrays.block(kv, index, size)
                stored = self.cache.codec.decode(block.payload, engine.dtype)
                if not kv_close(stored, recomputed, self.identity.storage):
                    raise SnapshotRejected("verify", f"block {block.block_hash.hex()[:12]} recomputed with adapter "
                                                     f"{block.owner or 'base'} differs from the stored KV")
                checked.add(block.block_hash)
        return len(checked)

    def _place(self, blocks: list[CachedBlock], report: RestoreReport) -> None:
        def ours(block: CachedBlock) -> bool:
            return self.plan_id is not None and block.plan_id == self.plan_id

        device, arrays = self.engine.device, self.cache.arrays
        # The plan's blocks first (a stable sort: a plan block's ancestors are the plan's too, so parents stay
        # before children in each group).
        for block in sorted(blocks, key=lambda b: not ours(b)):
            mine = ours(block)
            payload = (arrays.to_device(block.payload, device) if not isinstance(block.payload, tuple)
                       else tuple(arrays.to_device(p, device) for p in block.payload))
            restored = dataclasses.replace(block, payload=payload,
                                           source=BlockSource.WARMUP if mine else BlockSource.LIVE,
                                           plan_id=block.plan_id if mine else None)
            if self.cache.restore(restored):
                report.blocks += 1
                report.bytes += block.nbytes
            else:
                report.not_placed += 1

    def _skip(self, report: RestoreReport, path: Path, reason: str, detail: str) -> None:
        report.skipped[reason] = report.skipped.get(reason, 0) + 1
        self._log(f"KV snapshot {path.name} skipped ({reason}): {detail}")


def engine_identity(engine: SnapshotEngine) -> SnapshotIdentity:
    """What a snapshot must match to be served by ``engine``."""
    assert engine.prefix_cache is not None
    shape = KVShape.from_model_config(engine.model_config.to_dict())
    return SnapshotIdentity(
        base_fingerprint=engine.base_fingerprint, tokenizer_fingerprint=tokenizer_fingerprint(engine.tokenizer),
        dtype=dtype_name(engine.dtype), storage=engine.prefix_cache.storage,
        block_size=engine.prefix_cache.block_size, kv_shape=(shape.layers, shape.kv_heads, shape.head_dim),
        salt_fingerprint=salt_fingerprint(engine.config.cache_salt))
