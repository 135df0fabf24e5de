"""A TCP forwarder a test can cut: the network between two real processes, failed on purpose.

Placed between a client and a server (``Forwarder(target_port)``; the client connects to ``forwarder.port``), it
copies bytes both ways until :meth:`Forwarder.cut` closes every open connection and refuses new ones (each is
accepted and closed at once, as a broken link would answer), and :meth:`Forwarder.mend` lets them through again.
Neither process is touched: what the test sees is what they do when their connection breaks.
"""

from __future__ import annotations

import socket
import threading


class Forwarder:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self._listener = socket.create_server((host, 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._cut = False
        self._stopped = False
        self._thread = threading.Thread(target=self._accept, name="tcp-forwarder", daemon=True)
        self._thread.start()

    def cut(self) -> None:
        """Close every connection through the forwarder and refuse new ones until :meth:`mend`."""
        with self._lock:
            self._cut = True
            dropped, self._open = self._open, set()
        for sock in dropped:
            _close(sock)

    def mend(self) -> None:
        with self._lock:
            self._cut = False

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        self.cut()
        _close(self._listener)
        self._thread.join(timeout=10)

    def __enter__(self) -> Forwarder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # stopped
            with self._lock:
                refuse = self._cut or self._stopped
            if refuse:
                _close(client)
                continue
            try:
                server = socket.create_connection(self.target, timeout=10)
                server.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._open.update((client, server))
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with self._lock:
                    self._open.discard(sock)
                _close(sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
