"""free_port: ports below the kernel's ephemeral range (outgoing connections cannot take them before the server
binds), bindable when handed out, and never the same one twice in a process."""

from __future__ import annotations

import socket

from warmup_tools.server import process
from warmup_tools.server.process import free_port


def test_ports_come_from_below_the_ephemeral_range_and_are_never_handed_out_twice():
    low = process._ephemeral_low()
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(process._PORT_FLOOR <= p < low for p in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", ports[0]))  # free when handed out: a server can bind it


def test_a_port_in_use_is_skipped(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        draws = iter([taken - process._PORT_FLOOR, *(p - process._PORT_FLOOR for p in range(12345, 12545))])
        monkeypatch.setattr(process, "_ephemeral_low", lambda: 65536)
        monkeypatch.setattr(process.secrets, "randbelow", lambda n: next(draws))
        monkeypatch.setattr(process, "_handed_out", set())
        port = free_port()
    assert port != taken and 12345 <= port < 12545
