"""Next-token sampling on edge parameters: what it refuses, and with which kind of error."""

from __future__ import annotations

import pytest
import torch

from warmup_tools.common.errors import InvalidInputError
from warmup_tools.lora_adapter.requests import MIN_TEMPERATURE, SamplingParams
from warmup_tools.lora_adapter.sampling import make_generator, next_token, penalize_repetition

LOGITS = torch.linspace(-8.0, 12.0, 64)  # the best token is the last


def sample(logits, **params):
    sampling = SamplingParams(**params)
    return next_token(logits, sampling, make_generator(sampling, torch.device("cpu")))


@pytest.mark.parametrize("temperature", [1e-40, 1e-38])
def test_a_temperature_that_overflows_the_scores_is_the_requests_fault(temperature):
    with pytest.raises(InvalidInputError, match="'temperature' is too small") as info:
        sample(LOGITS, temperature=temperature, seed=1)
    assert info.value.code == "INVALID_ARG"


def test_at_the_minimum_temperature_sampling_works_and_is_all_but_greedy():
    assert {sample(LOGITS, temperature=MIN_TEMPERATURE, seed=seed) for seed in range(20)} == {63}


@pytest.mark.parametrize("top_p", [1e-46, 5e-324, 1e-300, 1e-40])
def test_a_top_p_below_float32s_smallest_value_still_keeps_the_best_token(top_p):
    """Such a top_p compares as 0 in float32: the best token was dropped too, leaving nothing to sample."""
    assert sample(LOGITS, temperature=1.0, top_p=top_p, seed=5) == 63


def test_non_finite_logits_are_the_models_fault_not_the_requests():
    broken = LOGITS.clone()
    broken[3] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite logits"):
        sample(broken, temperature=1.0, seed=1)


def test_the_repetition_penalty_is_hugging_faces():
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 0.0])
    tokens = [0, 1, 1, 4, 5]
    expected = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([tokens]), logits.clone()[None])[0]
    assert torch.equal(penalize_repetition(logits, tokens, 1.5), expected)


def test_a_repetition_penalty_turns_greedy_decoding_away_from_a_token_already_seen():
    logits = torch.tensor([0.0, 5.0, 4.0, 1.0])
    assert sample(logits) == 1
    assert next_token(logits, SamplingParams(), None, [7, 1]) == 1  # no penalty: the tokens change nothing
    assert next_token(logits, SamplingParams(repetition_penalty=1.5), None, [1]) == 2
    assert next_token(logits, SamplingParams(repetition_penalty=1.5), None, [3]) == 1
    sampled = SamplingParams(temperature=0.01, seed=3, repetition_penalty=2.0)
    assert next_token(logits, sampled, make_generator(sampled, torch.device("cpu")), [1]) == 2
