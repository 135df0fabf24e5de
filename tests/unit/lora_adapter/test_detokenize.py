from warmup_tools.lora_adapter.detokenize import IncrementalDetokenizer


class ByteTokenizer:
    """A tokenizer whose tokens are single UTF-8 bytes: multi-byte characters span several tokens."""

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_pieces_join_to_full_text_and_never_split_a_character():
    tok = ByteTokenizer()
    text = "héllo wörld 中文 🙂 done"
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(t) for t in tok.encode(text)]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # The emoji is four bytes: three pushes return nothing, the fourth returns the character.
    assert "🙂" in pieces


def test_flush_returns_trailing_incomplete_bytes_as_replacement():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    detok.push(ord("a"))
    assert detok.push(0xE4) == ""  # first byte of a three-byte character
    assert detok.flush() == "\ufffd"
