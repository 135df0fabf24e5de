"""Control files are parsed bounded in size and nesting, without recursion; every failure names the file."""

import io
import json

import pytest

from warmup_tools.common.control_json import MAX_DEPTH, loads_bounded, nesting_depth, read_capped, read_json_bounded
from warmup_tools.common.errors import FileFormatError

DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("text, depth", [
    ('1', 0), ('[]', 1), ('{"a": [1, {"b": []}]}', 4), ('["[[[[", "}}]]\\"[["]', 1), ('{"k\\\\": [[]]}', 3),
])
def test_the_depth_counts_brackets_outside_strings_only(text, depth):
    assert nesting_depth(text.encode()) == depth
    assert loads_bounded(text.encode(), "x.json") == json.loads(text)


def test_a_deeply_nested_document_is_a_format_error_not_a_recursion_error():
    with pytest.raises(RecursionError):
        json.loads(DEEP)  # what the plain parser does with it
    for raw in (DEEP, b'{"a":' * 100_000 + b"1" + b"}" * 100_000, b"[" * 100_000):
        with pytest.raises(FileFormatError, match=r"desired\.json: nested 100000 levels deep, more than the 32"):
            loads_bounded(raw, "desired.json")
    assert nesting_depth(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH) == MAX_DEPTH
    loads_bounded(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH, "x")


@pytest.mark.parametrize("raw, cause", [
    (b"{secret", "not valid JSON"), (b"\xffsecret", "not UTF-8"), (b"", "not valid JSON"),
])
def test_bad_json_is_named_without_echoing_the_content(raw, cause):
    with pytest.raises(FileFormatError, match=cause) as info:
        loads_bounded(raw, "plan.json")
    assert str(info.value).startswith("plan.json: ") and "secret" not in str(info.value)


def test_size_is_capped_before_reading_the_rest(tmp_path):
    assert read_capped(io.BytesIO(b"12345"), 5, "f") == b"12345"
    with pytest.raises(FileFormatError, match="f: larger than 4 bytes"):
        read_capped(io.BytesIO(b"12345"), 4, "f")
    path = tmp_path / "plan.json"
    path.write_bytes(b"[1, 2]")
    assert read_json_bounded(path, max_bytes=6) == [1, 2]
    with pytest.raises(FileFormatError, match="larger than 5 bytes"):
        read_json_bounded(path, max_bytes=5)
    with pytest.raises(FileFormatError, match="cannot read"):
        read_json_bounded(tmp_path / "missing.json", max_bytes=5)
