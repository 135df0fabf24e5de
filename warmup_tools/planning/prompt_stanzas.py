"""Warm-up samples from system prompts, one per adapter, for the three composing models.

The caller names the prompts: ``warmup_tools stanzas`` without ``--plan`` passes the demo adapters'
(:data:`warmup_tools.demo.prompts.SYSTEM_PROMPTS`); a plan's stanzas come from
:mod:`warmup_tools.planning.plan_stanzas` instead.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Mapping

import numpy as np

from warmup_tools.planning.stanzas import COMPOSING_MODELS, WarmupInput, WarmupSample, string_input, write_model_warmup


def prompt_samples(tokenizer: object, prompts: Mapping[str, str]) -> dict[str, list[WarmupSample]]:
    """Samples per model: tokenise, embed, and pre-fill each adapter's system prompt (``{adapter: prompt}``).

    The KV blocks the lora_adapter samples compute are pinned under a plan id derived from the
    prompts, so they survive live traffic until a different plan replaces them.
    """
    plan_id = "default-" + hashlib.sha256(json.dumps(sorted(prompts.items())).encode()).hexdigest()[:12]
    samples: dict[str, list[WarmupSample]] = {m: [] for m in COMPOSING_MODELS}
    for adapter, prompt in prompts.items():
        name = f"system_prompt_{adapter}"
        samples["tokenizer_cache"].append(WarmupSample(name, (string_input("text_input", prompt),)))
        samples["embedding_cache"].append(WarmupSample(name, (string_input("text_input", prompt),
                                                              string_input("warmup_plan", plan_id))))
        ids = np.asarray(tokenizer.encode(prompt, add_special_tokens=True), dtype=np.int32)
        samples["lora_adapter"].append(WarmupSample(name, (
            WarmupInput("input_ids", "TYPE_INT32", ids),
            string_input("adapter_id", adapter),
            WarmupInput("max_tokens", "TYPE_INT32", np.array([1], dtype=np.int32)),
            string_input("warmup_plan", plan_id),
        )))
    return samples


def write_prompt_stanzas(model_repository: Path, tokenizer_path: Path, prompts: Mapping[str, str]) -> list[Path]:
    """Write the samples of ``prompts`` into the repository's composing models; returns the data files."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    written: list[Path] = []
    for model, model_samples in prompt_samples(tokenizer, prompts).items():
        written += write_model_warmup(model_repository / model, model_samples)
    return written
