"""KV snapshots: an instance's hot blocks on disk, so a restart or a new replica starts warm.

One snapshot per writer (its ``name``: instance and host) in a folder several instances and replicas share:

* ``<name>.<sha256[:16]>.safetensors``: the blocks' payloads as the cache stores them (the
  ``kv_storage`` codec's tensors, ``b<i>.<part>``), written with safetensors (no pickle; a header of
  names, dtypes, shapes and offsets, then raw bytes);
* ``<name>.manifest.json``: the versioned record that makes the payload usable: the writer's identity
  (base model, tokenizer, dtype, storage, block size, KV shape, a fingerprint of the cache salt, never the
  salt), each adapter's weight fingerprint, and per block its hash, parent, token ids, tenant, owner,
  source, plan, hits and the SHA-256 of its payload bytes bound to its hash (:func:`block_digest`: a
  payload moved to another block, with its digest, no longer matches); the payload file's SHA-256 and
  size; a SHA-256 over the manifest itself; and, in trust mode, an HMAC-SHA256 over the manifest under a
  key derived from the deployment secret (``mac``), which a writer of the folder without the secret
  cannot make.

Both are written atomically (temporary file, fsync, rename), payload first: a reader that sees a
manifest sees the payload it names. Older payload files of the same name are removed after the next
manifest is in place (one generation is kept, for a reader that opened the previous manifest).

Reading a snapshot back and checking it is :mod:`warmup_tools.kv.snapshot_verify`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Mapping, Sequence

from warmup_tools.common.files import write_atomic
from warmup_tools.kv.arrays import Array, KVArrays, arrays_for, kv_arrays
from warmup_tools.kv.blocks import CachedBlock
from warmup_tools.kv.hashing import NONE_HASH, BlockHash
from warmup_tools.kv.snapshot_files import MANIFEST_SUFFIX, PAYLOAD_SUFFIX, payload_file
from warmup_tools.kv.snapshot_verify import (
    CODEC_PARTS,
    FORMAT,
    FORMAT_VERSION,
    SnapshotIdentity,
    block_digest,
    manifest_checksum,
    sign_manifest,
)


@dataclasses.dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """What :func:`write_snapshot` wrote."""

    manifest: Path
    payload: Path
    blocks: int
    payload_bytes: int


# ------------------------------------------------------------------------------------------- write
def write_snapshot(folder: Path, name: str, identity: SnapshotIdentity, adapters: Mapping[str, str],
                   blocks: Sequence[CachedBlock], *, created: float, mac_key: bytes = b"",
                   arrays: KVArrays | None = None) -> SnapshotInfo:
    """Write ``blocks`` (parents before children, each with its token ids) as the snapshot ``name``.

    ``mac_key`` (trust mode: a key derived from the deployment secret; empty in open mode) signs the
    manifest; a reader with the same key refuses a manifest without that MAC. ``arrays``: the payloads' library
    (:mod:`warmup_tools.kv.arrays`; None: the first payload's)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    parts = CODEC_PARTS[identity.storage]
    tensors: dict[str, Array] = {}
    records = []
    for index, block in enumerate(blocks):
        if block.tokens is None or len(block.tokens) != identity.block_size:
            raise ValueError(f"block {block.block_hash.hex()[:12]} has no token ids; it cannot be snapshotted")
        payload = _payload_parts(block.payload, parts)
        if arrays is None:
            try:
                arrays = arrays_for(payload[0])
            except TypeError as exc:
                raise ValueError(str(exc)) from None
        for part, tensor in enumerate(payload):
            if not arrays.is_array(tensor):
                raise ValueError(f"a block payload holds a {type(tensor).__name__}, not a {arrays.name} array")
            tensors[f"b{index}.{part}"] = arrays.to_host(tensor)
        records.append({
            "hash": block.block_hash.hex(), "parent": block.parent.hex(),
            "tokens": [int(t) for t in block.tokens], "tenant": block.tenant, "owner": block.owner,
            "source": block.source.value, "plan_id": block.plan_id, "hits": int(block.hits),
            "nbytes": int(block.nbytes),
            "sha256": block_digest(block.block_hash, [tensors[f"b{index}.{p}"] for p in range(parts)]),
        })
    data = (arrays or kv_arrays("numpy")).save(tensors, metadata={"format": FORMAT, "version": str(FORMAT_VERSION)})
    digest = hashlib.sha256(data).hexdigest()
    payload_path = folder / payload_file(name, digest)
    # NOTE: 0600 like the request log: the manifest's token ids decode back to the tenants' prompts, and
    # the payload is their KV.
    write_atomic(payload_path, data, mode=0o600)
    body = {
        "format": FORMAT, "version": FORMAT_VERSION, "name": name, "created": float(created),
        "identity": identity.to_json(), "adapters": dict(sorted(adapters.items())),
        "payload": {"file": payload_path.name, "sha256": digest, "bytes": len(data)},
        "blocks": records,
    }
    manifest = folder / f"{name}{MANIFEST_SUFFIX}"
    raw = json.dumps({**body, "checksum": manifest_checksum(body)}, separators=(",", ":")).encode("ascii")
    write_atomic(manifest, sign_manifest(raw, mac_key) if mac_key else raw, mode=0o600)
    _prune_payloads(folder, name, keep=payload_path)
    return SnapshotInfo(manifest, payload_path, len(records), len(data))


def prefix_tokens(block: CachedBlock, by_hash: Mapping[BlockHash, CachedBlock]) -> list[int]:
    """The token ids from the root to the end of ``block`` (its ancestors must be in ``by_hash``)."""
    chain = [block]
    while chain[-1].parent != NONE_HASH:
        chain.append(by_hash[chain[-1].parent])
    return [int(t) for b in reversed(chain) for t in b.tokens]


# ------------------------------------------------------------------------------------------ helpers
def _payload_parts(payload: object, parts: int) -> list[Array]:
    tensors = list(payload) if isinstance(payload, (tuple, list)) else [payload]
    if len(tensors) != parts:
        raise ValueError(f"a block payload of {len(tensors)} part(s) does not fit a {parts}-part codec")
    return tensors


def _prune_payloads(folder: Path, name: str, keep: Path) -> None:
    """Remove this writer's payload files but ``keep`` and the newest other one (a reader may hold the
    previous manifest)."""
    mine = [p for p in folder.glob(f"{name}.*{PAYLOAD_SUFFIX}")
            if p != keep and p.name[len(name) + 1:-len(PAYLOAD_SUFFIX)].isalnum()]
    with contextlib.suppress(OSError):
        mine.sort(key=lambda p: p.stat().st_mtime_ns, reverse=True)
    for stale in mine[1:]:
        with contextlib.suppress(OSError):
            os.unlink(stale)
