"""Next-token selection: greedy, temperature, top-k and top-p, reproducible with a seed; and
:class:`SamplingState`, each open sequence's generator and last logits, which every forward keeps the same way."""

from __future__ import annotations

import abc
from typing import Iterable, Sequence

import torch

from warmup_tools.common.errors import InvalidInputError
from warmup_tools.lora_adapter.requests import MIN_TEMPERATURE, GenerateRequest, SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A generator seeded from the request, or None for greedy decoding (which needs no randomness)."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    # NOTE: torch seeds are signed 64-bit; fold the UINT64 request seed into that range.
    generator.manual_seed(params.seed & 0x7FFF_FFFF_FFFF_FFFF)
    return generator


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
               tokens: Sequence[int] = ()) -> int:
    """Pick the next token id from the last position's logits (shape ``[vocab]``); ``tokens`` are the sequence's
    tokens so far, its prompt then its output (what a penalty on repeated tokens reads, as vLLM's sampler reads
    a request's prompt and output token ids).

    Raises :class:`InvalidInputError` when the sampling parameters leave no valid distribution (a
    temperature so small that the scaled scores overflow), and ``FloatingPointError`` when the model's own
    logits are not finite (a fault of the model, not of the request).
    """
    if params.repetition_penalty != 1.0 and tokens:
        logits = penalize_repetition(logits, tokens, params.repetition_penalty)
    if params.greedy or generator is None:
        return int(torch.argmax(logits).item())
    scores = logits.float() / params.temperature
    if 0 < params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)
        # Keep the smallest set whose mass reaches top_p (always at least the best token).
        drop = cumulative - torch.softmax(sorted_scores, dim=-1) >= params.top_p
        # NOTE: explicitly, because a top_p below float32's smallest value (1e-46) compares as 0 and would
        # drop the best token too, leaving nothing to sample.
        drop[0] = False
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    if not bool(torch.isfinite(probs).all()):
        # Checked only here, so a valid step pays for one check of the probabilities and no more.
        if not bool(torch.isfinite(logits).all()):
            raise FloatingPointError("the model produced non-finite logits")
        raise InvalidInputError(f"input 'temperature' is too small for this model's scores: use 0 (greedy) or at "
                                f"least {MIN_TEMPERATURE:.2g}")
    return int(torch.multinomial(probs, 1, generator=generator).item())


def penalize_repetition(logits: torch.Tensor, tokens: Sequence[int], penalty: float) -> torch.Tensor:
    """``logits`` with each token of ``tokens`` penalised: a positive logit divided by ``penalty``, a negative one
    multiplied by it (Hugging Face's ``RepetitionPenaltyLogitsProcessor``, vLLM's ``repetition_penalty``)."""
    scores = logits.float().clone()
    seen = torch.unique(torch.as_tensor(tokens, dtype=torch.long, device=scores.device))
    seen = seen[(seen >= 0) & (seen < scores.numel())]
    picked = scores[seen]
    scores[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return scores


class SamplingState(abc.ABC):
    """The sampling half of :class:`~warmup_tools.lora_adapter.engine_api.SequenceEngine`: each open sequence's
    random generator and the logits of its last forward, per the scheduler's ``seq_id``; :meth:`open`,
    :meth:`sample`, :meth:`close`.

    A forward keeps each sequence's KV beside this (:class:`~warmup_tools.lora_adapter.runner.SequenceRunner`, the
    packed engine's pool slots): it stores the logits after a sequence's last new token in ``_logits``, provides
    ``device``, extends :meth:`release` to drop the KV, and says which sequences hold KV
    (:meth:`_sequences_with_kv`).
    """

    device: torch.device

    def __init__(self) -> None:
        self._logits: dict[int, torch.Tensor] = {}
        #: Every open sequence has an entry (None: greedy, or a warm prompt).
        self._generators: dict[int, torch.Generator | None] = {}

    def open(self, seq_id: int, request: GenerateRequest, *, sampled: bool) -> None:
        self.release(seq_id)
        self._generators[seq_id] = make_generator(request.sampling, self.device) if sampled else None

    def sample(self, seq_id: int, params: SamplingParams, tokens: Sequence[int]) -> int:
        # The logits are consumed: the next forward of this sequence gives the next ones.
        logits = self._logits.pop(seq_id)
        return next_token(logits, params, self._generators.get(seq_id), tokens)

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
