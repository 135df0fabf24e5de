"""Reading and checking a KV snapshot (the format is described in :mod:`warmup_tools.kv.snapshot`).

Everything read back is untrusted: sizes are bounded before reading, the payload is never unpickled,
a key the format does not name is refused (at every level), every value of every block's payload must
be finite, and :func:`read_snapshot` raises :class:`SnapshotRejected` with a short ``reason`` (the label
of the ``warmup_kv_snapshot_skipped_total`` metric) for a snapshot that does not match the reader or is
damaged. Block hashes are re-derived from the token ids (:func:`rederive_hashes`), and the caller
recomputes a sample of blocks (:func:`verification_sample`, :func:`kv_close`) before trusting any; the
sample is drawn from a generator the reader seeds itself (the system's randomness by default), never
from anything in the files, so a writer cannot steer it away from the blocks it forged.

The format's constants, the identity a snapshot must match and the digests and MAC the writer computes
(:func:`block_digest`, :func:`manifest_mac`) are here too: the writer uses the very code the reader
checks with.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import math
import random
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

import numpy as np

from warmup_tools.common.regular_file import FileTooLarge, read_regular
from warmup_tools.kv.arrays import DTYPE_BYTES, DTYPE_EPS, Array, KVArrays, arrays_for, dtype_name, kv_arrays
from warmup_tools.kv.blocks import BlockSource, CachedBlock
from warmup_tools.kv.hashing import NONE_HASH, BlockHash, CacheScope, hash_block_tokens
from warmup_tools.kv.snapshot_files import MANIFEST_SUFFIX, PAYLOAD_SUFFIX

FORMAT = "warmup-kv-snapshot"
#: 2: per-block digests bound to the block hash, unknown keys refused, the trust-mode ``mac``.
FORMAT_VERSION = 2
#: A manifest larger than this is never read, whatever the payload bound (:func:`manifest_bound`).
MAX_MANIFEST_BYTES = 64 << 20
#: The most one block's record may weigh in a manifest besides its token ids: the keys, three 64-digit hex
#: digests, a tenant, an owner and a plan id (names of at most 64 bytes), the numbers. A record the writer
#: writes weighs about 500 bytes with these (tests/unit/kv/test_snapshot_verify.py measures one).
BLOCK_RECORD_BYTES = 1024
#: The most one token id weighs in a record: up to 10 digits and a comma.
TOKEN_ID_BYTES = 11
#: The rest of a manifest: the format's fields, the identity, the payload and the adapters' fingerprints.
MANIFEST_HEAD_BYTES = 1 << 20
#: Snapshots a reader looks at, newest first (a folder shared by many replicas over time keeps growing).
MAX_SNAPSHOTS = 16
#: Payload parts per block, by ``kv_storage`` (fp: the tensor; int8: values and scales).
CODEC_PARTS = {"fp": 1, "int8": 2}

T = TypeVar("T")
#: The keys each level of a manifest may hold; any other key refuses the snapshot (reason ``unknown_key``).
MANIFEST_KEYS = frozenset({"format", "version", "name", "created", "identity", "adapters", "payload", "blocks",
                           "checksum", "mac"})
PAYLOAD_KEYS = frozenset({"file", "sha256", "bytes"})
BLOCK_KEYS = frozenset({"hash", "parent", "tokens", "tenant", "owner", "source", "plan_id", "hits", "nbytes",
                        "sha256"})


class SnapshotRejected(Exception):
    """A snapshot that must not be served; ``reason`` is a short metric label, ``detail`` says why."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclasses.dataclass(frozen=True, slots=True)
