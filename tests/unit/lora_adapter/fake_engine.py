"""A stand-in for the real engine (:class:`~warmup_tools.lora_adapter.hf.HfEngine`) with the members the scheduler uses
(:class:`~warmup_tools.lora_adapter.engine_api.SequenceEngine`), so scheduling tests run without a model.

Its "model" is exact arithmetic a test can check: every token's KV holds the token id, its position and the
adapter's number; the next token is a function of the whole KV it attends to (every id, every position) and
the adapter. A row that computes on the wrong KV (another sequence's, a stale prefix, a lost block) therefore
produces other tokens than the same request alone, which is what the scheduler tests compare. The prefix
cache, the block hashes and their scopes, the per-sequence state (KV, logits, generator: the real engine's
:class:`~warmup_tools.lora_adapter.runner.SequenceRunner`, inherited), the sampler and the detokenizer are the
real ones; only ``forward_batch`` is arithmetic.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from warmup_tools.common.errors import InvalidInputError, UnknownAdapterError
from warmup_tools.kv.hashing import CacheScope, block_hashes
from warmup_tools.kv.prefix_cache import PrefixCache
from warmup_tools.lora_adapter.runner import BatchRow, RowOutput, SequenceRunner
from warmup_tools.lora_adapter.sampling import TorchSampling

VOCAB = 97
#: The end-of-sequence token; the arithmetic reaches it now and then, so sequences end early too.
EOS = 1
LAYERS, HEADS, DIM = 2, 1, 3


class FakeTokenizer:
    """What the incremental detokenizer needs: ``decode`` (one letter per id)."""

    eos_token_id = EOS

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + int(i) % 26) for i in ids if not (skip_special_tokens and int(i) == EOS))


@dataclasses.dataclass
class FakeEngine(TorchSampling, SequenceRunner):
    """The scheduler's engine, without a model; ``forwards`` records each call's rows (adapter, tokens)."""

    budget_bytes: int = 1 << 20
    block_size: int = 4
    adapters: tuple[str, ...] = ("support", "legal", "sql")
    context_length: int = 512

    def __post_init__(self) -> None:
        super().__init__()
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.eos_token_ids = frozenset({EOS})
        self.tokenizer = FakeTokenizer()
        self.vocab_size = VOCAB
        #: KV bytes one token takes (float32 keys and values of every layer).
        self.kv_bytes_per_token = 2 * LAYERS * HEADS * DIM * 4
        self.prefix_cache = PrefixCache(self.budget_bytes, self.block_size) if self.budget_bytes else None
        self.loaded = set(self.adapters)
        self.forwards: list[list[tuple[str | None, tuple[int, ...]]]] = []

    # --------------------------------------------------------------------------- what the scheduler calls
    def check_request(self, request) -> None:
        if not request.prompt_ids:
            raise InvalidInputError("the prompt is empty: send at least one token id")
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= VOCAB:
            raise InvalidInputError(f"the prompt holds a token id outside the vocabulary [0, {VOCAB})")
        if len(request.prompt_ids) + request.sampling.max_tokens > self.context_length:
            raise InvalidInputError("the prompt and max_tokens exceed the model's context")
        if request.adapter is not None and request.adapter not in self.loaded:
            raise UnknownAdapterError(f"unknown adapter '{request.adapter}'")

    def has_adapter(self, name: str) -> bool:
        return name in self.loaded

    def load_adapter(self, name: str, folder: str | None = None) -> None:
        self.loaded.add(name)

    def unload_adapter(self, name: str) -> None:
        self.loaded.discard(name)

    def block_hashes(self, request) -> tuple[list, int]:
        scope = CacheScope("fake-base", request.adapter or "", "fake-adapter", request.tenant)
        return block_hashes(request.prompt_ids, self.prefix_cache.block_size, scope, 0), 0

    def forget_batches(self) -> None:
        pass

    def forward_batch(self, rows: Sequence[BatchRow]) -> list[RowOutput]:
        self.forwards.append([(row.adapter, tuple(row.token_ids)) for row in rows])
        return [self._row(row) for row in rows]

    # -------------------------------------------------------------------------------------- the "model"
    def _row(self, row: BatchRow) -> RowOutput:
        adapter = 0 if row.adapter is None else 1 + sorted(self.adapters).index(row.adapter)
        new = torch.tensor([[float(t), float(row.position + i), float(adapter)] for i, t in enumerate(row.token_ids)])
        new = new.reshape(1, HEADS, len(row.token_ids), DIM)
        if row.past:
            assert all(k.shape[2] == row.position for k, _ in row.past), "past KV of another length"
        kv = [(torch.cat([row.past[i][0], new], dim=2) if row.past else new.clone(),
               torch.cat([row.past[i][1], new], dim=2) if row.past else new.clone()) for i in range(LAYERS)]
        keys = kv[0][0][0, 0]  # [tokens, (id, position, adapter)]
        assert torch.equal(keys[:, 1], torch.arange(keys.shape[0], dtype=torch.float32)), "KV out of order"
        ids, positions = keys[:, 0].long(), keys[:, 1].long()
        token = int((ids * (positions + 7)).sum() + 31 * adapter) % VOCAB
        logits = torch.full((VOCAB,), -10.0)
        logits[token] = 10.0
        return RowOutput(logits, kv)
