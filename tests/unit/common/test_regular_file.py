"""Reading an untrusted file whole (warmup_tools/common/regular_file.py): regular files only, without blocking."""

from __future__ import annotations

import os
import socket

import pytest

from warmup_tools.common import regular_file
from warmup_tools.common.regular_file import FileTooLarge, NotARegularFile, read_regular


def test_a_regular_file_is_read_whole_up_to_its_bound_inclusive(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    raw, st = read_regular(path, 10)
    assert raw == b"x" * 10 and st.st_size == 10
    with pytest.raises(FileTooLarge, match=r"^larger than 9 bytes \(10 bytes\)$") as info:
        read_regular(path, 9)
    assert (info.value.size, info.value.max_bytes) == (10, 9) and isinstance(info.value, ValueError)
    path.write_bytes(b"")
    assert read_regular(path, 0)[0] == b""


def test_a_fifo_socket_or_directory_is_refused_at_once(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # no writer: a plain open() would wait for one forever
    with pytest.raises(NotARegularFile, match=r"^not a regular file \(a FIFO\)$"):
        read_regular(fifo, 100)
    with pytest.raises(NotARegularFile, match=r"not a regular file \(a directory\)"):
        read_regular(tmp_path, 100)
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tmp_path / "sock"))
        with pytest.raises(OSError):  # a socket cannot even be opened
            read_regular(tmp_path / "sock", 100)
    assert issubclass(NotARegularFile, OSError)


def test_a_symbolic_link_is_refused_unless_followed_and_then_only_to_a_regular_file(tmp_path):
    target, link, to_fifo = tmp_path / "target", tmp_path / "link", tmp_path / "to-fifo"
    target.write_bytes(b"{}")
    link.symlink_to(target)
    with pytest.raises(NotARegularFile, match="a symbolic link, not a regular file"):
        read_regular(link, 100)
    assert read_regular(link, 100, follow_symlinks=True)[0] == b"{}"
    os.mkfifo(tmp_path / "fifo")
    to_fifo.symlink_to(tmp_path / "fifo")
    with pytest.raises(NotARegularFile, match="a FIFO"):
        read_regular(to_fifo, 100, follow_symlinks=True)
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "missing", 100)


def test_a_file_that_grows_after_fstat_is_read_only_one_byte_past_its_bound(tmp_path, monkeypatch):
    path = tmp_path / "f"
    path.write_bytes(b"x" * (3 << 20))
    real_fstat, reads = os.fstat, []

    def empty(fd):  # what fstat said before the file grew
        st = real_fstat(fd)
        return os.stat_result((*st[:6], 0, *st[7:]))

    monkeypatch.setattr(regular_file.os, "fstat", empty)
    real_read = os.read
    monkeypatch.setattr(regular_file.os, "read", lambda fd, n: reads.append(n) or real_read(fd, n))
    with pytest.raises(FileTooLarge, match=r"\(1048578 bytes\)"):
        read_regular(path, (1 << 20) + 1)
    assert reads == [1 << 20, 2] and sum(reads) == (1 << 20) + 2