class SnapshotIdentity:
    """What decides whether a snapshot's KV is this reader's KV (adapters are checked per block)."""

    base_fingerprint: str
    tokenizer_fingerprint: str
    dtype: str
    storage: str
    block_size: int
    #: ``(layers, kv_heads, head_dim)``.
    kv_shape: tuple[int, int, int]
    #: :func:`salt_fingerprint` of the cache salt ("" without one).
    salt_fingerprint: str = ""

    def mismatch(self, other: SnapshotIdentity) -> tuple[str, str] | None:
        """``(reason, detail)`` of the first field where ``other`` (a snapshot's) differs, else None."""
        checks = (("base_model", "base_fingerprint"), ("base_model", "kv_shape"),
                  ("tokenizer", "tokenizer_fingerprint"), ("dtype", "dtype"), ("storage", "storage"),
                  ("block_size", "block_size"), ("salt", "salt_fingerprint"))
        for reason, field in checks:
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                shown = "differs" if reason == "salt" else f"{theirs!r}, this instance {mine!r}"
                return reason, f"{field} {shown}"
        return None

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["kv_shape"] = list(self.kv_shape)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SnapshotIdentity:
        shape = tuple(int(v) for v in data["kv_shape"])
        if len(shape) != 3:
            raise ValueError("kv_shape must hold 3 numbers")
        return cls(str(data["base_fingerprint"]), str(data["tokenizer_fingerprint"]), str(data["dtype"]),
                   str(data["storage"]), int(data["block_size"]), shape,  # type: ignore[arg-type]
                   str(data.get("salt_fingerprint", "")))


IDENTITY_KEYS = frozenset(field.name for field in dataclasses.fields(SnapshotIdentity))


def salt_fingerprint(salt: str) -> str:
    """A fingerprint that tells two cache salts apart without revealing either ("" for no salt)."""
    if not salt:
        return ""
    return hashlib.sha256(b"warmup-kv-snapshot-salt:" + salt.encode("utf-8")).hexdigest()[:16]


@dataclasses.dataclass(slots=True)
class Snapshot:
    """A snapshot read back and checked: blocks parents first, payloads in the storage codec's form."""

    name: str
    identity: SnapshotIdentity
    adapters: dict[str, str]
    created: float
    #: The manifest's SHA-256 (a label; never the verification sample's seed, which a writer could choose).
    checksum: str
    blocks: list[CachedBlock]


# -------------------------------------------------------------------------------------------- read
def list_snapshots(folder: Path, limit: int = MAX_SNAPSHOTS) -> list[Path]:
    """Manifests in ``folder``, newest first, at most ``limit``."""
    try:
        found = [(p.stat().st_mtime_ns, p) for p in Path(folder).glob(f"*{MANIFEST_SUFFIX}") if p.is_file()]
    except OSError:
        return []
    return [p for _, p in sorted(found, key=lambda item: (-item[0], item[1].name))][:limit]


