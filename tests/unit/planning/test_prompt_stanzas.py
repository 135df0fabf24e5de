"""Warm-up samples from system prompts: what ``warmup_tools stanzas`` writes without ``--plan``."""

from pathlib import Path

from warmup_tools.planning.prompt_stanzas import prompt_samples
from warmup_tools.planning.stanzas import COMPOSING_MODELS, render_block

REPO = Path(__file__).resolve().parents[3] / "model_repository"


class _Tokenizer:
    def encode(self, text, add_special_tokens=True):
        return [1] + [ord(c) for c in text] if add_special_tokens else [ord(c) for c in text]


def _plan_id(sample):
    return next(bytes(t.array[0]).decode() for t in sample.inputs if t.name == "warmup_plan")


def test_one_sample_per_prompt_and_model_pinned_under_a_plan_id_of_the_prompts():
    prompts = {"claims": "You are a claims assistant.\n\n", "": "You are helpful.\n\n"}
    samples = prompt_samples(_Tokenizer(), prompts)
    assert set(samples) == set(COMPOSING_MODELS)
    assert [s.name for s in samples["lora_adapter"]] == ["system_prompt_claims", "system_prompt_"]
    ids = samples["lora_adapter"][0].inputs[0]
    assert ids.name == "input_ids" and list(ids.array) == _Tokenizer().encode(prompts["claims"])
    plan_ids = {_plan_id(s) for s in samples["lora_adapter"] + samples["embedding_cache"]}
    assert len(plan_ids) == 1
    other = prompt_samples(_Tokenizer(), {"claims": "You are a claims assistant.\n\n"})
    assert _plan_id(other["lora_adapter"][0]) != plan_ids.pop()


def test_the_committed_repository_holds_the_demo_prompts_stanzas(demo_assets):
    """The CLI passes the demo's prompts; the repository in git is what `stanzas` wrote from them."""
    from transformers import AutoTokenizer

    from warmup_tools.demo.prompts import SYSTEM_PROMPTS

    samples = prompt_samples(AutoTokenizer.from_pretrained(demo_assets.lm_dir), SYSTEM_PROMPTS)
    for model in COMPOSING_MODELS:
        assert render_block(samples[model]) in (REPO / model / "config.pbtxt").read_text(), model
