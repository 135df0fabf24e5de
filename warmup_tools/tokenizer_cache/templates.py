"""Tokenise prompts that start with a known template (system prompt, RAG preamble) without re-tokenising it.

A :class:`TemplateTokenizer` keeps the token ids of a bounded set of templates. A prompt that starts with
one is tokenised as ``cached ids of template[:q]`` + ``ids of prompt[q:]``, where ``q`` is the template's end
or the start of one of its last pre-tokens, but only when that join provably gives exactly the ids of
``tokenizer.encode(prompt, add_special_tokens=True)``; otherwise the prompt is tokenised in full.

NOTE: why the join is safe (read this before changing the checks below).

A fast tokenizer runs: (1) split the text on added tokens (leftmost-longest, raw text first); (2) per
segment, normalize, then pre-tokenize into pieces; (3) the model (BPE, WordPiece, Unigram, WordLevel)
turns each piece into ids independently: BPE never merges across pieces; (4) the post-processor wraps
the ids in prefix/suffix special tokens. So the ids of ``text = head + rest`` (``head = template[:q]``) are
``prefix + core(head) + core(rest) + suffix`` whenever (a) no added token spans, or by lstrip/rstrip
absorbs whitespace across, position ``q``, and (b) within the segment, the pieces of ``text`` are the
pieces of ``head`` followed by the pieces of ``rest`` tokenised alone. ``prefix``/``suffix`` are taken from
the tokenizer's own ``encode`` (and checked on every template), so a BOS or [CLS]/[SEP] convention is kept.

(b) is decided on a bounded window, never on the whole text, under one assumption that holds for the
allow-listed normalizers and pre-tokenizers (GPT-2 style ``ByteLevel`` regex, Llama-3/cl100k style
``Split`` patterns, BERT, whitespace, digits, metaspace): they scan left to right without look-behind,
and whether a piece boundary falls at some position depends only on the characters from the previous
boundary to a few characters past it, except inside a run of like characters (whitespace, letters,
digits, other), which can be read to its end (``\\s+(?!\\S)``, ``\\s*[\\r\\n]+``). Hence:

* ``head`` and ``text`` share their first ``q`` characters, so their pieces agree up to a boundary
  ``anchor`` that lies at least ``MARGIN_CHARS`` before the run of like characters ending at ``q``
  (chosen once per split point, from ``head``'s own pieces; or the start of the segment).
* The window ``text[anchor:end]`` reaches past the run of like characters starting at ``q`` by at least
  ``MARGIN_CHARS`` (or to a real segment end). If its pieces are exactly ``head``'s recorded pieces after
  ``anchor``, then the pieces of ``rest[:end - q]`` tokenised alone (same strings, same offsets), the full
  text has a boundary at ``q`` with ``head``'s pieces before it; and, with no look-behind, the pieces
  after ``q`` are those of ``rest`` alone. Comparing against ``rest`` tokenised *alone* also catches
  start-of-input effects (``add_prefix_space``, metaspace ``prepend_scheme``, a ``Prepend`` normalizer),
  and comparing normalized piece strings catches normalizers that act across ``q`` (NFC composing a
  combining mark, lowercasing a final sigma).

Cases this rules out, each of which falls back to full tokenisation: ``"Question: " + "What"`` at the
template's end (GPT-2 attaches the space to the next word; the split one pre-token earlier, before
``" "``, is safe and is tried next), ``"\\n\\n" + "Hi"`` (``\\s+(?!\\S)`` keeps the last newline apart),
``"hel" + "lo"``, ``"12" + "34"``, ``"it" + "'s"``, ``"<" + "s>"`` (an added token across ``q``), BPE dropout
(random), ``Strip`` normalizers and ``FixedLength``/``UnicodeScripts`` pre-tokenizers (not local), and any
tokenizer that is not a fast one. Templates containing single-word or normalized added tokens, and
windows near them, fall back too: their matching cannot be replayed exactly here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
from collections import OrderedDict
from typing import Any, Iterable

LOGGER = logging.getLogger(__name__)

#: Characters between the window's left edge and the run of like characters that ends at the split, at
#: least; and characters of the remainder past the run of like characters that starts at the split.
MARGIN_CHARS = 8
#: Characters of the remainder the safety window covers, at least.
RIGHT_WINDOW_CHARS = 16
#: Split points tried inside a template after its end: the starts of its last this-many pre-tokens.
EXTRA_SPLITS = 2
#: Templates are indexed by this many leading characters.
KEY_CHARS = 16

_MODELS = frozenset({"BPE", "WordPiece", "WordLevel", "Unigram"})
_NORMALIZERS = frozenset({
    "BertNormalizer", "NFC", "NFD", "NFKC", "NFKD", "Lowercase", "StripAccents", "Replace", "Prepend",
    "Precompiled", "Nmt", "ByteLevel", "Sequence",
})
_PRE_TOKENIZERS = frozenset({
    "ByteLevel", "BertPreTokenizer", "Whitespace", "WhitespaceSplit", "Punctuation", "Digits", "Metaspace",
    "CharDelimiterSplit", "Split", "Sequence",
})
_POST_PROCESSORS = frozenset({"TemplateProcessing", "BertProcessing", "RobertaProcessing", "ByteLevel", "Sequence"})
#: Characters Python's str.isspace() accepts but Rust's char::is_whitespace (used for lstrip/rstrip) does not.
_NOT_RUST_WHITESPACE = frozenset("\x1c\x1d\x1e\x1f")

Piece = tuple[str, int, int]


@dataclasses.dataclass(slots=True)
class TemplateStats:
    """``hits``: the template path was taken; ``fallbacks``: a template matched but no split was provably
    safe, so the prompt was tokenised in full; ``full``: no template matched (tokenised in full)."""

    hits: int = 0
    fallbacks: int = 0
    full: int = 0
    evictions: int = 0

    @property
    def hit_ratio(self) -> float:
        total = self.hits + self.fallbacks + self.full
        return self.hits / total if total else 0.0


class TemplateTokenizer:
    """Tokenises prompts that start with a known template from the template's cached ids.

    ``tokenizer`` is a fast tokenizer: :class:`~warmup_tools.common.tokenizer.FolderTokenizer` or transformers'
    ``TokenizersBackend`` (both expose ``encode`` and ``backend_tokenizer``).
    Results always equal ``tokenizer.encode(text, add_special_tokens=True)``. At most ``max_templates``
    templates are kept; the least recently used (by a template-path hit) is evicted first.
    """

    def __init__(self, tokenizer: Any, templates: Iterable[str] = (), *, max_templates: int = 256) -> None:
        if max_templates < 1:
            raise ValueError("max_templates must be >= 1")
        self.tokenizer = tokenizer
        self.max_templates = max_templates
        self.stats = TemplateStats()
        self._lock = threading.Lock()
        self._templates: OrderedDict[str, _Template] = OrderedDict()
        self._index: dict[str, list[str]] = {}
        self._key_lengths: dict[int, int] = {}
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        #: Why templates are never used with this tokenizer, or None when they can be.
        self.unsupported: str | None = self._inspect()
        if self.unsupported is not None:
            LOGGER.info("template tokenisation disabled: %s; prompts are tokenised in full", self.unsupported)
        for text in templates:
            self.add_template(text)

    # -- public API -------------------------------------------------------------------------------------

    def add_template(self, text: str) -> bool:
        """Cache ``text``'s ids; False when it is empty, the tokenizer is unsupported, or no split of it
        could ever be used (then prompts starting with it are simply tokenised in full)."""
        if not text or self.unsupported is not None:
            return False
        with self._lock:
            if text in self._templates:
                self._templates.move_to_end(text)
                return True
        template = self._build(text)
        if template is None:
            return False
        with self._lock:
            if text not in self._templates:
                self._insert(template)
            return True

    def encode(self, text: str) -> tuple[list[int], str]:
        """Token ids of ``text`` (with the tokenizer's special-token convention) and how they were made:
        ``"template"`` when the longest usable matching template was reused, ``"full"`` otherwise."""
        matches = self._matching(text)
        for template in matches:
            ids = self._encode_from(template, text)
            if ids is not None:
                with self._lock:
                    self.stats.hits += 1
                    if template.text in self._templates:
                        self._templates.move_to_end(template.text)
                return ids, "template"
        with self._lock:
            if matches:
                self.stats.fallbacks += 1
            else:
                self.stats.full += 1
        return list(self.tokenizer.encode(text, add_special_tokens=True)), "full"

    def __len__(self) -> int:
        return len(self._templates)

    def __contains__(self, text: object) -> bool:
        return text in self._templates

    # -- building templates -----------------------------------------------------------------------------

    def _inspect(self) -> str | None:
        """Read the tokenizer's pipeline once; returns why it is unsupported, or None."""
        if self._backend is None:
            return "not a fast tokenizer (no backend_tokenizer)"
        config = json.loads(self._backend.to_str())
        reason = _pipeline_reason(config)
        if reason is not None:
            return reason
        self._normalizer = self._backend.normalizer
        # NOTE: a metaspace with prepend_scheme "first" treats the text's first segment unlike the segments
        # after an added token, so a remainder tokenised alone (a first segment) would differ from the same
        # text after a template that holds an added token: such templates are split only before their
        # first added token.
        self._first_sensitive = _has_first_scheme(config)
        self._pre_tokenizer = self._backend.pre_tokenizer
        probe = "warm up, 1"
        with_special = list(self.tokenizer.encode(probe, add_special_tokens=True))
        core = list(self.tokenizer.encode(probe, add_special_tokens=False))
        starts = [i for i in range(len(with_special) - len(core) + 1) if with_special[i:i + len(core)] == core]
        if len(starts) != 1 or not core:
            return "the post-processor does not wrap the ids in a fixed prefix and suffix"
        self._prefix = with_special[:starts[0]]
        self._suffix = with_special[starts[0] + len(core):]
        self._added: dict[str, Any] = {}
        for token in self._backend.get_added_tokens_decoder().values():
            if token.content:
                self._added[token.content] = token
        self._max_added = max((len(c) for c in self._added), default=0)
        self._added_re = _occurrence_regex(self._added)
        # NOTE: single-word tokens match only between word boundaries and normalized tokens match the
        # normalized text: we do not replay either, we only refuse to split near one.
        has_normalizer = self._normalizer is not None
        self._exotic = {c for c, t in self._added.items() if t.single_word or (t.normalized and has_normalizer)}
        exotic_normalized = {c: self._added[c] for c in self._exotic if self._added[c].normalized}
        self._exotic_normalized_re = _occurrence_regex(exotic_normalized) if has_normalizer else None
        return None

    def _build(self, text: str) -> _Template | None:
        core = list(self.tokenizer.encode(text, add_special_tokens=False))
        full = list(self.tokenizer.encode(text, add_special_tokens=True))
        if full != self._prefix + core + self._suffix:
            LOGGER.debug("template %r: special tokens are not a fixed prefix/suffix; not cached", text[:40])
            return None
        occurrences = self._occurrences(text, 0, len(text))
        if _overlapping(occurrences) or any(c in self._exotic for _, _, c in occurrences):
            return None
        if self._exotic_normalized_re is not None and self._exotic_normalized_re.search(
                self._normalizer.normalize_str(text)):
            return None
        tail_start = self._segment_start(text, len(text), occurrences) or 0
        candidates = [len(text)]
        pieces = self._pieces(text[tail_start:])
        for _, start, _ in pieces[::-1][:EXTRA_SPLITS]:
            if 0 < tail_start + start < len(text):
                candidates.append(tail_start + start)
        splits = [s for q in candidates if (s := self._make_split(text, q, core, occurrences)) is not None]
        if not splits:
            return None
        return _Template(text=text, core=tuple(core), full=tuple(full), splits=tuple(splits))

    def _make_split(self, text: str, q: int, core: list[int], occurrences: list[tuple[int, int, str]]) -> _Split | None:
        head = text[:q]
        seg = self._segment_start(head, q, occurrences)
        if seg is None:
            return None
        ids = core if q == len(text) else list(self.tokenizer.encode(head, add_special_tokens=False))
        if core[:len(ids)] != ids:
            return None
        pieces = [(s, a + seg, b + seg) for s, a, b in self._pieces(head[seg:])]
        limit = q - _run_length_before(head, q) - MARGIN_CHARS
        anchor = max([seg] + [a for _, a, _ in pieces if a <= limit])
        left = tuple((s, a - anchor, b - anchor) for s, a, b in pieces if a >= anchor)
        return _Split(at=q, n_ids=len(ids), anchor=anchor, left=left)

    def _segment_start(self, head: str, q: int, occurrences: list[tuple[int, int, str]]) -> int | None:
        """Where the added-token segment that ends ``head`` starts; None when a token spans ``q`` or
        absorbs whitespace up to it."""
        seg = 0
        for start, end, content in occurrences:
            if start >= q:
                continue
            if end > q:
                return None
            if self._added[content].rstrip:
                end += _whitespace_run(head, end, q)
                if end >= q and end > start + len(content):
                    return None
            seg = max(seg, end)
        if seg > 0 and self._first_sensitive:
            return None
        return seg

    def _insert(self, template: _Template) -> None:
        while len(self._templates) >= self.max_templates:
            old, _ = self._templates.popitem(last=False)
            self._unindex(old)
            self.stats.evictions += 1
        self._templates[template.text] = template
        key = template.text[:KEY_CHARS]
        self._index.setdefault(key, []).append(template.text)
        self._key_lengths[len(key)] = self._key_lengths.get(len(key), 0) + 1

    def _unindex(self, text: str) -> None:
        key = text[:KEY_CHARS]
        bucket = self._index[key]
        bucket.remove(text)
        if not bucket:
            del self._index[key]
        self._key_lengths[len(key)] -= 1
        if not self._key_lengths[len(key)]:
            del self._key_lengths[len(key)]

    # -- encoding ---------------------------------------------------------------------------------------

    def _matching(self, text: str) -> list[_Template]:
        """Templates that ``text`` starts with, longest first."""
        found: list[_Template] = []
        with self._lock:
            for length in self._key_lengths:
                for candidate in self._index.get(text[:length], ()):
                    if text.startswith(candidate):
                        found.append(self._templates[candidate])
        found.sort(key=lambda t: len(t.text), reverse=True)
        return found

    def _encode_from(self, template: _Template, text: str) -> list[int] | None:
        if len(text) == len(template.text):
            return list(template.full)
        for split in template.splits:
            rest_ids = self._rest_ids(text, split)
            if rest_ids is not None:
                return self._prefix + list(template.core[:split.n_ids]) + rest_ids + self._suffix
        return None

    def _rest_ids(self, text: str, split: _Split) -> list[int] | None:
        """Ids of ``text[split.at:]`` tokenised alone when joining them is safe (see the module NOTE)."""
        q = split.at
        end = min(len(text), q + max(RIGHT_WINDOW_CHARS, _run_length_after(text, q) + MARGIN_CHARS))
        if self._added_re is not None:
            end = self._added_token_window_end(text, q, end)
            if end is None:
                return None
        window = self._pieces(text[split.anchor:end])
        n_left = len(split.left)
        if tuple(window[:n_left]) != split.left:
            return None
        shift = q - split.anchor
        if window[n_left:] != [(s, a + shift, b + shift) for s, a, b in self._pieces(text[q:end])]:
            return None
        rest = text[q:]
        if self._backend.truncation is None and self._backend.padding is None:
            return self._backend.encode(rest, add_special_tokens=False).ids
        return list(self.tokenizer.encode(rest, add_special_tokens=False))

    def _added_token_window_end(self, text: str, q: int, end: int) -> int | None:
        """Checks added tokens near ``q``; returns the window end (cut at the next token's segment end) or
        None when a token spans ``q`` or cannot be replayed."""
        lo = max(0, q - self._max_added)  # a token ending exactly at q may strip what follows
        hi = min(len(text), end + self._max_added - 1)
        occurrences = self._occurrences(text, lo, hi)
        if _overlapping(occurrences):
            return None
        for start, stop, content in occurrences:
            if content in self._exotic:
                return None
            token = self._added[content]
            ext_start = start - _whitespace_run_before(text, start) if token.lstrip else start
            ext_stop = stop + _whitespace_run(text, stop, len(text)) if token.rstrip else stop
            if ext_start < q < ext_stop:
                return None
            if ext_start >= q:
                # NOTE: the segment really ends where this token (with the whitespace it strips) starts.
                end = min(end, ext_start)
                break
        if self._exotic_normalized_re is not None and self._exotic_normalized_re.search(
                self._normalizer.normalize_str(text[lo:hi])):
            return None
        return end

    # -- helpers ----------------------------------------------------------------------------------------

    def _pieces(self, text: str) -> list[Piece]:
        """Normalized pre-tokens of one segment with their offsets (characters) in ``text``."""
        from tokenizers import PreTokenizedString

        pre = PreTokenizedString(text)
        if self._normalizer is not None:
            pre.normalize(self._normalizer.normalize)
        self._pre_tokenizer.pre_tokenize(pre)
        return [(s, a, b) for s, (a, b), _ in pre.get_splits(offset_referential="original", offset_type="char")]

    def _occurrences(self, text: str, lo: int, hi: int) -> list[tuple[int, int, str]]:
        """Added-token contents in ``text[lo:hi]``: the longest at each start, overlapping ones included."""
        if self._added_re is None:
            return []
        found = []
        for match in self._added_re.finditer(text, lo, hi):
            content = match.group(1)
            found.append((match.start(), match.start() + len(content), content))
        return found


@dataclasses.dataclass(frozen=True, slots=True)
class _Split:
    """A point where a prompt may be cut: the template's ids up to ``at`` are ``core[:n_ids]``."""

    at: int
    n_ids: int
    #: A piece boundary well before ``at``, where the safety window starts.
    anchor: int
    #: The pieces of ``template[:at]`` after ``anchor``, offsets relative to ``anchor``.
    left: tuple[Piece, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class _Template:
    text: str
    core: tuple[int, ...]
    full: tuple[int, ...]
    #: Tried in order: the template's end first, then earlier piece starts.
    splits: tuple[_Split, ...]


def _pipeline_reason(config: dict) -> str | None:
    model = config.get("model") or {}
    if model.get("type") not in _MODELS:
        return f"model type {model.get('type')!r} is not known to work piece by piece"
    if model.get("type") == "BPE" and model.get("dropout"):
        return "BPE dropout makes tokenisation random"
    if config.get("pre_tokenizer") is None:
        return "no pre-tokenizer: the whole text is one piece"
    return (_component_reason(config.get("normalizer"), _NORMALIZERS, "normalizers")
            or _component_reason(config.get("pre_tokenizer"), _PRE_TOKENIZERS, "pretokenizers")
            or _component_reason(config.get("post_processor"), _POST_PROCESSORS, "processors"))


def _has_first_scheme(node: Any) -> bool:
    if isinstance(node, dict):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
            return True
        return any(_has_first_scheme(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_first_scheme(v) for v in node)
    return False


def _component_reason(node: dict | None, allowed: frozenset[str], children: str) -> str | None:
    if node is None:
        return None
    kind = node.get("type")
    if kind not in allowed:
        return f"{kind!r} is not known to act locally"
    for child in node.get(children) or ():
        reason = _component_reason(child, allowed, children)
        if reason is not None:
            return reason
    pattern = node.get("pattern")
    if isinstance(pattern, dict) and "Regex" in pattern and not _regex_is_local(pattern["Regex"]):
        return f"{kind} pattern {pattern['Regex']!r} may look behind or anchor"
    return None


def _regex_is_local(pattern: str) -> bool:
    """False for look-behind, anchors, word boundaries and back-references (outside character classes)."""
    escaped = in_class = False
    for i, ch in enumerate(pattern):
        if escaped:
            escaped = False
            if not in_class and (ch in "bBAzZGKk" or ch.isdigit()):
                return False
        elif ch == "\\":
            escaped = True
        elif in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch in "^$" or pattern.startswith("(?<", i):
            return False
    return True


def _occurrence_regex(tokens: dict[str, Any]) -> re.Pattern[str] | None:
    if not tokens:
        return None
    alternatives = "|".join(re.escape(c) for c in sorted(tokens, key=len, reverse=True))
    return re.compile(f"(?=({alternatives}))")


def _overlapping(occurrences: list[tuple[int, int, str]]) -> bool:
    return any(nxt[0] < cur[1] for cur, nxt in zip(occurrences, occurrences[1:]))


def _category(ch: str) -> int:
    if ch.isspace():
        return 0
    if ch.isalpha():
        return 1
    if ch.isnumeric():
        return 2
    return 3


def _run_length_before(text: str, q: int) -> int:
    """Length of the run of like characters (whitespace, letters, digits, other) ending at ``q``."""
    if q == 0:
        return 0
    kind = _category(text[q - 1])
    i = q - 1
    while i > 0 and _category(text[i - 1]) == kind:
        i -= 1
    return q - i


def _run_length_after(text: str, q: int) -> int:
    """Length of the run of like characters starting at ``q``."""
    if q >= len(text):
        return 0
    kind = _category(text[q])
    i = q + 1
    while i < len(text) and _category(text[i]) == kind:
        i += 1
    return i - q


def _is_strip_whitespace(ch: str) -> bool:
    return ch.isspace() and ch not in _NOT_RUST_WHITESPACE


def _whitespace_run(text: str, start: int, stop: int) -> int:
    i = start
    while i < stop and _is_strip_whitespace(text[i]):
        i += 1
    return i - start


def _whitespace_run_before(text: str, end: int) -> int:
    i = end
    while i > 0 and _is_strip_whitespace(text[i - 1]):
        i -= 1
    return end - i
