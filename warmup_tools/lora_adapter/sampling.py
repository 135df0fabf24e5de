"""Next-token selection from torch logits: greedy, temperature, top-k and top-p, reproducible with a seed; and
:class:`TorchSampling`, the pick of every forward whose logits are torch tensors."""

from __future__ import annotations

from typing import Sequence

import torch

from warmup_tools.common.errors import InvalidInputError
from warmup_tools.lora_adapter.requests import MIN_TEMPERATURE, SamplingParams


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


class TorchSampling:
    """The sampling of a forward whose logits are torch tensors: the generator and pick of
    :class:`~warmup_tools.lora_adapter.runner.SamplingState` (mixed in before it)."""

    device: torch.device

    def _new_generator(self, params: SamplingParams) -> torch.Generator | None:
        return make_generator(params, self.device)

    def _pick(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
              tokens: Sequence[int]) -> int:
        return next_token(logits, params, generator, tokens)
