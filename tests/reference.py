"""The reference the serving engine's output is checked against: plain Hugging Face and peft, one request
alone, no prefix cache, no batching, no scheduler.

As vLLM's and SGLang's tests run the same prompts through a Hugging Face runner (vLLM ``tests/conftest.py``
``HfRunner``) and compare, the tests here serve a request through the scheduler (batched rows, chunked
prefill, KV from the prefix cache, preemption) and compare its tokens and text with :meth:`HfReference.generate`.
The reference loads the model and the adapters itself, prefills the whole prompt in one forward and decodes
one token per forward on its own KV. The next token is chosen by the serving sampler
(:func:`~warmup_tools.lora_adapter.sampling.next_token`, tested on its own), so a seeded sampled request has
a reference too; what is compared is everything that computes the logits.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import NamedTuple

import torch

from warmup_tools.lora_adapter.requests import GenerateRequest
from warmup_tools.lora_adapter.sampling import make_generator, next_token


class ReferenceOutput(NamedTuple):
    tokens: list[int]
    text: str


class HfReference:
    """A causal LM and its LoRA adapters (every folder under ``adapter_root`` with an ``adapter_config.json``,
    named by the folder) on the CPU, in float32."""

    def __init__(self, model_dir: Path, adapter_root: Path | None = None) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_safetensors=True).eval()
        self.config = model.config
        folders = sorted(p for p in (adapter_root.iterdir() if adapter_root else ())
                         if (p / "adapter_config.json").exists())
        self.adapters = tuple(p.name for p in folders)
        self._peft = None
        for folder in folders:
            if self._peft is None:
                self._peft = PeftModel.from_pretrained(model, folder, adapter_name=folder.name).eval()
            else:
                self._peft.load_adapter(folder, adapter_name=folder.name)
        self._model = self._peft if self._peft is not None else model
        eos = model.config.eos_token_id
        self.eos_token_ids = {*(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []),
                              *([self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])}

    def generate(self, request: GenerateRequest) -> ReferenceOutput:
        """The request's tokens (its end-of-sequence token included, as the engine sends it) and text."""
        from transformers import DynamicCache

        params = request.sampling
        generator = make_generator(params, torch.device("cpu"))
        cache = DynamicCache(config=self.config)
        tokens: list[int] = []
        ids = list(request.prompt_ids)
        with torch.inference_mode(), self._adapter(request.adapter):
            while len(tokens) < params.max_tokens:
                out = self._model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1)
                token = next_token(out.logits[0, -1], params, generator, (*request.prompt_ids, *tokens))
                tokens.append(token)
                if token in self.eos_token_ids:
                    break
                ids = [token]
        text = self.tokenizer.decode([t for t in tokens if t not in self.eos_token_ids], skip_special_tokens=True)
        return ReferenceOutput(tokens, text)

    def _adapter(self, name: str | None) -> contextlib.AbstractContextManager:
        if name is None:
            return self._peft.disable_adapter() if self._peft is not None else contextlib.nullcontext()
        if name not in self.adapters:
            raise KeyError(f"the reference has no adapter {name!r}")
        self._peft.set_adapter(name)
        return contextlib.nullcontext()
