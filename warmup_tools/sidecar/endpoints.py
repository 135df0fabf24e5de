"""``/ready``, ``/live`` and ``/status`` over stdlib HTTP, answered from the monitor's last round.

- ``/ready`` (readinessProbe, startupProbe): 200 ``{"ready": true}`` when the server and every model
  passed their last probe; otherwise 503 with ``{"ready": false, "reason": ...}``.
- ``/live`` (livenessProbe): 200 while this process serves HTTP; it says nothing about Triton, so a
  Triton outage makes the pod unready, never restarts the sidecar.
- ``/status``: per model state, last probe result and latency, last recovery, the warm-up plan id.
"""

from __future__ import annotations

import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from warmup_tools.sidecar.monitor import Monitor

LOGGER = logging.getLogger(__name__)


class SidecarHttpServer:
    """A ThreadingHTTPServer on its own thread; ``port=0`` picks a free port (see :attr:`port`)."""

    def __init__(self, monitor: Monitor, host: str = "127.0.0.1", port: int = 8080) -> None:
        handler = type("Handler", (_Handler,), {"monitor": monitor})
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self._server.server_address[0]}:{self.port}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._server.serve_forever, name="sidecar-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(10)
            self._thread = None
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    monitor: Monitor
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/ready":
            readiness = self.monitor.readiness()
            body: dict[str, object] = {"ready": readiness.ready}
            if not readiness.ready:
                body["reason"] = readiness.reason
            self._json(HTTPStatus.OK if readiness.ready else HTTPStatus.SERVICE_UNAVAILABLE, body)
        elif path == "/live":
            self._json(HTTPStatus.OK, {"live": True})
        elif path == "/status":
            self._json(HTTPStatus.OK, self.monitor.snapshot())
        else:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint {path!r}; try /ready, /live, /status"})

    def _json(self, status: HTTPStatus, body: dict[str, object]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        LOGGER.debug("%s %s", self.address_string(), format % args)