def read_snapshot(manifest_path: Path, identity: SnapshotIdentity, *, max_payload_bytes: int,
                  mac_key: bytes = b"", arrays: KVArrays | None = None) -> Snapshot:
    """Read and check one snapshot against this reader's ``identity``; raises :class:`SnapshotRejected`.

    Checked: that the manifest and the payload are regular files (a FIFO would block the read for good), the
    manifest's size (:func:`manifest_bound`) and, with ``mac_key`` (trust mode), its MAC over the raw bytes,
    both before any parsing; its JSON, format, version, keys (none the format does not name, at any
    level) and checksum; the identity; the payload file's size
    (at most ``max_payload_bytes``), SHA-256 and safetensors header; each block's record, payload shape,
    dtype and digest (bound to its hash), and that every value of its payload is finite; that every
    parent precedes its children. ``arrays``: the library its payloads are read into (None: torch).
    """
    body = _read_manifest(Path(manifest_path), mac_key, manifest_bound(identity, max_payload_bytes))
    try:
        theirs = SnapshotIdentity.from_json(body["identity"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SnapshotRejected("format", f"identity is not readable ({exc})") from None
    mismatch = identity.mismatch(theirs)
    if mismatch is not None:
        raise SnapshotRejected(*mismatch)
    try:
        payload = body["payload"]
        payload_path = Path(manifest_path).parent / str(payload["file"])
        expected_digest, expected_size = str(payload["sha256"]), int(payload["bytes"])
        records = list(body["blocks"])
        adapters = {str(k): str(v) for k, v in dict(body.get("adapters") or {}).items()}
        name, created = str(body["name"]), float(body["created"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SnapshotRejected("format", f"manifest field missing or malformed ({exc})") from None
    if payload_path.name != str(payload["file"]) or not payload_path.name.endswith(PAYLOAD_SUFFIX):
        raise SnapshotRejected("format", "payload file name is not a plain file name")
    arrays = arrays or kv_arrays("torch")
    tensors = _read_payload(payload_path, expected_digest, expected_size, max_payload_bytes, arrays)
    blocks = _blocks(records, tensors, identity, arrays)
    return Snapshot(name, theirs, adapters, created, str(body["checksum"]), blocks)


def rederive_hashes(blocks: Sequence[CachedBlock],
                    scope_for: Callable[[str, str], CacheScope | None]) -> tuple[list[CachedBlock], int, int]:
    """The blocks whose hash is ``H(parent, tokens, scope)`` in this reader's scope, their descendants
    dropped with them; also how many were dropped because ``scope_for(owner, tenant)`` is None (an adapter
    this reader does not serve, or serves with other weights) and how many because the hash differs."""
    kept: list[CachedBlock] = []
    ok: set[BlockHash] = {NONE_HASH}
    no_scope = mismatched = 0
    for block in blocks:
        if block.parent not in ok:
            continue  # an ancestor was dropped
        scope = scope_for(block.owner, block.tenant)
        if scope is None:
            no_scope += 1
            continue
        if hash_block_tokens(block.parent, block.tokens.tolist(), scope.extra_keys()) != block.block_hash:
            mismatched += 1
            continue
        ok.add(block.block_hash)
        kept.append(block)
    return kept, no_scope, mismatched


def verification_sample(blocks: Sequence[T], share: float, rng: random.Random | None = None) -> list[T]:
    """``ceil(share * len(blocks))`` blocks (at least one), drawn with ``rng`` (default: the system's
    randomness, :class:`random.SystemRandom`).

    NOTE: the draw must not be predictable from the snapshot: seeded by anything in the files (the
    manifest's digest, say), a writer could vary an unchecked detail until the sample misses the blocks
    it forged. A reader's own randomness is fine here: the sample is not a hash, and two replicas drawing
    different samples check more of a shared snapshot between them.
    """
    if not blocks:
        return []
    count = min(len(blocks), max(1, math.ceil(share * len(blocks))))
    return (rng or random.SystemRandom()).sample(list(blocks), count)


def block_digest(block_hash: bytes, tensors: Sequence[Array]) -> str:
    """The SHA-256 of one block's payload parts (dtype, shape and bytes of each) bound to its hash; the same for
    a torch tensor and a numpy array of the same dtype, shape and values."""
    digest = hashlib.sha256(b"warmup-kv-snapshot-block:" + bytes(block_hash))
    for tensor in tensors:
        arrays = arrays_for(tensor)
        # NOTE: the dtype as torch prints it ("torch.float32") whatever the library: the digests of snapshots
        # written before payloads could be numpy arrays stay valid.
        digest.update(f"torch.{arrays.dtype_name(tensor)}".encode("ascii") + str(tuple(tensor.shape)).encode("ascii"))
        digest.update(arrays.raw_bytes(tensor))
    return digest.hexdigest()


def manifest_bound(identity: SnapshotIdentity, max_payload_bytes: int) -> int:
    """The most a manifest this reader would take may weigh: a record for each block its payload bound holds
    (:data:`BLOCK_RECORD_BYTES` and :data:`TOKEN_ID_BYTES` per token id), the head, at most
    :data:`MAX_MANIFEST_BYTES`. Checked on the file before it is parsed, so parsing is bounded too."""
    layers, heads, dim = identity.kv_shape
    values = layers * 2 * heads * identity.block_size * dim
    per_block = values * (1 if identity.storage == "int8" else DTYPE_BYTES[_dtype(identity.dtype)])
    blocks = max_payload_bytes // per_block + 1
    return min(MAX_MANIFEST_BYTES,
               MANIFEST_HEAD_BYTES + blocks * (BLOCK_RECORD_BYTES + TOKEN_ID_BYTES * identity.block_size))


#: The 64 hex digits a manifest's MAC holds while it is computed (:func:`sign_manifest`).
MAC_PLACEHOLDER = b"0" * 64
#: How a signed manifest ends: its MAC, the last member of the top-level object (:data:`_MAC_TAIL_BYTES` bytes).
_MAC_TAIL = re.compile(rb',"mac":"([0-9a-f]{64})"\}')
_MAC_TAIL_BYTES = 74


def manifest_mac(raw: bytes, key: bytes) -> str:
    """HMAC-SHA256 under ``key`` of a manifest file's bytes, its MAC's digits as :data:`MAC_PLACEHOLDER`."""
    return hmac.new(key, raw, hashlib.sha256).hexdigest()


def sign_manifest(raw: bytes, key: bytes) -> bytes:
    """A manifest (compact JSON, one object) with its MAC added as the last member: what a trust-mode writer writes.

    NOTE: over the file's bytes, not a canonical form of the parsed JSON: the reader checks it before it parses
    anything, so a writer without the key cannot make any reader spend time or memory on its JSON."""
    if not raw.endswith(b"}"):
        raise ValueError("a manifest is one JSON object")
    placeheld = raw[:-1] + b',"mac":"' + MAC_PLACEHOLDER + b'"}'
    return raw[:-1] + b',"mac":"' + manifest_mac(placeheld, key).encode() + b'"}'


def manifest_checksum(body: Mapping[str, Any]) -> str:
    """The SHA-256 of a manifest's content (every key but ``checksum`` and ``mac``), unkeyed: it catches damage,
    not a forger."""
    return hashlib.sha256(_canonical({k: v for k, v in body.items() if k != "mac"})).hexdigest()


def verify_tolerance(storage: str, dtype: object) -> float:
    """How far a recomputed block may differ from a stored one, relative to the block's largest value.

    fp: the dtype's rounding (a batched forward and a single one differ in summation order), at least
    1e-3; int8: one quantisation step of the largest channel (per-channel rounding is at most half of one).
    """
    rounding = max(1e-3, 16 * DTYPE_EPS[dtype_name(dtype)])
    return rounding + (1.0 / 127.0 if storage == "int8" else 0.0)


def kv_close(stored: Array, recomputed: Array, storage: str) -> bool:
    """Whether a decoded stored block matches its recomputation within :func:`verify_tolerance`."""
    if tuple(stored.shape) != tuple(recomputed.shape):
        return False
    ref = arrays_for(recomputed).as_float32(recomputed)
    scale = max(float(np.abs(ref).max(initial=0.0)), 1e-6)
    diff = np.abs(arrays_for(stored).as_float32(stored) - ref).max(initial=0.0)
    return float(diff) <= verify_tolerance(storage, recomputed.dtype) * scale


# ------------------------------------------------------------------------------------------ helpers
def _canonical(body: Mapping[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _unknown_keys(body: Mapping[str, Any]) -> str | None:
    """Where ``body`` holds a key the format does not name (the first place found), else None.

    NOTE: a key nobody reads must still be refused: an ignored field is room a writer can vary freely
    (it once steered the verification sample), and a reader that ignores it cannot be told apart from
    one that misreads it. The key itself is not shown: it is the file's content, not a label.
    """
    top = set(body) - MANIFEST_KEYS
    if top:
        return f"{len(top)} unknown key(s) at the top level"
    for where, section, allowed in (("identity", body.get("identity"), IDENTITY_KEYS),
                                    ("payload", body.get("payload"), PAYLOAD_KEYS)):
        if isinstance(section, dict) and set(section) - allowed:
            return f"{len(set(section) - allowed)} unknown key(s) in {where}"
    records = body.get("blocks")
    for index, record in enumerate(records if isinstance(records, list) else ()):
        if isinstance(record, dict) and set(record) - BLOCK_KEYS:
            return f"{len(set(record) - BLOCK_KEYS)} unknown key(s) in block {index}"
    return None


def _read_manifest(path: Path, mac_key: bytes, max_bytes: int) -> dict[str, Any]:
    raw = _read_file(path, max_bytes, "manifest", "format")
    if mac_key:
        _check_mac(raw, mac_key)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise SnapshotRejected("format", f"manifest is not JSON ({type(exc).__name__})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise SnapshotRejected("format", "not a KV snapshot manifest")
    if data.get("version") != FORMAT_VERSION:
        raise SnapshotRejected("version", f"format version {data.get('version')!r}, this reader {FORMAT_VERSION}")
    unknown = _unknown_keys(data)
    if unknown is not None:
        raise SnapshotRejected("unknown_key", f"{unknown}; this reader knows format version {FORMAT_VERSION} only")
    if not mac_key and data.get("mac") is not None:
        raise SnapshotRejected("mac", "the manifest carries a MAC: it was written in trust mode, and this "
                                      "instance runs open mode (no deployment secret)")
    checksum = data.pop("checksum", None)
    if checksum != manifest_checksum(data):
        raise SnapshotRejected("checksum", "the manifest's checksum does not match its content")
    data["checksum"] = checksum
    return data


def _check_mac(raw: bytes, key: bytes) -> None:
    """Refuse a manifest whose last member is not a MAC over its bytes under ``key`` (:func:`sign_manifest`)."""
    tail = _MAC_TAIL.fullmatch(raw, len(raw) - _MAC_TAIL_BYTES)  # a negative start is the first byte
    if tail is None or not hmac.compare_digest(
            tail[1], manifest_mac(raw[:tail.start(1)] + MAC_PLACEHOLDER + raw[tail.end(1):], key).encode()):
        raise SnapshotRejected("mac", "the manifest has no valid MAC under this deployment's key "
                                      "(written without the deployment secret, or changed since)")


def _read_file(path: Path, max_bytes: int, kind: str, too_large: str) -> bytes:
    """A snapshot file's bytes: a regular file (opened without blocking, never through a symbolic link) of at
    most ``max_bytes``; else :class:`SnapshotRejected` (``unreadable``, or ``too_large`` for one too big)."""
    try:
        return read_regular(path, max_bytes)[0]
    except FileTooLarge as exc:
        raise SnapshotRejected(too_large, f"{kind} of {exc.size} bytes is over the {max_bytes}-byte bound") from None
    except OSError as exc:  # NotARegularFile too: a FIFO, a device, a symbolic link
        shown = kind if kind == "manifest" else f"{kind} {path.name}"
        raise SnapshotRejected("unreadable", f"{shown}: {exc.strerror or exc}") from None


def _read_payload(path: Path, digest: str, size: int, max_bytes: int, arrays: KVArrays) -> dict[str, Array]:
    if size > max_bytes:
        raise SnapshotRejected("too_large", f"payload of {size} bytes is over the {max_bytes}-byte bound")
    data = _read_file(path, max_bytes, "payload", "too_large")
    if len(data) != size:
        raise SnapshotRejected("truncated", f"payload has {len(data)} bytes, the manifest says {size}")
    if hashlib.sha256(data).hexdigest() != digest:
        raise SnapshotRejected("checksum", f"payload {path.name} does not match its SHA-256")
    try:
        # NOTE: safetensors parses a JSON header and copies raw bytes; nothing is unpickled or executed.
        return arrays.load(data)
    except Exception as exc:  # noqa: BLE001 - any parse failure of an untrusted file is a rejection
        raise SnapshotRejected("payload", f"payload is not a readable safetensors file ({exc})") from None


def _blocks(records: list[Any], tensors: Mapping[str, Array], identity: SnapshotIdentity,
            arrays: KVArrays) -> list[CachedBlock]:
    parts = CODEC_PARTS.get(identity.storage)
    if parts is None:
        raise SnapshotRejected("storage", f"unknown kv_storage {identity.storage!r}")
    layers, heads, dim = identity.kv_shape
    shape = (layers, 2, heads, identity.block_size, dim)
    expected = {"fp": [(shape, _dtype(identity.dtype))],
                "int8": [(shape, "int8"), ((layers, 2, heads, 1, dim), "float16")]}[identity.storage]
    if len(tensors) != parts * len(records):
        raise SnapshotRejected("payload", f"{len(tensors)} tensors for {len(records)} blocks")
    seen: set[BlockHash] = {NONE_HASH}
    blocks = []
    for index, record in enumerate(records):
        try:
            block_hash, parent = BlockHash(bytes.fromhex(record["hash"])), BlockHash(bytes.fromhex(record["parent"]))
            tokens = np.asarray([int(t) for t in record["tokens"]], dtype=np.int64)
            source = BlockSource(record["source"])
            plan_id = None if record.get("plan_id") is None else str(record["plan_id"])
            tenant, owner, hits = str(record["tenant"]), str(record["owner"]), max(0, int(record.get("hits", 0)))
            payload = [tensors[f"b{index}.{part}"] for part in range(parts)]
            checksum = str(record["sha256"])
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as exc:
            raise SnapshotRejected("format", f"block {index}: record malformed ({exc})") from None
        if len(tokens) != identity.block_size or len(block_hash) != 32 or tokens.min() < 0 \
                or tokens.max() > np.iinfo(np.int32).max:
            raise SnapshotRejected("format", f"block {index}: token ids or hash malformed")
        for tensor, (want_shape, want_dtype) in zip(payload, expected):
            found = arrays.dtype_name(tensor)
            if tuple(tensor.shape) != want_shape or found != want_dtype:
                raise SnapshotRejected("payload", f"block {index}: tensor {tuple(tensor.shape)} {found}, "
                                                  f"expected {want_shape} {want_dtype}")
        if block_digest(block_hash, payload) != checksum:
            raise SnapshotRejected("checksum", f"block {index} does not match its SHA-256 (bound to its hash)")
        # NOTE: every value, not a sample: one NaN or inf in a block spreads through attention to every
        # later token of every request that reuses it, and the recompute sample may miss the block.
        if not all(np.isfinite(arrays.as_float32(t)).all() for t in payload if arrays.dtype_name(t) in DTYPE_EPS):
            raise SnapshotRejected("not_finite", f"block {index} holds NaN or infinite values")
        if parent not in seen or block_hash in seen:
            raise SnapshotRejected("format", f"block {index}: parent not written before it, or written twice")
        seen.add(block_hash)
        tokens32 = tokens.astype(np.int32)
        nbytes = sum(arrays.nbytes(t) for t in payload) + tokens32.nbytes
        # NOTE: no timestamps: PrefixCache.restore stamps a block when it places it.
        blocks.append(CachedBlock(block_hash, parent, payload[0] if parts == 1 else tuple(payload), nbytes, source,
                                  plan_id=plan_id, owner=owner, tenant=tenant, hits=hits, tokens=tokens32))
    return blocks


def _dtype(name: str) -> str:
    """``name`` if it is a dtype a snapshot's KV may be in."""
    if name not in DTYPE_EPS:
        raise SnapshotRejected("dtype", f"dtype {name!r} is not one a snapshot holds")
    return name

