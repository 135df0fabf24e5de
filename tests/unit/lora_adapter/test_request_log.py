import json
import threading

from warmup_tools.common.records import RECORD_KEYS, RequestRecord
from warmup_tools.lora_adapter.request_log import RequestLogWriter


def record(i, redact=False):
    return RequestRecord.served(ts=1000.0 + i, tenant="acme", adapter="sql", prompt=f"prompt {i}", prompt_tokens=10,
                       cached_tokens=0, ttft_ms=12.5, output_tokens=3, cluster=-1, redact=redact)


def test_records_are_written_as_json_lines(tmp_path):
    writer = RequestLogWriter(tmp_path, "inst_0", flush_interval_s=0.05)
    for i in range(50):
        assert writer.log(record(i))
    writer.close()
    lines = [json.loads(line) for line in writer.path.read_text().splitlines()]
    assert len(lines) == 50 and lines[3]["prompt"] == "prompt 3" and lines[3]["adapter"] == "sql"
    assert tuple(lines[0]) == tuple(k for k in RECORD_KEYS if k != "template")
    assert RequestRecord.from_json(lines[3]) == record(3)


def test_redaction_keeps_the_digest_but_not_the_text():
    redacted = record(1, redact=True)
    assert redacted.prompt is None and "prompt" not in redacted.to_json()
    assert redacted.prompt_digest == record(1).prompt_digest


def test_logging_never_blocks_even_when_the_disk_is_stuck(tmp_path, monkeypatch):
    """A full queue drops and counts; ``log`` returns while the writer is stuck on the disk.

    NOTE: no timing. The writer thread is held inside its write (it has taken exactly one record)
    until the test releases it, so the queue's fill is known exactly; a ``log`` that blocked would
    never let the logging thread finish, and the join's generous deadline reports it.
    """
    entered, release = threading.Event(), threading.Event()
    writer = RequestLogWriter(tmp_path, "inst_0", queue_size=100, flush_interval_s=0.01)
    original = writer._write

    def stuck_write(batch):
        entered.set()
        release.wait()
        original(batch)

    monkeypatch.setattr(writer, "_write", stuck_write)
    assert writer.log(record(-1))
    assert entered.wait(60), "the writer thread never took the first record"
    results = []
    logger = threading.Thread(target=lambda: results.extend(writer.log(record(i)) for i in range(1000)))
    logger.start()
    logger.join(60)
    stuck = logger.is_alive()
    release.set()
    writer.close()
    assert not stuck, "log() blocked while the writer was stuck"
    assert sum(results) == 100 and writer.dropped == 900
    assert writer.written == 101


def test_rotation_keeps_backups(tmp_path):
    writer = RequestLogWriter(tmp_path, "inst_0", max_bytes=2000, backups=2, flush_interval_s=0.01)
    # NOTE: the file rotates line by line, so how the writer thread batches the records does not matter.
    assert all(writer.log(record(i)) for i in range(200))
    writer.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["requests-inst_0.jsonl", "requests-inst_0.jsonl.1", "requests-inst_0.jsonl.2"]
    assert writer.written == 200
