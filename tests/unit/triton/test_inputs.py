"""Client strings and counts are checked where they enter, with errors that say what to send."""

from __future__ import annotations

import numpy as np
import pytest

from warmup_tools.common.errors import InvalidInputError
from warmup_tools.lora_adapter.requests import RequestLimits, parse_generate_request
from warmup_tools.triton.inputs import (
    MAX_IDENTITY_BYTES,
    MAX_PROMPT_TOKENS,
    MAX_TEXT_BYTES,
    check_text_size,
    parse_count,
    parse_identity,
    parse_optional_string,
    parse_optional_text,
    parse_scalar,
    parse_text,
)


def s(value):
    return np.array([value if isinstance(value, bytes) else value.encode()], dtype=object)


@pytest.mark.parametrize("value", ["acme", "tenant-7", "a.b_c", "A" * MAX_IDENTITY_BYTES, "0x"])
def test_identities_that_are_short_names_pass(value):
    assert parse_identity({"tenant_id": s(value)}, "tenant_id", "default") == value


@pytest.mark.parametrize("value", [
    "a" * (MAX_IDENTITY_BYTES + 1), "x" * 100_000, "acme\x00", "acme\nother", "ac me", "-leading", ".hidden",
    "../etc", "acme/legal", "tenant{a}", "é" * 40, "emoji😀", "acme;drop", "a\tb",
])
def test_identities_that_are_not_short_names_are_refused_without_echo(value):
    with pytest.raises(InvalidInputError, match="not a valid name: use 1 to 64 characters") as info:
        parse_identity({"tenant_id": s(value)}, "tenant_id", "default")
    assert value not in str(info.value) or len(value) < 3


def test_an_absent_or_blank_identity_is_the_default():
    assert parse_identity({}, "tenant_id", "default") == "default"
    assert parse_identity({"adapter_id": s("  ")}, "adapter_id", None) is None


def test_text_is_bounded_before_it_is_decoded():
    assert parse_text({"text_input": s("x" * MAX_TEXT_BYTES)}) == "x" * MAX_TEXT_BYTES
    with pytest.raises(InvalidInputError, match=f"longer than {MAX_TEXT_BYTES} bytes"):
        parse_text({"text_input": s(b"\xff" * (MAX_TEXT_BYTES + 1))})  # too long wins over bad UTF-8
    with pytest.raises(InvalidInputError, match="longer than"):
        parse_text({"text_input": np.array(["é" * MAX_TEXT_BYTES], dtype=object)})  # str, counted in bytes


