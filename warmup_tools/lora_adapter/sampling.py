"""Next-token selection: greedy, temperature, top-k and top-p, reproducible with a seed."""

from __future__ import annotations

import torch

from warmup_tools.lora_adapter.requests import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A generator seeded from the request, or None for greedy decoding (which needs no randomness)."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    # NOTE: torch seeds are signed 64-bit; fold the UINT64 request seed into that range.
    generator.manual_seed(params.seed & 0x7FFF_FFFF_FFFF_FFFF)
    return generator


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token id from the last position's logits (shape ``[vocab]``)."""
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
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
