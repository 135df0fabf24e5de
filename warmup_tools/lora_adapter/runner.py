"""Each sequence's KV as its own tensors, over an engine's batched forward.

:class:`SequenceRunner` implements the per-sequence half of
:class:`~warmup_tools.lora_adapter.engine_api.SequenceEngine` for every engine that has a
``forward_batch(rows: list[BatchRow]) -> list[RowOutput]`` (:class:`~warmup_tools.lora_adapter.hf.HfEngine`,
:class:`~warmup_tools.lora_adapter.simulated.SimulatedEngine` and the scheduler tests' stand-in inherit it): each
sequence's KV (per layer keys and values) keyed by the scheduler's ``seq_id``, beside the generator and last logits
of :class:`~warmup_tools.lora_adapter.sampling.SamplingState`.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from warmup_tools.kv.blocks import BlockSource, PrefixMatch
from warmup_tools.kv.hashing import BlockHash
from warmup_tools.lora_adapter.engine_api import ForwardRow
from warmup_tools.lora_adapter.sampling import SamplingState

if TYPE_CHECKING:
    from warmup_tools.kv.prefix_cache import PrefixCache

#: Per layer ``(keys, values)``, each ``[1, kv_heads, tokens, head_dim]``: one sequence's KV.
SequenceKV = list[tuple[torch.Tensor, torch.Tensor]]


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

    logits: torch.Tensor
    kv: SequenceKV


class SequenceRunner(SamplingState):
    """Each sequence's KV over a batched ``forward_batch``, beside its generator and last logits.

    A subclass provides ``forward_batch``, ``prefix_cache``, ``device`` and ``dtype``, and calls
    ``SequenceRunner.__init__``.
    """

    prefix_cache: PrefixCache | None
    device: torch.device
    dtype: torch.dtype
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