def test_text_exactly_at_the_bound_passes_as_bytes_or_str():
    assert parse_text({"text_input": s(b"x" * MAX_TEXT_BYTES)}) == "x" * MAX_TEXT_BYTES
    assert parse_text({"text_input": np.array(["x" * MAX_TEXT_BYTES], dtype=object)}) == "x" * MAX_TEXT_BYTES
    two_byte = "é" * (MAX_TEXT_BYTES // 2)  # exactly the bound in UTF-8 bytes
    assert parse_text({"text_input": np.array([two_byte], dtype=object)}) == two_byte


@pytest.mark.parametrize("value", [b"\xed\xa0\x80", b"a\xed\xbf\xbfb", "\ud800", "a\udfffb", b"\xff"],
                         ids=["encoded-high-surrogate", "encoded-low-surrogate", "str-high", "str-low", "not-utf8"])
def test_a_lone_surrogate_or_other_invalid_utf8_is_refused_as_bytes_or_str(value):
    with pytest.raises(InvalidInputError, match=r"^input 'text_input' is not valid UTF-8 \(byte \d+: "):
        parse_text({"text_input": np.array([value], dtype=object)})
    # A pair is one character: it passes, either way.
    assert parse_text({"text_input": np.array(["\U0001F600"], dtype=object)}) == "\U0001F600"
    assert parse_text({"text_input": s("\U0001F600".encode())}) == "\U0001F600"


def test_a_text_checks_its_own_input_name_and_bound():
    assert parse_text({"prompt": s("x" * 10)}, "prompt", max_bytes=10) == "x" * 10
    with pytest.raises(InvalidInputError, match=r"^input 'prompt' is longer than 10 bytes: send a shorter text$"):
        parse_text({"prompt": s("x" * 11)}, "prompt", max_bytes=10)
    with pytest.raises(InvalidInputError, match=r"^input 'prompt' is required: send the prompt as a BYTES"):
        parse_text({}, "prompt")


def test_a_single_value_in_a_batch_shaped_tensor_is_read():
    # Triton clients send [1, 1] as often as [1]: one element is one value whatever the shape.
    assert parse_text({"text_input": np.array([[b"hello"]], dtype=object)}) == "hello"
    assert parse_identity({"tenant_id": np.array([[b"acme"]], dtype=object)}, "tenant_id", None) == "acme"
    assert parse_count({"prompt_tokens": np.array([[7]], dtype=np.int32)}, "prompt_tokens", 0, 10) == 7
    with pytest.raises(InvalidInputError, match="must be an integer"):
        parse_count({"prompt_tokens": np.array([[2.5]], dtype=np.float32)}, "prompt_tokens", 0, 10)


def test_a_non_string_tensor_is_refused_as_such():
    with pytest.raises(InvalidInputError, match=r"^input 'text_input' must be a BYTES \(string\) tensor$"):
        parse_text({"text_input": np.array([1], dtype=np.int32)})


def test_a_scalar_of_several_values_is_refused_with_the_count():
    with pytest.raises(InvalidInputError, match=r"^input 'prompt_tokens' must hold exactly one value, got 2$"):
        parse_count({"prompt_tokens": np.array([1, 2], dtype=np.int32)}, "prompt_tokens", 0, 10)


def test_an_integral_float_is_an_integer_and_scalars_take_their_declared_type():
    assert parse_count({"prompt_tokens": np.array([3.0], dtype=np.float32)}, "prompt_tokens", 0, 10) == 3
    assert type(parse_scalar({"seed": np.array([3.0], dtype=np.float64)}, "seed", int, 0)) is int
    assert parse_scalar({"top_p": np.array([0.5], dtype=np.float32)}, "top_p", float, 1.0) == 0.5
    assert parse_scalar({"stream": np.array([True])}, "stream", bool, False) is True


def test_an_absent_optional_string_is_its_default():
    assert parse_optional_string({}, "warmup_plan") == ""
    assert parse_optional_string({"warmup_plan": s("  ")}, "warmup_plan", "none") == "none"
    assert parse_optional_string({"warmup_plan": s(" p1 ")}, "warmup_plan") == "p1"


@pytest.mark.parametrize("array,expected", [
    (None, None),
    (np.array([b"hello"], dtype=object), "hello"),
    (np.array([[b"hello"]], dtype=object), "hello"),
    (np.array([b"hello"], dtype="S5"), "hello"),
    (np.array(["hello"], dtype=object), "hello"),
    (np.array([b"caf\xe9"], dtype=object), "caf\ufffd"),  # kept for the log, with a replacement
])
def test_optional_text_is_the_prompt_when_there_is_exactly_one(array, expected):
    inputs = {} if array is None else {"text_input": array}
    assert parse_optional_text(inputs) == expected
    assert parse_optional_text({"other": np.array([b"x"], dtype=object)} | inputs, "other") == "x"


@pytest.mark.parametrize("array", [np.array([b"a", b"b"], dtype=object), np.array([], dtype=object)])
def test_optional_text_that_is_not_exactly_one_string_is_refused(array):
    with pytest.raises(InvalidInputError) as refused:
        parse_optional_text({"text_input": array})
    assert str(refused.value) == f"input 'text_input' must hold exactly one string, got {array.size} elements"


def test_optional_text_is_bounded_by_its_own_bound_before_it_is_decoded():
    assert parse_optional_text({"prompt": s("x" * 10)}, "prompt", max_bytes=10) == "x" * 10
    with pytest.raises(InvalidInputError, match=r"^input 'prompt' is longer than 10 bytes: send a shorter text$"):
        parse_optional_text({"prompt": s(b"\xff" * 11)}, "prompt", max_bytes=10)


def test_the_text_size_check_reads_text_input_by_default():
    check_text_size({"text_input": s("x" * MAX_TEXT_BYTES)})
    check_text_size({"other": s("x" * (MAX_TEXT_BYTES + 1))})  # only text_input is checked by default
    with pytest.raises(InvalidInputError, match=rf"^input 'text_input' is longer than {MAX_TEXT_BYTES} bytes"):
        check_text_size({"text_input": s("x" * (MAX_TEXT_BYTES + 1))})


def test_counts_are_non_negative_integers_in_range():
    assert parse_count({}, "prompt_tokens", 0, 10) == 0
    assert parse_count({"prompt_tokens": np.array([7], dtype=np.int32)}, "prompt_tokens", 0, 10) == 7
    assert parse_count({"prompt_tokens": np.array([10], dtype=np.int32)}, "prompt_tokens", 0, 10) == 10
    for bad in (np.array([-1], dtype=np.int32), np.array([11], dtype=np.int64), np.array([2.5], dtype=np.float32)):
        with pytest.raises(InvalidInputError, match="prompt_tokens"):
            parse_count({"prompt_tokens": bad}, "prompt_tokens", 0, 10)


LIMITS = RequestLimits(max_tokens_limit=64, default_max_tokens=8, vocab_size=100)


@pytest.mark.parametrize("inputs,match", [
    ({"top_p": np.array([0.0], dtype=np.float32)}, r"top_p' is out of range.*1 for no nucleus"),
    ({"top_p": np.array([np.inf], dtype=np.float32)}, "top_p"),
    ({"seed": np.array([-1], dtype=np.int64)}, "seed"),
    ({"cluster_id": np.array([-2], dtype=np.int32)}, "cluster_id"),
    ({"cluster_id": np.array([1 << 30], dtype=np.int32)}, "cluster_id"),
    ({"max_tokens": np.array([1.5], dtype=np.float32)}, "must be an integer"),
    ({"tenant_id": s("x" * 300)}, "tenant_id' is not a valid name"),
    ({"adapter_id": s("../../etc/passwd")}, "adapter_id' is not a valid name"),
    ({"warmup_plan": s("p" * 65)}, "warmup_plan' is longer than 64 bytes"),
    ({"input_ids": np.array([1.0, 2.0], dtype=np.float32)}, "integer token ids"),
    ({"input_ids": np.zeros(MAX_PROMPT_TOKENS + 1, dtype=np.int32)}, f"at most {MAX_PROMPT_TOKENS}"),
    ({"input_ids": np.ones((2, 3), dtype=np.int32)}, r"shape \[n\] or \[1, n\]"),
    ({"input_ids": np.array([-1], dtype=np.int32)}, "outside the vocabulary"),
])
def test_generate_requests_refuse_bad_values(inputs, match):
    with pytest.raises(InvalidInputError, match=match):
        parse_generate_request({"input_ids": np.array([1], dtype=np.int32), **inputs}, LIMITS)
