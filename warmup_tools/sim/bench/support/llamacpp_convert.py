"""Runs one of llama.cpp's conversion scripts (``convert_hf_to_gguf.py``, ``convert_lora_to_gguf.py``) with one
addition: a BPE tokenizer whose pre-tokenizer is exactly GPT-2's gets the pre-tokenizer name ``gpt-2``.

llama.cpp names a BPE pre-tokenizer by the hash of a test string's token ids, and knows only the tokenizers of
published models (``convert_hf_to_gguf_update.py`` downloads them to compute their hashes); any other tokenizer is
refused. A tokenizer whose ``tokenizer.json`` has no normalizer and a ``ByteLevel`` pre-tokenizer with GPT-2's
regex and no prefix space (the demo LM's, made by :mod:`warmup_tools.demo.assets`) splits text exactly as llama.cpp's
``gpt-2`` pre-tokenizer does, so that name is written for it; any other unknown tokenizer is still refused.

Run by the converters' own Python (a virtualenv with torch, transformers and llama.cpp's ``gguf-py``), never the
project's, as ``python llamacpp_convert.py LLAMA_CPP_SOURCE SCRIPT ARGS...``; it imports only the standard library
and llama.cpp's own modules."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

#: llama.cpp's pre-tokenizer name for each ``tokenizer.json`` pre-tokenizer it matches exactly.
GPT2_PRE_TOKENIZER = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
SCRIPTS = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py")


def pre_tokenizer_name(model_dir: Path) -> str | None:
    """``gpt-2`` when ``model_dir``'s ``tokenizer.json`` is a BPE with no normalizer and GPT-2's byte-level
    pre-tokenizer; None otherwise (an unknown tokenizer stays unknown)."""
    try:
        spec = json.loads((Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    pre = spec.get("pre_tokenizer") or {}
    if ((spec.get("model") or {}).get("type") == "BPE" and spec.get("normalizer") is None
            and {k: pre.get(k) for k in GPT2_PRE_TOKENIZER} == GPT2_PRE_TOKENIZER):
        return "gpt-2"
    return None


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] not in SCRIPTS:
        raise SystemExit(f"usage: llamacpp_convert.py LLAMA_CPP_SOURCE {{{'|'.join(SCRIPTS)}}} ARGS...")
    source, script = Path(argv[0]).resolve(), argv[1]
    sys.path[:0] = [str(source), str(source / "gguf-py")]
    from conversion import base  # llama.cpp's converter package (its source tree)

    known = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            name = pre_tokenizer_name(self.dir_model)
            if name is None:
                raise
            base.logger.info(f"tokenizer.ggml.pre: {name!r} (tokenizer.json's pre-tokenizer is GPT-2's)")
            return name

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(source / script), *argv[2:]]
    runpy.run_path(str(source / script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
