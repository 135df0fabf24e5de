"""What the continuous-batching scheduler and its engines agree on, without torch.

The scheduler (:mod:`warmup_tools.lora_adapter.scheduler`) handles token ids, counts and block hashes only;
an engine (:class:`SequenceEngine`) owns everything else of a sequence: its KV, the logits of its last
forward, its random generator, and the sampling that turns those logits into a token. Each sequence is
named by the scheduler's ``seq_id``. Three forwards implement it, none built on another: the packed default
(:class:`~warmup_tools.lora_adapter.packed.PackedEngine`), the Hugging Face reference
(:class:`~warmup_tools.lora_adapter.hf.HfEngine`), both over one
:class:`~warmup_tools.lora_adapter.loaded.LoadedModel`, and the simulated one
(:class:`~warmup_tools.lora_adapter.simulated.SimulatedEngine`); the scheduler tests add a model-free stand-in.

The callers that need more of an engine than the scheduler name exactly what they use: :class:`SnapshotEngine`
(restoring and writing KV snapshots), :class:`ServiceEngine` (an instance's service) and :class:`TextEncoder`.

Also here: :class:`GenerationStep`, what the scheduler hands a sequence's sink for each token.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Mapping, Protocol, Sequence

from warmup_tools.kv.blocks import BlockSource, PrefixMatch
from warmup_tools.kv.hashing import BlockHash, CacheScope
from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams

if TYPE_CHECKING:
    from warmup_tools.kv.arrays import Array
    from warmup_tools.kv.prefix_cache import PrefixCache
    from warmup_tools.lora_adapter.settings import EngineConfig


@dataclasses.dataclass(frozen=True, slots=True)
class ForwardRow:
    """One sequence's share of a batched forward: its new tokens on top of the ``position`` tokens it has KV for."""

    seq_id: int
    token_ids: Sequence[int]
    position: int
    adapter: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class GenerationStep:
    """One generated token's worth of output (``text`` may be empty while a character is incomplete)."""

    text: str
    token_id: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    finished: bool
    finish_reason: str = ""
    #: Of ``cached_tokens``, those from blocks the active warm-up plan pins.
    planned_tokens: int = 0
    #: Seconds from the start of the request to this step.
    elapsed: float = 0.0


