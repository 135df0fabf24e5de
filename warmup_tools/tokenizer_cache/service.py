"""Text to token ids with a tiered cache, for the ``tokenizer_cache`` model.

Local tier: bounded by bytes, its eviction policy chosen by ``eviction`` (a segmented LRU by default:
recency plus heat). Optional shared tier: Redis, so every
instance and replica sees what one tokenised or what warm-up filled. Keys hold the tenant and the
tokenizer's fingerprint: tenants never share an entry and two tokenizers never mix.
"""

from __future__ import annotations

import logging

import numpy as np

from warmup_tools.caches.redis_tier import SharedTier, checked_decoder, encode_array
from warmup_tools.caches.store import LocalCache
from warmup_tools.caches.tiered import TieredCache
from warmup_tools.common.digests import text_digest, tokenizer_fingerprint
from warmup_tools.common.errors import AssetError
from warmup_tools.common.tokenizer import load_tokenizer
from warmup_tools.tokenizer_cache.settings import TokenizerConfig
from warmup_tools.tokenizer_cache.templates import TemplateTokenizer
from warmup_tools.triton.inputs import MAX_PROMPT_TOKENS

LOGGER = logging.getLogger(__name__)


class TokenizerService:
    """Tokenises prompts with the model folder's tokenizer (no transformers where the folder allows it) behind
    a local (and optional shared) cache."""

    def __init__(self, config: TokenizerConfig, *, shared: SharedTier | None = None) -> None:
        self.config = config
        tokenizer_path = config.path
        if not tokenizer_path.exists():
            raise AssetError(
                f"tokenizer folder {tokenizer_path} does not exist; build the demo assets with "
                "`python -m warmup_tools assets` or point tokenizer_path at a model folder"
            )
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.fingerprint = tokenizer_fingerprint(self.tokenizer)
        #: Known templates (system prompts, RAG preambles): a prompt that starts with one tokenises only
        #: its remainder when that provably gives the same ids (see template_tokenizer).
        self.templates = TemplateTokenizer(self.tokenizer, max_templates=config.max_templates)
        self.local: LocalCache[tuple, np.ndarray] = LocalCache(config.cache_bytes, config.eviction, config.policy)
        self.cache: TieredCache[np.ndarray] = TieredCache(
            self.local, shared, kind="tok", fingerprint=self.fingerprint, encode=encode_array,
            decode=checked_decoder("int32", max_length=MAX_PROMPT_TOKENS))

    def encode(self, text: str, tenant: str = "default") -> tuple[np.ndarray, str]:
        """Token ids (int32, the tokenizer's own special-token convention) and where they came from:
        ``local``, ``shared`` or ``computed``."""
        return self.cache.get_or_compute(tenant, text_digest(text), lambda: self._tokenize(text))

    def register_template(self, text: str) -> bool:
        """Remember ``text`` as a template (warm-up samples do this for planned prefixes)."""
        return self.templates.add_template(text)

    def _tokenize(self, text: str) -> np.ndarray:
        ids, _ = self.templates.encode(text)
        ids = np.asarray(ids, dtype=np.int32)
        ids.setflags(write=False)
        return ids
