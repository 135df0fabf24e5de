"""Reading an untrusted file whole: a regular file only, opened without blocking, read up to a bound.

A shared folder (KV snapshots, the control folder) is writable by whoever can write it, and a plain
``open()`` of a FIFO there waits for a writer that never comes: the reader (an instance's restore at load,
a control-file watcher) hangs for good. :func:`read_regular` opens with ``O_NONBLOCK`` (a FIFO opens at
once, a device or socket does not stall), optionally ``O_NOFOLLOW``, checks with ``fstat`` on the open
descriptor (what it checks is what it reads: no stat-then-open race) that it is a regular file, and reads
at most ``max_bytes``. Nothing here imports anything above :mod:`warmup_tools.common`.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


class NotARegularFile(OSError):
    """The path is a FIFO, socket, device or directory (or, without ``follow_symlinks``, a symbolic link)."""

    def __str__(self) -> str:
        return str(self.strerror)  # what it is, without an errno that says less


class FileTooLarge(ValueError):
    """The file holds more than the bound the reader took (``size``: what ``fstat`` said, or the bytes read)."""

    def __init__(self, size: int, max_bytes: int) -> None:
        super().__init__(f"larger than {max_bytes} bytes ({size} bytes)")
        self.size = size
        self.max_bytes = max_bytes


def read_regular(path: Path, max_bytes: int, *, follow_symlinks: bool = False) -> tuple[bytes, os.stat_result]:
    """The bytes of the regular file at ``path`` (at most ``max_bytes``) and its ``fstat``.

    Raises :class:`NotARegularFile` (an ``OSError``) for anything but a regular file, :class:`FileTooLarge`
    (a ``ValueError``) when it holds more than ``max_bytes`` (by its size, or by what a read returned: a file
    that grows while read), and ``OSError`` as ``open`` and ``read`` do (``ELOOP`` for a symbolic link when
    ``follow_symlinks`` is false).
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_symlinks:
            raise NotARegularFile(errno.ELOOP, "a symbolic link, not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFile(errno.EINVAL, f"not a regular file ({_kind(st.st_mode)})")
        if st.st_size > max_bytes:
            raise FileTooLarge(st.st_size, max_bytes)
        chunks, left = [], max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        raw = b"".join(chunks)
        if len(raw) > max_bytes:
            raise FileTooLarge(len(raw), max_bytes)
        return raw, st
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a plain file"