class SequenceEngine(Protocol):
    """What the scheduler uses of its engine: :class:`~warmup_tools.lora_adapter.packed.PackedEngine` (the default)
    or :class:`~warmup_tools.lora_adapter.hf.HfEngine` (``engine_forward=hf``) in serving, the simulated engine,
    and a model-free stand-in in the scheduler's unit tests (``tests/unit/lora_adapter/fake_engine.py``).

    A sequence's life, as the scheduler calls it: :meth:`open` at its first admission; then, each time it is
    admitted, :meth:`load_prefix` with its cache match, :meth:`forward` of its chunks and decode tokens,
    :meth:`store_prefix` of the prompt blocks it completed, :meth:`sample` once its tokens are all computed;
    :meth:`release` when its KV is dropped (preempted, a warm prompt giving way) and :meth:`close` when it
    leaves for good. Every method is called on the scheduler's thread (or after it stopped).
    """

    #: The instance's KV prefix cache (None: off); the scheduler matches, reserves and releases through it.
    prefix_cache: PrefixCache | None
    eos_token_ids: frozenset[int]
    #: What the incremental detokenizer decodes with (``decode(ids, skip_special_tokens=...)``).
    tokenizer: object
    #: KV bytes one token of a running sequence takes.
    kv_bytes_per_token: int
    #: Rows of different lengths share a forward at no padding cost (decode rows and prefill chunks then run
    #: as one forward; otherwise as two).
    mixed_rows: bool

    def check_request(self, request: GenerateRequest) -> None:
        """Raise the request's error if it cannot be served (empty, out of the vocabulary or context, unknown
        adapter)."""

    def has_adapter(self, name: str) -> bool: ...

    def load_adapter(self, name: str, folder: str | None = None) -> None: ...

    def unload_adapter(self, name: str) -> None: ...

    def block_hashes(self, request: GenerateRequest) -> tuple[list[BlockHash], int]:
        """The prompt's chained block hashes in the request's scope, and how many leading blocks are public."""

    def forget_batches(self) -> None:
        """Drop what the engine keeps between forwards for reuse (nothing runs)."""

    def open(self, seq_id: int, request: GenerateRequest, *, sampled: bool) -> None:
        """Start a sequence: its random generator, seeded from the request, when ``sampled`` (live requests;
        greedy ones need none) and none for a warm prompt."""

    def load_prefix(self, seq_id: int, match: PrefixMatch | None) -> None:
        """Make the matched cached blocks the sequence's KV (None or an empty match: it has none)."""

    def forward(self, rows: list[ForwardRow]) -> None:
        """One batched forward; each row's KV then covers its new tokens and the logits after its last one are
        kept for :meth:`sample`. When it raises, no row's state has changed (so each can be run again)."""

    def store_prefix(self, seq_id: int, hashes: list[BlockHash], *, start_block: int, source: BlockSource,
                     plan_id: str | None, owner: str, tenant: str, public_blocks: int,
                     tokens: Sequence[int], retention_s: float | None = None) -> None:
        """Store blocks ``start_block`` to ``len(hashes)`` of the sequence's KV in the prefix cache (``retention_s``:
        how long the blocks ``plan_id`` pins stay pinned; None: the cache's ``pin_retention_s``)."""

    def sample(self, seq_id: int, params: SamplingParams, tokens: Sequence[int]) -> int:
        """The next token from the logits of the sequence's last forward (``tokens``: its tokens so far, for a
        repetition penalty); raises the request's error when its parameters leave nothing to sample."""

    def release(self, seq_id: int) -> None:
        """Drop the sequence's KV and logits; its random generator stays (a preempted sequence keeps its
        stream)."""

    def close(self, seq_id: int) -> None:
        """Forget the sequence (also one never opened; closing twice is harmless)."""


class TextEncoder(Protocol):
    """An engine's tokenizer as a request would use it."""

    def encode(self, text: str) -> tuple[int, ...]:
        """Token ids of ``text`` with the tokenizer's special tokens."""


class ServiceEngine(TextEncoder, Protocol):
    """What an instance's service (:class:`~warmup_tools.lora_adapter.service.LoraService`) reads of its engine; the
    rest goes through its scheduler."""

    prefix_cache: PrefixCache | None
    #: The loaded adapters' names (and folders).
    adapters: Mapping[str, object]


class SnapshotEngine(Protocol):
    """What KV snapshots use of an engine (:mod:`~warmup_tools.lora_adapter.snapshot_restore`,
    :mod:`~warmup_tools.lora_adapter.snapshots`): the identity a snapshot must match, the scope a block's hash
    re-derives in, and the forward that recomputes a block to check it."""

    config: EngineConfig
    prefix_cache: PrefixCache | None
    tokenizer: object
    #: The model's config (``to_dict()`` gives its KV shape).
    model_config: object
    base_fingerprint: str
    adapter_fingerprints: Mapping[str, str]
    #: The dtype and device of its KV (objects of its array library: :mod:`warmup_tools.kv.arrays`).
    dtype: object
    device: object

    def scope(self, adapter: str | None, tenant: str) -> CacheScope:
        """The KV cache scope of a request: base model, adapter identity and tenant."""

    def compute_kv(self, adapter: str | None, token_ids: Sequence[int]) -> list[tuple[Array, Array]]:
        """The KV of ``token_ids`` computed from scratch with ``adapter`` (no cache read or written): per layer
        ``(keys, values)``, each ``[1, kv_heads, tokens, head_dim]``."""
