"""Chained block hashes: the names of KV blocks, identical in every process (vLLM's ``kv_cache_utils``).

A prompt is cut into fixed-size token blocks; each *full* block is named by ``H(parent_hash,
block_tokens, extra_keys)``, so a block's name identifies the whole prefix up to and including it.
``extra_keys`` carry the :class:`CacheScope` (base model fingerprint, adapter name and weight
fingerprint, tenant): KV computed for one tenant or adapter is never served to another, and a changed
adapter never reuses stale KV. SHA-256 over a canonical byte encoding, never Python's ``hash()``, so
the planner, the stanza writer and every instance compute the same keys across processes and restarts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import NewType, Sequence

import numpy as np

BlockHash = NewType("BlockHash", bytes)

#: The parent hash of a prompt's first block. A documented constant rather than a random value (vLLM
#: seeds its root randomly per process) because every process must agree on every key.
#: NOTE: the string names the module this lived in first; changing it would rename every block.
NONE_HASH = BlockHash(hashlib.sha256(b"warmup_tools.kv_cache.root.v1").digest())

@dataclasses.dataclass(frozen=True, slots=True)
class CacheScope:
    """Everything besides the tokens that decides whether two KV blocks are interchangeable."""

    base_fingerprint: str
    adapter: str = ""
    adapter_fingerprint: str = ""
    tenant: str = "default"

    def extra_keys(self) -> bytes:
        return json.dumps(
            ["v1", self.base_fingerprint, self.adapter, self.adapter_fingerprint, self.tenant],
            separators=(",", ":"),
        ).encode("utf-8")


def hash_block_tokens(parent: BlockHash, tokens: Sequence[int], extra_keys: bytes) -> BlockHash:
    """The chained hash of one block: ``H(parent, tokens, extra_keys)``."""
    digest = hashlib.sha256(parent)
    digest.update(np.asarray(tokens, dtype="<i8").tobytes())
    digest.update(len(extra_keys).to_bytes(4, "little"))
    digest.update(extra_keys)
    return BlockHash(digest.digest())


#: The tenant of blocks inside an operator-declared public prefix (shared by every tenant on purpose).
#: NOTE: ``*`` is not allowed in a client's tenant name, so no client can name this scope.
PUBLIC_TENANT = "*public*"


def block_hashes(tokens: Sequence[int], block_size: int, scope: CacheScope, public_blocks: int = 0) -> list[BlockHash]:
    """Hashes of every full block of ``tokens`` (a trailing partial block has none).

    The first ``public_blocks`` blocks (an operator-declared public prefix) are hashed in the scope's
    public form (tenant :data:`PUBLIC_TENANT`), so every tenant shares them; every later block is the
    tenant's own, and since hashes chain, a tenant's blocks after a public prefix still match no one else's.
    """
    extra = scope.extra_keys()
    public = dataclasses.replace(scope, tenant=PUBLIC_TENANT).extra_keys() if public_blocks else extra
    parent = NONE_HASH
    hashes: list[BlockHash] = []
    for index, start in enumerate(range(0, len(tokens) - block_size + 1, block_size)):
        keys = public if index < public_blocks else extra
        parent = hash_block_tokens(parent, tokens[start : start + block_size], keys)
        hashes.append(parent)
    return hashes
