"""The request log: one JSON line per request, written off the request path.

``lora_adapter`` hands each finished request's record to :meth:`RequestLogWriter.log`, which only puts
it on a bounded queue (never blocks; when the queue is full the record is dropped and counted). A
background thread writes the lines in batches to ``<dir>/requests-<instance>.jsonl`` (one file per
instance: instances are separate processes) and rotates it at ``max_bytes``, keeping ``backups`` old
files. The warm-up planner reads these files (``python -m warmup_tools plan logs/*.jsonl*``).

Each line is a :class:`~warmup_tools.common.records.RequestRecord` (its ``to_json``).
"""

from __future__ import annotations

import logging
import queue
import threading
from pathlib import Path
from typing import Any, Sequence

from warmup_tools.common.jsonl import RotatingJsonLines
from warmup_tools.common.records import RequestRecord

LOGGER = logging.getLogger(__name__)


class RequestLogWriter:
    """A non-blocking, rotating JSON-lines writer fed through a bounded queue."""

    def __init__(self, directory: Path, instance: str, *, max_bytes: int = 64 << 20, backups: int = 5,
                 queue_size: int = 10_000, flush_interval_s: float = 0.5) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"requests-{instance}.jsonl"
        self._file = RotatingJsonLines(self.path, max_bytes=max_bytes, backups=backups)
        self.dropped = 0
        self.written = 0
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=queue_size)
        self._flush_interval_s = flush_interval_s
        self._thread = threading.Thread(target=self._run, name="request-log", daemon=True)
        self._thread.start()

    def log(self, record: RequestRecord) -> bool:
        """Queue a record; returns False (and counts a drop) instead of ever blocking."""
        try:
            self._queue.put_nowait(record.to_json())
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued and stop the writer thread."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        stop = False
        while not stop:
            batch: list[dict[str, Any]] = []
            try:
                item = self._queue.get(timeout=self._flush_interval_s)
                while True:
                    if item is None:
                        stop = True
                        break
                    batch.append(item)
                    item = self._queue.get_nowait()
            except queue.Empty:
                pass
            if batch:
                self._write(batch)

    def _write(self, batch: list[dict[str, Any]]) -> None:
        try:
            self.written += self._file.write(batch)
        except OSError as exc:  # NOTE: a full disk loses log lines, never a request
            self.dropped += len(batch)
            LOGGER.error("request log %s: %s (dropped %d records)", self.path, exc, len(batch))


def prompt_for_log(tokenizer: Any, text: str | None, prompt_ids: Sequence[int]) -> str | None:
    """``text`` when it is the text of ``prompt_ids`` (what the ensemble's tokenizer step sends), else None.

    NOTE: ``lora_adapter`` takes ``text_input`` only to log it, and a direct caller can send any text
    beside any ids; the planner would then plan for text nobody served. Re-tokenising costs well under a
    millisecond for a demo-length prompt, and runs only when the request log is on.
    """
    if text is None:
        return None
    return text if list(tokenizer.encode(text, add_special_tokens=True)) == list(prompt_ids) else None
