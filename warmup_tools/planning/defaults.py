"""Default warm-up samples: each demo adapter's system prompt, for the three composing models."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Mapping

import numpy as np

from warmup_tools.demo.prompts import SYSTEM_PROMPTS
from warmup_tools.planning.stanzas import COMPOSING_MODELS, WarmupInput, WarmupSample, string_input, write_model_warmup


def default_samples(tokenizer: object, prompts: Mapping[str, str] = SYSTEM_PROMPTS) -> dict[str, list[WarmupSample]]:
    """Samples per model: tokenise, embed, and pre-fill each adapter's system prompt.

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


def write_default_stanzas(model_repository: Path, tokenizer_path: Path) -> list[Path]:
    """Write the default samples into the repository's composing models; returns the data files."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    written: list[Path] = []
    for model, model_samples in default_samples(tokenizer).items():
        written += write_model_warmup(model_repository / model, model_samples)
    return written
