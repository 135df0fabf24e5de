"""Text to token ids with a bounded cache, for the ``tokenizer_cache`` model."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np

from .caches import LRUCache
from .errors import AssetError

LOGGER = logging.getLogger(__name__)


def text_digest(text: str) -> bytes:
    """A stable digest of a prompt (the same in every process and across restarts)."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


class TokenizerService:
    """Tokenises prompts with a Hugging Face tokenizer and caches the ids by (fingerprint, digest)."""

    def __init__(self, tokenizer_path: Path, cache_bytes: int = 64 << 20) -> None:
        from transformers import AutoTokenizer  # noqa: PLC0415

        if not tokenizer_path.exists():
            raise AssetError(
                f"tokenizer folder {tokenizer_path} does not exist; build the demo assets with "
                "`python -m warmup_tools assets` or point tokenizer_path at a model folder"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.fingerprint = tokenizer_fingerprint(self.tokenizer)
        self.cache: LRUCache[tuple[str, bytes], np.ndarray] = LRUCache(cache_bytes)

    def encode(self, text: str) -> tuple[np.ndarray, bool]:
        """Token ids (int32) of ``text`` with the tokenizer's own special-token convention; and whether it was cached."""
        key = (self.fingerprint, text_digest(text))
        ids = self.cache.get(key)
        if ids is not None:
            return ids, True
        ids = np.asarray(self.tokenizer.encode(text, add_special_tokens=True), dtype=np.int32)
        ids.setflags(write=False)
        self.cache.put(key, ids)
        return ids, False


def tokenizer_fingerprint(tokenizer: object) -> str:
    """A content hash of the tokenizer's vocabulary and rules, so caches never mix two tokenizers."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    payload = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]
