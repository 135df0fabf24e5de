"""Incremental detokenisation: turn a growing list of token ids into text pieces as they arrive.

Byte-level BPE tokens do not map one to one onto characters: a multi-byte UTF-8 character may span
several tokens, and some tokenizers change how a token prints depending on its left context. Like
vLLM's ``detokenize_incrementally`` (and TGI's ``decode_token``), we decode a short window twice, once
up to the previously emitted position and once including the new token, and emit the difference only
when it does not end in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from typing import Protocol, Sequence


class _Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids with :meth:`push`; each call returns the new text (possibly empty)."""

    def __init__(self, tokenizer: _Decoder, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._tokens: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        self._tokens.append(int(token_id))
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            piece = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._tokens)
            return piece
        return ""

    def flush(self) -> str:
        """Text still held back at the end of generation (e.g. a trailing incomplete character)."""
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._tokens)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(list(ids), skip_special_tokens=self._skip_special)
