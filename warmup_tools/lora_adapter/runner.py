"""Each sequence's KV as its own arrays, over an engine's batched forward; without torch.

:class:`SamplingState` is the sampling half of :class:`~warmup_tools.lora_adapter.engine_api.SequenceEngine`:
each open sequence's generator and last logits. :class:`SequenceRunner` adds the per-sequence KV for every engine
that has a ``forward_batch(rows: list[BatchRow]) -> list[RowOutput]``
(:class:`~warmup_tools.lora_adapter.hf.HfEngine`, :class:`~warmup_tools.lora_adapter.simulated.SimulatedEngine` and
the scheduler tests' stand-in inherit it): each sequence's KV (per layer keys and values, in the forward's array
library) keyed by the scheduler's ``seq_id``.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from warmup_tools.kv.arrays import Array
from warmup_tools.kv.blocks import BlockSource, PrefixMatch
from warmup_tools.kv.hashing import BlockHash
from warmup_tools.lora_adapter.engine_api import ForwardRow
from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams

if TYPE_CHECKING:
    from warmup_tools.kv.prefix_cache import PrefixCache

#: Per layer ``(keys, values)``, each ``[1, kv_heads, tokens, head_dim]``: one sequence's KV.
SequenceKV = list[tuple[Array, Array]]


@dataclasses.dataclass(frozen=True, slots=True)
class BatchRow:
    """One sequence's share of a batched forward: its new tokens on top of its KV so far."""

    token_ids: Sequence[int]
    #: Tokens already computed for this sequence (the length of ``past``).
    position: int
    past: SequenceKV | None
    adapter: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class RowOutput:
    """The logits after a row's last new token, and the row's KV including its new tokens."""

    #: What the engine's :meth:`SamplingState._pick` reads (a torch forward's: the vocabulary's logits).
    logits: Any
    kv: SequenceKV


class SamplingState(abc.ABC):
    """The sampling half of :class:`~warmup_tools.lora_adapter.engine_api.SequenceEngine`: each open sequence's
    random generator and the logits of its last forward, per the scheduler's ``seq_id``; :meth:`open`,
    :meth:`sample`, :meth:`close`.

    A forward keeps each sequence's KV beside this (:class:`SequenceRunner`, the packed engine's pool slots): it
    stores the logits after a sequence's last new token in ``_logits``, extends :meth:`release` to drop the KV,
    says which sequences hold KV (:meth:`_sequences_with_kv`) and how logits become a token
    (:meth:`_new_generator`, :meth:`_pick`: :class:`~warmup_tools.lora_adapter.sampling.TorchSampling` for torch
    logits).
    """

    def __init__(self) -> None:
        self._logits: dict[int, Any] = {}
        #: Every open sequence has an entry (None: greedy, or a warm prompt).
        self._generators: dict[int, Any] = {}

    def open(self, seq_id: int, request: GenerateRequest, *, sampled: bool) -> None:
        self.release(seq_id)
        self._generators[seq_id] = self._new_generator(request.sampling) if sampled else None

    def sample(self, seq_id: int, params: SamplingParams, tokens: Sequence[int]) -> int:
        # The logits are consumed: the next forward of this sequence gives the next ones.
        logits = self._logits.pop(seq_id)
        return self._pick(logits, params, self._generators.get(seq_id), tokens)

    def release(self, seq_id: int) -> None:
        self._logits.pop(seq_id, None)

    def close(self, seq_id: int) -> None:
        self.release(seq_id)
        self._generators.pop(seq_id, None)

    def held_sequences(self) -> int:
        """How many sequences have any state here (tests: 0 once every request ended)."""
        return len(self._logits.keys() | self._generators.keys() | set(self._sequences_with_kv()))

    @abc.abstractmethod
    def _sequences_with_kv(self) -> Iterable[int]:
        """The sequences that hold KV here."""

    @abc.abstractmethod
    def _new_generator(self, params: SamplingParams) -> Any:
        """A new sequence's random generator, seeded from ``params`` (None: greedy needs none)."""

    @abc.abstractmethod
    def _pick(self, logits: Any, params: SamplingParams, generator: Any, tokens: Sequence[int]) -> int:
        """The next token from a sequence's last logits (raises the request's error, as
        :meth:`~warmup_tools.lora_adapter.engine_api.SequenceEngine.sample` says)."""


class SequenceRunner(SamplingState):
    """Each sequence's KV over a batched ``forward_batch``, beside its generator and last logits.

    A subclass provides ``forward_batch``, ``prefix_cache``, ``dtype`` (what cached blocks are loaded as) and the
    pick of :class:`SamplingState`, and calls ``SequenceRunner.__init__``.
    """

    prefix_cache: PrefixCache | None
    dtype: object
    #: A ``forward_batch`` pads its rows to the longest (:attr:`SequenceEngine.mixed_rows`).
    mixed_rows = False

    def __init__(self) -> None:
        super().__init__()
        self._kv: dict[int, SequenceKV] = {}

    @abc.abstractmethod
    def forward_batch(self, rows: Sequence[BatchRow]) -> list[RowOutput]:
        """Each row's logits after its last new token and its KV including its new tokens."""

    def load_prefix(self, seq_id: int, match: PrefixMatch | None) -> None:
        self._logits.pop(seq_id, None)
        if match is not None and match.num_tokens:
            self._kv[seq_id] = self.prefix_cache.load(match, self.dtype)
        else:
            self._kv.pop(seq_id, None)

    def forward(self, rows: list[ForwardRow]) -> None:
        # NOTE: the stored KV object goes back as ``past`` as it is: HfEngine reuses a recent batch's cache
        # when each row's past *is* the KV that batch returned (steady decoding grows it by one column).
        outputs = self.forward_batch([BatchRow(row.token_ids, row.position, self._kv.get(row.seq_id), row.adapter)
                                      for row in rows])
        # Committed only once the whole forward returned: a forward that raises leaves every row as it was.
        for row, out in zip(rows, outputs, strict=True):
            self._kv[row.seq_id] = out.kv
            self._logits[row.seq_id] = out.logits

    def store_prefix(self, seq_id: int, hashes: list[BlockHash], *, start_block: int, source: BlockSource,
                     plan_id: str | None, owner: str, tenant: str, public_blocks: int,
                     tokens: Sequence[int], retention_s: float | None = None) -> None:
        self.prefix_cache.store(hashes, self._kv[seq_id], start_block=start_block, source=source, plan_id=plan_id,
                                owner=owner, tenant=tenant, public_blocks=public_blocks, tokens=tokens,
                                retention_s=retention_s)

    def release(self, seq_id: int) -> None:
        self._kv.pop(seq_id, None)
        super().release(seq_id)

    def _sequences_with_kv(self) -> Iterable[int]:
        return self._kv.keys()
