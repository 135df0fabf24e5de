"""One request inside ``lora_adapter``'s scheduler (:class:`Sequence`), where its output goes
(:class:`SequenceSink`) and which class of work it is (:class:`SequenceClass`): what the scheduler and its
admission order (:mod:`~warmup_tools.lora_adapter.admission`) both handle. No torch."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
from typing import Protocol

from warmup_tools.kv.blocks import PrefixMatch
from warmup_tools.kv.hashing import BlockHash
from warmup_tools.lora_adapter.detokenize import IncrementalDetokenizer
from warmup_tools.lora_adapter.engine_api import GenerationStep
from warmup_tools.lora_adapter.requests import GenerateRequest


class SequenceSink(Protocol):
    """Where one request's output goes (model.py: its response sender)."""

    def send(self, step: GenerationStep) -> None:
        """Deliver one generated token; raising means the client is gone (the sequence is dropped)."""

    def fail(self, error: BaseException) -> None:
        """Deliver the error that ends this request (best effort)."""

    def is_cancelled(self) -> bool:
        """True once the client cancelled the request."""


class SequenceClass(str, enum.Enum):
    """LIVE: a client's request. WARM: an adapter warm prompt, scheduled in the budget live ones leave."""

    LIVE = "live"
    WARM = "warm"


@dataclasses.dataclass(slots=True)
class Sequence:
    """One request inside the scheduler: its tokens, how many have KV (the engine holds it) and its place in
    the batch."""

    seq_id: int
    request: GenerateRequest
    sink: SequenceSink | None
    klass: SequenceClass
    #: Prompt then generated tokens; ``num_computed`` of them have KV.
    tokens: list[int]
    hashes: list[BlockHash]
    #: Prompt blocks a cache match may cover (all but the last token, as in vLLM).
    usable_blocks: int
    #: Leading blocks inside a declared public prefix (stored in the shared scope).
    public_blocks: int
    start: float
    detok: IncrementalDetokenizer | None
    done: concurrent.futures.Future | None = None
    #: Tokens the engine holds KV for.
    num_computed: int = 0
    #: Prompt tokens served from the cache at first admission (-1: not yet admitted).
    cached_tokens: int = -1
    #: Of those, the tokens from blocks the active warm-up plan pins.
    planned_tokens: int = 0
    output_tokens: int = 0
    match: PrefixMatch | None = None
    stored_blocks: int = 0
    reserved_bytes: int = 0
    #: The uncached block this sequence computes for everyone (single flight), until its prompt is done.
    flight_key: BlockHash | None = None
    steps: int = 0
    #: When its client's cancellation was last asked for (the scheduler's clock).
    cancel_checked: float = float("-inf")
    #: Counted in its tenant's held requests (live sequences, from submit until they end).
    counted: bool = False

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.num_computed
