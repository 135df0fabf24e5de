"""JSON Lines: the one reader, the one atomic writer, and the rotating appender of the package.

Every JSON-lines file that crosses a process (the request log, the heat log, the traffic generator's
days) is read by :func:`read_json_lines` and written by :func:`write_json_lines` (whole files, atomic)
or :class:`RotatingJsonLines` (appending, rotated by size).

Reading is forgiving where a live system produces damage: a line that is not a JSON object, or a torn
last line of a file a writer was appending to (or of a truncated gzip stream), is skipped and counted
in :class:`ReadStats` with its file and line number. A file that cannot be opened at all is an error.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

from warmup_tools.common.errors import FileFormatError
from warmup_tools.common.files import PRIVATE_MODE, write_atomic

LOGGER = logging.getLogger(__name__)

_GZIP_MAGIC = b"\x1f\x8b"


@dataclasses.dataclass(frozen=True, slots=True)
class SkippedLine:
    path: Path
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclasses.dataclass(slots=True)
class ReadStats:
    """What :func:`read_json_lines` read and skipped (the first ``keep`` skipped lines are kept)."""

    records: int = 0
    skipped: int = 0
    examples: list[SkippedLine] = dataclasses.field(default_factory=list)
    keep: int = 20

    def skip(self, path: Path, line: int, reason: str) -> None:
        self.skipped += 1
        if len(self.examples) < self.keep:
            self.examples.append(SkippedLine(path, line, reason))
        LOGGER.warning("%s:%d: skipped (%s)", path, line, reason)


def read_json_lines(paths: str | Path | Iterable[str | Path],
                    stats: ReadStats | None = None) -> Iterator[dict[str, Any]]:
    """The JSON objects of ``.jsonl`` files (gzip detected by content), in order; blank lines ignored.

    Bad and torn lines are skipped and counted in ``stats``; a missing or unreadable file raises
    :class:`~warmup_tools.common.errors.FileFormatError` naming it.
    """
    for _, _, record in iter_json_lines(paths, stats):
        yield record


def iter_json_lines(paths: str | Path | Iterable[str | Path],
                    stats: ReadStats | None = None) -> Iterator[tuple[Path, int, dict[str, Any]]]:
    """Like :func:`read_json_lines`, with each object's file and line number."""
    stats = stats if stats is not None else ReadStats()
    if isinstance(paths, (str, Path)):
        paths = [paths]
    for path in map(Path, paths):
        try:
            with path.open("rb") as probe:
                compressed = probe.read(2) == _GZIP_MAGIC
        except OSError as exc:
            raise FileFormatError(f"{path}: cannot read ({exc.strerror or exc})") from None
        raw = gzip.open(path, "rb") if compressed else path.open("rb")
        lineno = 0
        with raw:
            try:
                for lineno, line in enumerate(raw, start=1):
                    record = _parse(line, path, lineno, stats)
                    if record is not None:
                        stats.records += 1
                        yield path, lineno, record
            except (EOFError, gzip.BadGzipFile, OSError) as exc:
                # NOTE: a gzip file cut short (a copy in progress, a full disk) loses its tail, not the run.
                stats.skip(path, lineno + 1, f"damaged or truncated file ({exc})")


def write_json_lines(path: Path, records: Iterable[dict[str, Any]], *, compress: bool = False,
                     mode: int = PRIVATE_MODE) -> int:
    """Write ``records`` as a whole file, atomically (gzip with a fixed header when ``compress``), owner only
    unless ``mode`` says otherwise."""
    data = b"".join(_line(r) for r in records)
    count = data.count(b"\n")
    if compress:
        buffer = io.BytesIO()
        # NOTE: no file name and mtime 0 in the gzip header, so the same records give the same bytes.
        with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, compresslevel=6, mtime=0) as packed:
            packed.write(data)
        data = buffer.getvalue()
    write_atomic(path, data, mode=mode)
    return count


class RotatingJsonLines:
    """Appends records as JSON lines to a file, rotating at max_bytes (keeps `backups` old files).

    Old files are ``path.1`` (newest) to ``path.<backups>``. A single line longer than ``max_bytes`` is
    still written, alone in a fresh file. One writer per path: rotation is not safe across processes.
    """

    def __init__(self, path: Path, *, max_bytes: int = 16 << 20, backups: int = 3, mode: int = 0o600) -> None:
        if max_bytes < 1 or backups < 0:
            raise ValueError("max_bytes must be >= 1 and backups >= 0")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        #: Permission bits of new files: owner only by default, since request logs can hold prompts.
        self.mode = mode

    def _open(self):
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, self.mode)
        os.fchmod(fd, self.mode)  # NOTE: also an existing file, and regardless of the umask
        return os.fdopen(fd, "ab")

    def write(self, records: Iterable[dict]) -> int:
        """Append ``records``; returns how many were written."""
        lines = [_line(r) for r in records]
        if not lines:
            return 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        size = self.path.stat().st_size if self.path.exists() else 0
        out = self._open()
        try:
            for line in lines:
                if size and size + len(line) > self.max_bytes:
                    out.close()
                    self._rotate()
                    out = self._open()
                    size = 0
                out.write(line)
                size += len(line)
        finally:
            out.close()
        return len(lines)

    def _rotate(self) -> None:
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
            return
        for i in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))


# ---------------------------------------------------------------------------------------------- helpers
def _line(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, separators=(",", ":"), ensure_ascii=False) + "\n").encode("utf-8")


def _parse(line: bytes, path: Path, lineno: int, stats: ReadStats) -> dict[str, Any] | None:
    if not line.strip():
        return None
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        stats.skip(path, lineno, f"not UTF-8 text ({exc.reason})")
        return None
    except json.JSONDecodeError as exc:
        torn = "" if line.endswith(b"\n") else "torn last line: "
        stats.skip(path, lineno, f"{torn}not valid JSON ({exc.msg} at column {exc.colno})")
        return None
    if not isinstance(record, dict):
        stats.skip(path, lineno, f"expected a JSON object, got {type(record).__name__}")
        return None
    return record
