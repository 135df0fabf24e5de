"""The request record crosses processes: one type, versioned, read through one reader."""

import json

from warmup_tools.common.jsonl import ReadStats
from warmup_tools.common.records import RECORD_KEYS, RequestRecord, log_files, read_request_log


def test_served_record_round_trips_and_redaction_drops_the_text():
    rec = RequestRecord.served(ts=1.23456, tenant="acme", adapter=None, prompt="hello", prompt_tokens=3,
                               cached_tokens=0, ttft_ms=1.234, output_tokens=2, cluster=-1, redact=False)
    assert (rec.adapter, rec.ts, rec.ttft_ms) == ("", 1.235, 1.23)
    assert RequestRecord.from_json(rec.to_json()) == rec
    assert tuple(rec.to_json()) == tuple(k for k in RECORD_KEYS if k != "template")
    hidden = RequestRecord.served(ts=1, tenant="acme", adapter="sql", prompt="hello", prompt_tokens=3,
                                  cached_tokens=0, ttft_ms=1, output_tokens=2, cluster=-1, redact=True)
    assert "prompt" not in hidden.to_json() and hidden.prompt_digest == rec.prompt_digest


def test_planned_tokens_are_written_only_when_known():
    rec = RequestRecord.served(ts=1, tenant="acme", adapter="sql", prompt="hello", prompt_tokens=48,
                               cached_tokens=32, ttft_ms=1, output_tokens=2, cluster=-1, redact=False,
                               planned_tokens=16)
    assert rec.to_json()["planned_tokens"] == 16 and RequestRecord.from_json(rec.to_json()) == rec
    older = dict(rec.to_json())
    del older["planned_tokens"]
    assert RequestRecord.from_json(older).planned_tokens is None


def test_the_log_reader_skips_bad_records_naming_their_line(tmp_path):
    path = tmp_path / "requests-x.jsonl"
    lines = [{"ts": 1.0, "tenant": "a", "prompt": "p"},             # no "v": an older log, version 1
             {"v": 2, "ts": 2.0},                                     # a newer layout
             {"v": 1, "ts": "yesterday"},                             # a bad field
             {"v": 1, "ts": 3.0, "adapter": "sql", "prompt": "q"}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"v": 1, "ts": 4')
    stats = ReadStats()
    got = list(read_request_log(path, stats))
    assert [(r.ts, r.tenant, r.adapter) for r in got] == [(1.0, "a", ""), (3.0, "default", "sql")]
    assert stats.records == 2 and stats.skipped == 3
    assert [s.line for s in stats.examples] == [2, 3, 5]
    assert "version 2" in stats.examples[0].reason and "'ts'" in stats.examples[1].reason


def test_log_folders_expand_to_current_and_rotated_logs_oldest_first(tmp_path):
    for name in ("requests.jsonl", "requests.jsonl.1", "requests.jsonl.2", "other.jsonl.gz", "notes.txt",
                 "requests.jsonl.tmp"):
        (tmp_path / name).write_text("")
    single = tmp_path / "x.jsonl"
    assert log_files(single) == [single]
    assert [p.name for p in log_files([tmp_path])] == [
        "other.jsonl.gz", "requests.jsonl.2", "requests.jsonl.1", "requests.jsonl"]
    # A fleet's log folder: one subfolder per replica, read after the folder's own logs.
    for replica in ("r2", "r1"):
        (tmp_path / replica).mkdir()
        (tmp_path / replica / "requests-lm_0_0.jsonl").write_text("")
    assert [str(p.relative_to(tmp_path)) for p in log_files(tmp_path)][-2:] == [
        "r1/requests-lm_0_0.jsonl", "r2/requests-lm_0_0.jsonl"]


def test_a_keyed_prompt_digest_differs_per_key_and_from_the_plain_one():
    from warmup_tools.common.digests import prompt_digest

    plain, a, b = prompt_digest("hello"), prompt_digest("hello", b"k1" * 16), prompt_digest("hello", b"k2" * 16)
    assert len({plain, a, b}) == 3 and a == prompt_digest("hello", b"k1" * 16) and len(a) == len(plain)
    rec = RequestRecord.served(ts=1.0, tenant="t", adapter=None, prompt="hello", prompt_tokens=1, cached_tokens=0,
                               ttft_ms=1.0, output_tokens=1, cluster=-1, redact=True, digest_key=b"k1" * 16)
    assert rec.prompt is None and rec.prompt_digest == a


def test_a_chat_request_s_role_spans_round_trip_and_bad_ones_are_refused():
    import pytest

    from warmup_tools.common.records import RecordError, RequestRecord, parse_role_spans

    spans = parse_role_spans('[["system", 0, 812], ["user", 812, 860]]')
    record = RequestRecord.served(ts=1.0, tenant="t", adapter="sql", prompt="x" * 860, prompt_tokens=200,
                                  cached_tokens=192, ttft_ms=3.0, output_tokens=4, cluster=1, redact=False,
                                  roles=spans)
    data = record.to_json()
    assert data["roles"] == [["system", 0, 812], ["user", 812, 860]]
    assert RequestRecord.from_json(data) == record
    assert "roles" not in RequestRecord(ts=1.0).to_json()  # a raw prompt's record is as before
    for bad in ('{"a": 1}', "[[1, 0, 3]]", '[["user", 5, 3]]', '[["user", 0, 5], ["user", 2, 9]]',
                '[["Robert\'); DROP", 0, 1]]', '[["user", true, 3]]', "[" * 5000, "not json",
                "[" + ",".join(['["user", 0, 0]'] * 65) + "]"):
        with pytest.raises(RecordError):
            parse_role_spans(bad)
