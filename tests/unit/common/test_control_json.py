"""Control files are parsed bounded in size and nesting, without recursion; every failure names the file."""

import io
import json
import os
import subprocess
import sys

import pytest

from tests.waiting import HANG_S
from warmup_tools.common import regular_file
from warmup_tools.common.control_json import (
    MAX_DEPTH,
    json_containers,
    json_values,
    loads_bounded,
    nesting_depth,
    read_capped,
    read_json_bounded,
)
from warmup_tools.common.errors import FileFormatError

DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("text, depth", [
    ('1', 0), ('[]', 1), ('{"a": [1, {"b": []}]}', 4), ('["[[[[", "}}]]\\"[["]', 1), ('{"k\\\\": [[]]}', 3),
    ('[[], [[[]]], {}]', 4),
])
def test_the_depth_counts_arrays_and_objects_not_brackets_inside_strings(text, depth):
    assert nesting_depth(json.loads(text)) == depth
    assert loads_bounded(text.encode(), "x.json") == json.loads(text)


def test_a_deeply_nested_document_is_a_format_error_not_a_recursion_error():
    with pytest.raises(RecursionError):
        json.loads(DEEP)  # what the plain parser does with it
    for raw in (DEEP, b'{"a":' * 100_000 + b"1" + b"}" * 100_000, b"[" * 100_000):
        with pytest.raises(FileFormatError, match=r"desired\.json: nested deeper .*more than the 32 levels allowed"):
            loads_bounded(raw, "desired.json")
    for depth in (MAX_DEPTH + 1, 500):  # below the parser's limit: parsed, then measured
        with pytest.raises(FileFormatError, match=rf"x: nested {depth} levels deep, more than the 32 allowed"):
            loads_bounded(b"[" * depth + b"]" * depth, "x")
    assert loads_bounded(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH, "x") is not None


