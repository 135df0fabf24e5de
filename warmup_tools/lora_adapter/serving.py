"""What every engine serving one base model and its adapters shares around its forward.

:class:`ServingEngine` is what only depends on the tokenizer, the adapters' names and fingerprints and the prefix
cache: request checks, block hashes in a request's scope, public prefixes, ``encode``. It is mixed into each
forward (:class:`~warmup_tools.lora_adapter.hf.HfEngine`, :class:`~warmup_tools.lora_adapter.packed.PackedEngine`,
:class:`~warmup_tools.lora_adapter.simulated.SimulatedEngine`), which provides the attributes listed on the class
(the Hugging Face and packed forwards through :class:`~warmup_tools.lora_adapter.loaded.ModelFacts`, from their
loaded model).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Sequence

from warmup_tools.common.errors import UNKNOWN_ADAPTER_HINT, AssetError, InvalidInputError, UnknownAdapterError
from warmup_tools.common.tokenizer import load_tokenizer as load_folder_tokenizer
from warmup_tools.kv.arrays import KVArrays
from warmup_tools.kv.config import KVCacheConfig
from warmup_tools.kv.events import KvEventJournal
from warmup_tools.kv.hashing import BlockHash, CacheScope, block_hashes
from warmup_tools.kv.prefix_cache import PrefixCache
from warmup_tools.lora_adapter.requests import GenerateRequest
from warmup_tools.lora_adapter.settings import EngineConfig


class ServingEngine:
    """The request checks, scopes and block hashes of an engine serving one base model and its adapters."""

    config: EngineConfig
    prefix_cache: PrefixCache | None
    tokenizer: object
    vocab_size: int
    context_length: int
    base_fingerprint: str
    adapters: dict[str, Path]
    adapter_fingerprints: dict[str, str]
    #: Token ids of each declared public prefix.
    _public_ids: tuple[tuple[int, ...], ...]
    #: What the engine is, in words (the simulated one: ``modelled, profile <name>``).
    label: str = "real model"

    def check_request(self, request: GenerateRequest) -> None:
        """Raise the request's error if it cannot be served: empty, a token id outside the vocabulary, too long
        for the context, an unknown adapter. NOTE: parse_generate_request refuses the same inputs; this keeps
        every other way in (warm prompts, plans, tests) from reaching a forward that would fail on them."""
        prompt_len, max_tokens = len(request.prompt_ids), request.sampling.max_tokens
        if not prompt_len:
            raise InvalidInputError("the prompt is empty: send at least one token id")
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= self.vocab_size:
            raise InvalidInputError(f"the prompt holds a token id outside the vocabulary [0, {self.vocab_size})")
        if max_tokens < 1:
            raise InvalidInputError("max_tokens must be at least 1")
        if prompt_len + max_tokens > self.context_length:
            raise InvalidInputError(
                f"the prompt has {prompt_len} tokens and max_tokens is {max_tokens}: together they exceed "
                f"the model's context of {self.context_length} tokens; shorten the prompt or lower max_tokens"
            )
        if request.adapter is not None and request.adapter not in self.adapters:
            raise UnknownAdapterError(f"unknown adapter '{request.adapter}': {UNKNOWN_ADAPTER_HINT}")

    def block_hashes(self, request: GenerateRequest) -> tuple[list[BlockHash], int]:
        """The chained block hashes of a request's prompt in its scope, and how many leading blocks are
        public (shared by all tenants; store them with that count)."""
        assert self.prefix_cache is not None
        public = self.public_blocks(request.prompt_ids)
        return block_hashes(request.prompt_ids, self.prefix_cache.block_size,
                            self.scope(request.adapter, request.tenant), public), public

    def public_blocks(self, prompt_ids: Sequence[int]) -> int:
        """How many leading full blocks of ``prompt_ids`` lie inside a declared public prefix.

        NOTE: a prefix's last token may merge with the text after it, so only its first ``len - 1``
        tokens are compared, and only whole blocks of those are public.
        """
        if self.prefix_cache is None or not self._public_ids:
            return 0
        bs = self.prefix_cache.block_size
        best = 0
        for ids in self._public_ids:
            blocks = (len(ids) - 1) // bs
            if blocks > best and tuple(prompt_ids[: blocks * bs]) == ids[: blocks * bs]:
                best = blocks
        return best

    def scope(self, adapter: str | None, tenant: str) -> CacheScope:
        """The KV cache scope of a request: base model, adapter identity and tenant."""
        # NOTE: the salt rides in the base fingerprint, so every chained block hash carries it.
        base = f"{self.base_fingerprint}+{self.config.cache_salt}" if self.config.cache_salt else self.base_fingerprint
        return CacheScope(base, adapter or "", self.adapter_fingerprints.get(adapter or "", ""), tenant)

    def has_adapter(self, name: str) -> bool:
        return name in self.adapters

    def encode(self, text: str) -> tuple[int, ...]:
        """Token ids of ``text`` as a request would carry them (with the tokenizer's special tokens)."""
        return tuple(self.tokenizer.encode(text, add_special_tokens=True))


def load_tokenizer(config: EngineConfig) -> tuple[object, tuple[tuple[int, ...], ...]]:
    """The base model folder's tokenizer (:func:`warmup_tools.common.tokenizer.load_tokenizer`: no transformers
    where the folder allows it), and the token ids of each declared public prefix."""
    tokenizer = load_folder_tokenizer(config.base_model)
    return tokenizer, tuple(tuple(tokenizer.encode(text, add_special_tokens=True)) for text in config.public_prefixes)


def make_prefix_cache(kv: KVCacheConfig, *, bytes_per_token: int | None = None,
                      clock: Callable[[], float] = time.monotonic,
                      arrays: KVArrays | None = None) -> PrefixCache | None:
    """The instance's KV prefix cache from its settings (None when ``kv_cache_bytes`` is 0). ``clock``: the
    cache's seconds (a simulated engine's modelled time); ``arrays``: the forward's KV library (None: torch)."""
    if kv.budget_bytes <= 0:
        return None
    try:
        return PrefixCache(kv.budget_bytes, kv.block_size, live_reserve=kv.live_reserve, eviction=kv.eviction,
                           ttl_s=kv.ttl_s, storage=kv.storage, bytes_per_token=bytes_per_token, clock=clock,
                           warm_share=kv.warm_share, pin_retention_s=kv.pin_retention_s,
                           pin_refresh_on_hit=kv.pin_refresh_on_hit, pin_check_s=kv.pin_check_s,
                           events=KvEventJournal(kv.events_window_blocks) if kv.events_window_blocks else None,
                           arrays=arrays)
    except ValueError as exc:
        raise AssetError(f"KV prefix cache configuration: {exc}") from None


def eos_ids(eos: object, tokenizer: object) -> frozenset[int]:
    """The end-of-sequence token ids: the model config's ``eos_token_id`` (an id or a list of them) and the
    tokenizer's."""
    ids = {int(e) for e in eos} if isinstance(eos, (list, tuple)) else ({int(eos)} if isinstance(eos, int) else set())
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if tok_eos is not None:
        ids.add(int(tok_eos))
    return frozenset(ids)
