"""Appending JSON lines to a file that rotates by size (the request log and the heat log)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable


class RotatingJsonLines:
    """Appends records as JSON lines to a file, rotating at max_bytes (keeps `backups` old files).

    Old files are ``path.1`` (newest) to ``path.<backups>``. A single line longer than ``max_bytes`` is
    still written, alone in a fresh file. One writer per path: rotation is not safe across processes.
    """

    def __init__(self, path: Path, *, max_bytes: int = 16 << 20, backups: int = 3) -> None:
        if max_bytes < 1 or backups < 0:
            raise ValueError("max_bytes must be >= 1 and backups >= 0")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups

    def write(self, records: Iterable[dict]) -> int:
        """Append ``records``; returns how many were written."""
        lines = [(json.dumps(r, separators=(",", ":"), ensure_ascii=False) + "\n").encode("utf-8") for r in records]
        if not lines:
            return 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        size = self.path.stat().st_size if self.path.exists() else 0
        out = open(self.path, "ab")  # noqa: SIM115 - reopened after each rotation
        try:
            for line in lines:
                if size and size + len(line) > self.max_bytes:
                    out.close()
                    self._rotate()
                    out = open(self.path, "ab")  # noqa: SIM115
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
