"""Atomic file writes: a reader sees the old complete file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from pathlib import Path

#: Permission bits of a file :func:`write_atomic` creates: owner only. Plans, stanza data, desired.json and
#: the statuses carry prompt text and tenant names from the request logs, which are 0600 themselves.
PRIVATE_MODE = 0o600


def write_atomic(path: Path, data: bytes | str, *, mode: int = PRIVATE_MODE, min_mtime_ns: int | None = None) -> None:
    """Write ``data`` to a temporary file next to ``path``, fsync it and rename it over ``path``.

    ``mode`` is the new file's permission bits (owner only unless a caller says otherwise, for a file that
    carries no prompt text and must be readable by another user); ``min_mtime_ns`` keeps its mtime from
    going backwards (readers that poll by ``stat`` must see a change).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(payload)
            file.flush()
            # NOTE: set explicitly, whatever the umask: the bits are part of the file's contract.
            os.fchmod(file.fileno(), mode)
            os.fsync(file.fileno())
        if min_mtime_ns is not None and os.stat(tmp).st_mtime_ns < min_mtime_ns:
            os.utime(tmp, ns=(min_mtime_ns, min_mtime_ns))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable; not possible on every filesystem
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def stat_key(path: Path) -> tuple[int, int, int] | None:
    """What tells a replaced or rewritten file apart (inode, size, mtime); None when it does not exist."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def read_or_create_secret(path: Path, nbytes: int = 32) -> bytes:
    """The random value in ``path`` (hex, owner only), created with ``nbytes`` random bytes if missing.

    Every process that reads the same path gets the same value: the first creates it, atomically and
    without replacing one another process created first (a hard link fails if the name exists).
    """
    path = Path(path)
    try:
        return _read_secret(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(secrets.token_hex(nbytes).encode() + b"\n")
            os.fchmod(file.fileno(), PRIVATE_MODE)
            file.flush()
            os.fsync(file.fileno())
        with contextlib.suppress(FileExistsError):  # another process was first: use its value
            os.link(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return _read_secret(path)


def _read_secret(path: Path) -> bytes:
    with open(path, "rb") as file:
        data = file.read(4097).strip()
    if len(data) < 32:
        raise ValueError(f"{path} holds fewer than 32 bytes; remove it to have a new one made")
    return data
