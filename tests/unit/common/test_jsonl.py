"""The one JSON-lines reader: gzip by content, bad and torn lines skipped and counted with their line."""

import gzip
import json

import pytest

from warmup_tools.common.errors import FileFormatError
from warmup_tools.common.jsonl import ReadStats, read_json_lines, write_json_lines


def test_plain_and_gzip_files_read_in_order(tmp_path):
    plain, packed = tmp_path / "a.jsonl", tmp_path / "b.log"  # gzip is detected by content, not name
    write_json_lines(plain, [{"i": 0}, {"i": 1}])
    write_json_lines(packed, [{"i": 2}], compress=True)
    assert [r["i"] for r in read_json_lines([plain, packed])] == [0, 1, 2]


def test_compressed_output_is_reproducible(tmp_path):
    write_json_lines(tmp_path / "1.gz", [{"i": 1}], compress=True)
    write_json_lines(tmp_path / "2.gz", [{"i": 1}], compress=True)
    assert (tmp_path / "1.gz").read_bytes() == (tmp_path / "2.gz").read_bytes()


def test_bad_lines_and_a_torn_last_line_are_skipped_and_counted(tmp_path):
    path = tmp_path / "requests.jsonl"
    path.write_text(json.dumps({"i": 0}) + "\n\n[1, 2]\n\xff\n" + json.dumps({"i": 1}) + '\n{"i": 2, "pro')
    path.write_bytes(path.read_bytes().replace("\xff".encode(), b"\xff"))
    stats = ReadStats()
    assert [r["i"] for r in read_json_lines(path, stats)] == [0, 1]
    assert stats.records == 2 and stats.skipped == 3
    assert [(s.line, s.reason.split(" (")[0]) for s in stats.examples] == [
        (3, "expected a JSON object, got list"), (4, "not UTF-8 text"), (6, "torn last line: not valid JSON")]
    assert str(stats.examples[2]).startswith(f"{path}:6: ")


def test_a_truncated_gzip_file_keeps_what_came_before(tmp_path):
    path = tmp_path / "day.jsonl.gz"
    write_json_lines(path, [{"i": i, "pad": "x" * 50} for i in range(500)], compress=True)
    path.write_bytes(path.read_bytes()[:-40])
    stats = ReadStats()
    rows = list(read_json_lines(path, stats))
    assert 0 < len(rows) < 500 and [r["i"] for r in rows] == list(range(len(rows)))
    assert stats.skipped == 1 and "truncated" in stats.examples[0].reason


def test_a_missing_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(FileFormatError, match="nothere.jsonl: cannot read"):
        list(read_json_lines(tmp_path / "nothere.jsonl"))


def test_gzip_module_reads_what_we_write(tmp_path):
    write_json_lines(tmp_path / "x.gz", [{"a": "é"}], compress=True)
    with gzip.open(tmp_path / "x.gz", "rt", encoding="utf-8") as f:
        assert json.loads(f.readline()) == {"a": "é"}


def test_rotating_logs_are_owner_only_and_rotate_by_size(tmp_path):
    import os
    import stat

    from warmup_tools.common.jsonl import RotatingJsonLines

    path = tmp_path / "requests.jsonl"
    path.write_text("")
    os.chmod(path, 0o644)  # an existing file written by an older version
    log = RotatingJsonLines(path, max_bytes=40, backups=2)
    assert log.write([{"prompt": "secret one"}, {"prompt": "secret two"}, {"prompt": "secret three"}]) == 3
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["requests.jsonl", "requests.jsonl.1", "requests.jsonl.2"]
    for name in files:
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600
    assert [r["prompt"] for r in read_json_lines(path)] == ["secret three"]
