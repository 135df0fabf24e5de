"""Digests, fingerprints and derived seeds: identical in every process and across restarts.

* :func:`text_digest` names a prompt in every cache and in the request log;
* :func:`fingerprint_folder` names a model or adapter's weights: KV blocks are keyed by it, so KV
  computed with one set of weights is never served with another;
* :func:`tokenizer_fingerprint` names a tokenizer's vocabulary and rules (caches and plans never mix two);
* :func:`stable_seed` derives a labelled sub-seed (the traffic generator, the planner, the demo assets).

None of them uses Python's ``hash()`` (salted per process) or unseeded randomness.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable


def text_digest(text: str) -> bytes:
    """A stable 16-byte digest of a prompt."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def prompt_digest(text: str, key: bytes = b"") -> str:
    """The hex form of :func:`text_digest`, as the request log writes it; with ``key`` (trust mode) a keyed
    blake2b-128, so a log reader without the deployment key cannot test whether a known prompt was sent."""
    if key:
        return hashlib.blake2b(text.encode("utf-8"), key=key[:64], digest_size=16).hexdigest()
    return text_digest(text).hex()


def tokenizer_fingerprint(tokenizer: object) -> str:
    """A content hash of a Hugging Face tokenizer's vocabulary and rules."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    payload = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]


def stable_seed(*parts: object) -> int:
    """A 64-bit seed derived from labelled parts (``stable_seed(seed, "lm")``).

    NOTE: the traffic generator's original derivation, kept bit for bit: its seeded days are what the
    recorded ``bench replay`` figures were measured on.
    """
    text = "\x1f".join(str(p) for p in parts)
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")

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
