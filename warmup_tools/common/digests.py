"""Content fingerprints of model and adapter folders, stable across processes and restarts.

KV blocks are keyed by these fingerprints, so KV computed with one set of weights is never served
with another: replacing an adapter's weights changes its fingerprint and strands its old KV.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable

#: Files up to this size are hashed whole; larger ones (multi-GB base weights) by sampling, see below.
FULL_HASH_LIMIT = 256 << 20
_SAMPLES = 16
_SAMPLE_BYTES = 1 << 20
_WEIGHT_PATTERNS = ("*.safetensors", "*.json", "*.model", "*.txt")


def fingerprint_folder(folder: Path, patterns: Iterable[str] = _WEIGHT_PATTERNS) -> str:
    """A short hex digest of the folder's weight, config and tokenizer files."""
    digest = hashlib.sha256()
    files = sorted({p for pattern in patterns for p in Path(folder).glob(pattern) if p.is_file()})
    for path in files:
        digest.update(path.name.encode("utf-8") + b"\0")
        digest.update(fingerprint_file(path).encode("ascii"))
    return digest.hexdigest()[:24]


def fingerprint_file(path: Path) -> str:
    """SHA-256 of a file; for files over :data:`FULL_HASH_LIMIT`, of its size and sampled chunks.

    NOTE: hashing a 15 GB base model whole would add a minute to every instance start. A safetensors
    file's header (names, shapes, offsets) plus 16 evenly spaced 1 MiB samples and the size change
    with any realistic re-training or re-quantisation; adapters are small and always hashed whole.
    """
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode("ascii"))
    with open(path, "rb") as handle:
        if size <= FULL_HASH_LIMIT:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        else:
            digest.update(handle.read(_SAMPLE_BYTES))  # includes the safetensors header
            for i in range(1, _SAMPLES + 1):
                handle.seek(max(0, size * i // (_SAMPLES + 1)))
                digest.update(handle.read(_SAMPLE_BYTES))
    return digest.hexdigest()
