"""New lines of each lora_adapter instance's request log, read by the canary: what arrived since the last read,
and a trial's baseline (the records of a past window)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from warmup_tools.common.records import RecordError, RequestRecord

#: Bytes of one request log read per tick at most (the rest is read at the next ticks).
MAX_READ_BYTES = 8 << 20
LOG_PREFIX, LOG_SUFFIX = "requests-", ".jsonl"


class RequestLogTail:
    """New complete lines of each instance's request log (``requests-<instance>.jsonl``) since the last read; a
    rotated file's rest is read from its ``.1`` before the new file."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._at: dict[str, tuple[int, int]] = {}  # instance -> (inode, offset)
        self.skipped = 0

    def skip_to_end(self) -> None:
        """Forget what the logs hold now: only lines written from here on are read."""
        self._at = {}
        for instance, path in self._files():
            st = os.stat(path)
            self._at[instance] = (st.st_ino, st.st_size)

    def read(self) -> list[tuple[str, RequestRecord]]:
        out: list[tuple[str, RequestRecord]] = []
        for instance, path in self._files():
            try:
                inode = os.stat(path).st_ino
            except FileNotFoundError:
                continue
            known, offset = self._at.get(instance, (inode, 0))
            if known != inode:  # rotated: the old file is now .1
                rotated = path.with_name(path.name + ".1")
                if rotated.exists() and os.stat(rotated).st_ino == known:
                    out += self._lines(instance, rotated, offset)[0]
                offset = 0
            lines, offset = self._lines(instance, path, offset)
            out += lines
            self._at[instance] = (inode, offset)
        return out

    def recent(self, since: float, until: float) -> list[RequestRecord]:
        """The records stamped in ``[since, until)`` among the last :data:`MAX_READ_BYTES` of each log (with the
        end of its rotated ``.1`` when the log is shorter): a trial's baseline, read once, never the whole log."""
        out: list[RequestRecord] = []
        for instance, path in self._files():
            budget = MAX_READ_BYTES
            for file in (path, path.with_name(path.name + ".1")):
                try:
                    size = os.stat(file).st_size
                except FileNotFoundError:
                    break
                start = max(0, size - budget)
                lines, _ = self._lines(instance, file, start, skip_partial=start > 0)
                out += [r for _, r in lines if since <= r.ts < until]
                budget -= size - start
                if budget <= 0:
                    break
        return out

    def _files(self) -> list[tuple[str, Path]]:
        if not self.directory.is_dir():
            return []
        return sorted((p.name[len(LOG_PREFIX):-len(LOG_SUFFIX)], p) for p in self.directory.iterdir()
                      if p.name.startswith(LOG_PREFIX) and p.name.endswith(LOG_SUFFIX) and p.is_file())

    def _lines(self, instance: str, path: Path, offset: int, *, skip_partial: bool = False
               ) -> tuple[list[tuple[str, RequestRecord]], int]:
        try:
            with open(path, "rb") as file:
                file.seek(offset)
                raw = file.read(MAX_READ_BYTES)
        except OSError:
            return [], offset
        end = raw.rfind(b"\n") + 1  # NOTE: a torn last line is read once the writer completes it
        begin = raw.find(b"\n") + 1 if skip_partial else 0  # a read from the middle starts at a line's start
        out = []
        for line in raw[begin:end].splitlines():
            try:
                out.append((instance, RequestRecord.from_json(json.loads(line))))
            except (ValueError, RecordError, TypeError):
                self.skipped += 1
        return out, offset + end