def _parse_in_a_child(raw: bytes) -> str:
    """What loads_bounded makes of ``raw``, from another process that a hang cannot take the suite down with: a
    bound only a hang reaches (a backtracking scan of one unclosed quote took minutes), not a speed check."""
    code = ("import sys\nfrom warmup_tools.common.control_json import loads_bounded\n"
            "from warmup_tools.common.errors import FileFormatError\n"
            "try:\n    loads_bounded(sys.stdin.buffer.read(), 'desired.json')\n    print('parsed')\n"
            "except FileFormatError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], input=raw, capture_output=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr
    return done.stdout.decode().strip()


@pytest.mark.parametrize("raw", [
    b'{"adapters": {"sql": {"path": "' + b"a" * 40,            # one unclosed quote, 40 characters after it
    b'{"adapters": {"sql": {"path": "' + b"a/" * (8 << 20),    # and 16 MiB after it
    b'["' + b'\\"' * (5 << 20),                               # 15 MiB of escaped quotes, never closed
    b'"' + b'\\' * (8 << 20),                                 # 16 MiB of escaped backslashes
])
def test_an_unterminated_string_is_refused_without_hanging_the_reader(raw):
    assert _parse_in_a_child(raw).startswith("desired.json: not valid JSON (Unterminated string")


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


def test_a_read_asks_for_one_byte_more_than_the_cap_and_no_more():
    asked = []

    class Recording(io.BytesIO):
        def read(self, size=-1):
            asked.append(size)
            return super().read(size)

    with pytest.raises(FileFormatError):
        read_capped(Recording(b"x" * 100), 10, "f")
    assert asked == [11]  # a file of any size costs the cap and one byte, never the whole file


def test_every_failure_of_a_file_names_it_and_the_depth_bound_is_the_callers(tmp_path, monkeypatch):
    path = tmp_path / "desired.json"
    path.write_bytes(b"[[[1]]]")
    with pytest.raises(FileFormatError, match=rf"^{path}: nested 3 levels deep, more than the 2 allowed"):
        read_json_bounded(path, max_bytes=100, max_depth=2)
    path.write_bytes(b"{oops")
    with pytest.raises(FileFormatError, match=rf"^{path}: not valid JSON"):
        read_json_bounded(path, max_bytes=100)
    with pytest.raises(FileFormatError, match=rf"^{path}: larger than 3 bytes"):
        read_json_bounded(path, max_bytes=3)
    with pytest.raises(FileFormatError, match=rf"^{tmp_path}: cannot read \(not a regular file \(a directory\)\)$"):
        read_json_bounded(tmp_path, max_bytes=3)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # a plain open() would wait for a writer forever
    with pytest.raises(FileFormatError, match=rf"^{fifo}: cannot read \(not a regular file \(a FIFO\)\)$"):
        read_json_bounded(fifo, max_bytes=3)

    def no_reason(*_args, **_kwargs):
        raise PermissionError()  # an OSError with no strerror: its type names the cause

    monkeypatch.setattr(regular_file.os, "open", no_reason)
    with pytest.raises(FileFormatError, match=rf"^{path}: cannot read \(PermissionError\)$"):
        read_json_bounded(path, max_bytes=3)


@pytest.mark.parametrize("text", [
    '1', '[]', '[1, 2]', '{"a": [1, {"b": []}]}', '["[[,,{", "}}]]\\"[[,"]', '{"k\\\\": [[]]}', '[[], [[[]]], {}]',
    '"a,b"', '["\\\\", 1]', '["\\\\\\"", 1]', '["a\\n", 1, 2]', '{"a": "", "b": "", "c": [""]}',
    '{"format": 1, "adapters": {"sql": {"target": "live", "warm_prompts": ["Hi, [you]", "{x}"], "path": null}}}',
])
def test_the_values_counted_on_the_bytes_are_at_least_those_parsed_and_ignore_strings(text):
    parsed = json.loads(text)

    def values(node):
        inside = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        return 1 + sum(values(child) for child in inside)

    counted = json_values(text.encode())
    assert values(parsed) <= counted <= 2 * values(parsed)
    assert json_values(text.replace(" ", "").encode()) == counted


def test_the_count_crosses_the_pieces_it_splits_into_inside_and_outside_strings(monkeypatch):
    from warmup_tools.common import control_json

    texts = [b'["a,b,c,d", [], "x[y", {}, ","]', b'["' + b"," * 10 + b'"]', b'[",", ",", ",", [",", {"k": ","}]]',
             b'["a", ",b", "c,", ",", "[", "{", 1, [2, [3]]]']
    whole = [json_values(text) for text in texts]
    assert whole[:2] == [1 + 7, 2]  # [ , [ , , { , outside the strings; the commas of one string count nothing
    for chunk in (1, 2, 3, 4, 5, 7):  # pieces that start inside and outside strings, an odd or even count of quotes
        monkeypatch.setattr(control_json, "_CHUNK", chunk)
        assert [json_values(text) for text in texts] == whole, chunk


@pytest.mark.parametrize("text", [
    '1', '[]', '[1, 2]', '{"a": [1, {"b": []}]}', '["[[,,{", "}}]]\\"[[,"]', '{"k\\\\": [[]]}', '[[], [[[]]], {}]',
    '"a[b{"', '["\\\\", []]', '["\\\\\\"[", {}]', '{"a": "", "b": "[", "c": [""]}',
    '{"format": 1, "items": [{"kind": "kv_prefix", "token_ids": [1, 2], "reason": "cut [to] {fit}", "clusters": []}]}',
])
def test_the_containers_counted_on_the_bytes_are_those_parsed_and_ignore_strings(text):
    parsed = json.loads(text)

    def containers(node):
        inside = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        return 0 if inside is None else 1 + sum(containers(child) for child in inside)

    assert json_containers(text.encode()) == containers(parsed)


def test_the_container_count_crosses_the_pieces_it_splits_into(monkeypatch):
    from warmup_tools.common import control_json

    texts = [b'["a[b{c", [], "x[y", {}, "["]', b'["' + b"[" * 10 + b'"]', b'["{", "[", [{"k": "["}]]']
    whole = [json_containers(text) for text in texts]
    assert whole == [3, 1, 3]
    for chunk in (1, 2, 3, 5, 7):
        monkeypatch.setattr(control_json, "_CHUNK", chunk)
        assert [json_containers(text) for text in texts] == whole, chunk


def test_a_document_of_more_containers_than_its_reader_allows_is_refused_before_it_is_parsed(monkeypatch, tmp_path):
    raw = b'{"ids": [' + b"7, " * 1000 + b'7], "more": [' + b"[]," * 96 + b"[]]}"  # 100 containers, 1,001 numbers
    assert len(loads_bounded(raw, "plan.json", max_containers=100)["ids"]) == 1001

    def parse(*_args, **_kwargs):
        raise AssertionError("parsed")

    monkeypatch.setattr(json, "loads", parse)
    with pytest.raises(FileFormatError, match=r"^plan\.json: 100 JSON arrays and objects by its brackets, more than "
                                              r"the 99 allowed \(refused before parsing\)$"):
        loads_bounded(raw, "plan.json", max_containers=99)
    path = tmp_path / "plan.json"
    path.write_bytes(raw)
    with pytest.raises(FileFormatError, match=rf"^{path}: 100 JSON arrays and objects .* the 99 allowed"):
        read_json_bounded(path, max_bytes=len(raw), max_containers=99)


def test_a_control_file_reader_passes_its_values_bound_and_follows_a_symbolic_link(tmp_path):
    # A Kubernetes ConfigMap mounts each file as a symbolic link: followed, to a regular file only.
    target, link = tmp_path / "data.json", tmp_path / "desired.json"
    target.write_bytes(b"[1, 2, 3]")
    link.symlink_to(target)
    assert read_json_bounded(link, max_bytes=100, max_values=4) == [1, 2, 3]
    with pytest.raises(FileFormatError, match=rf"^{link}: 4 JSON values by its commas and brackets, more than the 3"):
        read_json_bounded(link, max_bytes=100, max_values=3)


def test_a_document_of_more_values_than_its_reader_allows_is_refused_before_it_is_parsed(monkeypatch):
    raw = b"[" + b"[]," * 99 + b"[]]"  # 101 values (100 lists in one), 201 by the count: 101 [ and 99 ,
    assert len(loads_bounded(raw, "desired.json", max_values=201)) == 100

    def parse(*_args, **_kwargs):
        raise AssertionError("parsed")

    monkeypatch.setattr(json, "loads", parse)
    with pytest.raises(FileFormatError, match=r"^desired\.json: 201 JSON values by its commas and brackets, more "
                                              r"than the 200 allowed \(refused before parsing\)$"):
        loads_bounded(raw, "desired.json", max_values=200)
    # Commas and brackets inside strings are text, not values.
    monkeypatch.undo()
    prose = json.dumps({"warm_prompts": ["Hello, world, [a], {b}, " * 1000]}).encode()
    assert loads_bounded(prose, "desired.json", max_values=3)["warm_prompts"][0].startswith("Hello, world")


@pytest.mark.parametrize("raw", [
    b'["' + b'\\"' * (5 << 20),                               # 15 MiB of escaped quotes, never closed
    b'"' * (16 << 20),                                          # 16 MiB of quotes
    b"[" + b'",' * (8 << 20) + b'"]',                           # a quote and a comma, 8 million times
])
def test_counting_the_values_of_a_hostile_file_finishes(raw):
    # A bound only a hang reaches (a pattern that restarts at each escaped quote is quadratic), not a speed check.
    code = ("import sys\nfrom warmup_tools.common.control_json import json_containers, json_values\n"
            "raw = sys.stdin.buffer.read()\nprint(json_values(raw), json_containers(raw))\n")
    done = subprocess.run([sys.executable, "-c", code], input=raw, capture_output=True, timeout=HANG_S)
    assert done.returncode == 0 and int(done.stdout.split()[0]) >= 1 <= int(done.stdout.split()[1]) + 1, done.stderr
