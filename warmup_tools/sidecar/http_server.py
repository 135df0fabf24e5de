"""The sidecar's HTTP plumbing: a fixed pool of worker threads, a deadline on every socket operation.

``http.server.ThreadingHTTPServer`` starts one thread per connection, without a limit, and its sockets
have no timeout: a client that opens connections and never finishes a request holds a thread each,
forever. Here a fixed number of workers serve the connections the accept loop hands them through a small
bounded queue; when every worker is busy and the queue is full, the accept loop waits and new connections
wait in the kernel's listen backlog. Every read and write of a connection has a deadline, so a half-sent
request, or a client that stops reading, frees its worker after ``timeout_s``.

NOTE: stdlib rather than uvicorn: the sidecar answers four GET endpoints from in-memory state, and the
stdlib server with a bounded pool and socket deadlines is what it needs. uvicorn's ``limit_concurrency``
answers 503 once the limit is reached (a burst of half-sent connections would fail the liveness probe at
once) and it has no deadline for a request that is never completed.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

LOGGER = logging.getLogger(__name__)


class BoundedHTTPServer(HTTPServer):
    """An HTTPServer whose connections are served by ``workers`` threads, each socket with ``timeout_s``."""

    #: Connections the kernel keeps waiting while every worker is busy.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], *, workers: int,
                 timeout_s: float, name: str = "http") -> None:
        if workers < 1 or not timeout_s > 0:
            raise ValueError("workers must be >= 1 and timeout_s positive")
        super().__init__(address, handler)
        self.timeout_s = timeout_s
        self._closing = threading.Event()
        # NOTE: maxsize bounds the accepted connections waiting for a worker (each holds a descriptor).
        self._connections: queue.Queue[tuple[socket.socket, object] | None] = queue.Queue(maxsize=workers)
        self._workers = [threading.Thread(target=self._work, name=f"{name}-worker-{i}", daemon=True)
                         for i in range(workers)]
        for worker in self._workers:
            worker.start()

    def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        """Hand an accepted connection to a worker; waits while every worker is busy and the queue is full."""
        request.settimeout(self.timeout_s)
        while not self._closing.is_set():
            with contextlib.suppress(queue.Full):
                self._connections.put((request, client_address), timeout=self.timeout_s)
                return
        self.shutdown_request(request)

    def shutdown(self) -> None:
        """Stop the accept loop (connections waiting for a worker are closed unserved)."""
        self._closing.set()
        super().shutdown()

    def server_close(self) -> None:
        self._closing.set()
        super().server_close()
        for _ in self._workers:
            self._connections.put(None)
        for worker in self._workers:
            worker.join(self.timeout_s * 2)

    def handle_error(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        # NOTE: a client that stopped reading (a write past the deadline) is not a server error.
        LOGGER.debug("connection from %s ended with an error", client_address, exc_info=True)

    def _work(self) -> None:
        while True:
            item = self._connections.get()
            if item is None:
                return
            request, client_address = item
            try:
                if not self._closing.is_set():
                    self.finish_request(request, client_address)
            except Exception:  # noqa: BLE001 - one connection's failure must not end a worker
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)
