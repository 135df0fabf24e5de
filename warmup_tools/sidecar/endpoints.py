"""``/ready``, ``/live`` and ``/status`` over stdlib HTTP, answered from the monitor's last round.

- ``/ready`` (readinessProbe, startupProbe): 200 ``{"ready": true, "temperature": "warm" | "hot", "adapters":
  {name: temperature}}`` when the server and every model
  passed their last probe and (with a control folder) every live adapter's planned hot set is resident
  above the coverage threshold on every instance; otherwise 503 with ``{"ready": false, "reason": ...}``.
- ``/live`` (livenessProbe): 200 while this process serves HTTP; it says nothing about Triton, so a
  Triton outage makes the pod unready, never restarts the sidecar.
- ``/status``: per model state, last probe result and latency, last recovery, and warm coverage per
  lora_adapter instance and adapter (source, planned and resident blocks, shortfall), and each instance's
  live check of its plan's pins (``pins``: state, pinned blocks, pin hits against shadow hits, per adapter).
- ``/metrics``: the same as Prometheus text (ready, per model health, probe latency, recoveries, the
  temperature of the replica and of each adapter, and its transitions, the live check's counts), for the
  dashboard beside
  Triton's own ``/metrics``.

Neither names a plan id (:func:`public_status`): the endpoints answer anyone who reaches the port, and a
plan id is what a warm-up sample carries. The sidecar's log and the control folder keep them.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

from warmup_tools.control.plan_control import PIN_STATES
from warmup_tools.sidecar.http_server import BoundedHTTPServer
from warmup_tools.sidecar.monitor import Monitor

LOGGER = logging.getLogger(__name__)


class SidecarHttpServer:
    """A :class:`BoundedHTTPServer` on its own thread; ``port=0`` picks a free port (see :attr:`port`).

    ``workers`` connections are served at once, each read and write with a ``timeout_s`` deadline.
    """

    def __init__(self, monitor: Monitor, host: str = "127.0.0.1", port: int = 8080, *, workers: int = 8,
                 timeout_s: float = 5.0) -> None:
        handler = type("Handler", (_Handler,), {"monitor": monitor})
        self._server = BoundedHTTPServer((host, port), handler, workers=workers, timeout_s=timeout_s,
                                         name="sidecar-http")
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
            replica, adapters = self.monitor.temperature()
            body: dict[str, object] = {"ready": readiness.ready, "temperature": replica, "adapters": adapters}
            if not readiness.ready:
                body["reason"] = readiness.reason
            self._json(HTTPStatus.OK if readiness.ready else HTTPStatus.SERVICE_UNAVAILABLE, body)
        elif path == "/live":
            self._json(HTTPStatus.OK, {"live": True})
        elif path == "/status":
            self._json(HTTPStatus.OK, public_status(self.monitor.snapshot()))
        elif path == "/metrics":
            data = prometheus_text(public_status(self.monitor.snapshot())).encode()
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self._json(HTTPStatus.NOT_FOUND,
                       {"error": f"no such endpoint {path!r}; try /ready, /live, /status, /metrics"})

    def _json(self, status: HTTPStatus, body: dict[str, object]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        LOGGER.debug("%s %s", self.address_string(), format % args)


#: Keys of the monitor's snapshot that never leave the sidecar: plan ids (and a re-plan's previous one).
PRIVATE_KEYS = frozenset({"plan_id", "previous"})


#: A plan history id (the digest a stored plan is named by), as verdicts and errors quote it.
_HISTORY_ID = re.compile(r"\b[0-9a-f]{16}\b")


def public_status(status: object) -> Any:
    """The monitor's snapshot without :data:`PRIVATE_KEYS`, at any depth, and without their values or a plan history
    id inside any text (a canary verdict's reason, an error): each is written ``<plan>``."""
    hidden: set[str] = set()
    _private_values(status, hidden)
    return _public(status, sorted(hidden, key=len, reverse=True))


def _private_values(status: object, into: set[str]) -> None:
    if isinstance(status, dict):
        for key, value in status.items():
            if key in PRIVATE_KEYS and isinstance(value, str) and value:
                into.add(value)
            _private_values(value, into)
    elif isinstance(status, list):
        for value in status:
            _private_values(value, into)


def _public(status: object, hidden: list[str]) -> Any:
    if isinstance(status, dict):
        return {key: _public(value, hidden) for key, value in status.items() if key not in PRIVATE_KEYS}
    if isinstance(status, list):
        return [_public(value, hidden) for value in status]
    if isinstance(status, str):
        for value in hidden:
            status = status.replace(value, "<plan>")
        return _HISTORY_ID.sub("<plan>", status)
    return status


def prometheus_text(status: dict[str, object]) -> str:
    """``/status`` as Prometheus exposition text (prometheus-client's own renderer, a private registry)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    registry = CollectorRegistry()
    registry.register(_TemperatureCollector(dict(status.get("temperature") or {})))
    Gauge("warmup_sidecar_ready", "1 when /ready answers 200", registry=registry).set(1 if status.get("ready") else 0)
    healthy = Gauge("warmup_sidecar_model_healthy", "1 when the model passed its last probe", ["model"],
                    registry=registry)
    latency = Gauge("warmup_sidecar_probe_latency_seconds", "Latency of the model's last probe", ["model"],
                    registry=registry)
    recoveries = Gauge("warmup_sidecar_recoveries", "Reloads of the model that brought it back", ["model"],
                       registry=registry)
    failed = Gauge("warmup_sidecar_failed_recoveries", "Reloads of the model that did not", ["model"],
                   registry=registry)
    coverage = Gauge("warmup_sidecar_warm_coverage",
                     "Share of the planned hot set resident, per lora_adapter instance and adapter",
                     ["instance", "adapter"], registry=registry)
    short = Gauge("warmup_sidecar_warm_coverage_shortfall",
                  "1 when the instance says the planned hot set cannot be resident (budget), per adapter",
                  ["instance", "adapter"], registry=registry)
    pin_gauges = {key: Gauge(f"warmup_sidecar_{name}", doc, ["instance", "adapter"], registry=registry)
                  for key, name, doc in _PIN_GAUGES}
    released = Counter("warmup_sidecar_pins_released", "KV blocks whose pins the live check released early, per "
                       "lora_adapter instance and adapter, since the instance's plan became active (a new plan "
                       "starts it again, like a restart)", ["instance", "adapter"], registry=registry)
    pin_state = Gauge("warmup_sidecar_pin_state", "1 for the state of the live check of the plan's pins on a "
                      "lora_adapter instance (none, pinned, expired, released)", ["instance", "state"],
                      registry=registry)
    for instance, entry in dict(dict(status.get("coverage") or {}).get("instances") or {}).items():
        if entry.get("stale"):
            continue
        for adapter, cov in entry["adapters"].items():
            coverage.labels(instance, adapter).set(cov["coverage"])
            short.labels(instance, adapter).set(1 if cov["shortfall"] else 0)
        pins = entry.get("pins")
        if not isinstance(pins, dict):
            continue
        for state in PIN_STATES:
            pin_state.labels(instance, state).set(1 if pins["state"] == state else 0)
        for adapter, counts in pins["adapters"].items():
            for key, gauge in pin_gauges.items():
                gauge.labels(instance, adapter).set(counts[key])
            released.labels(instance, adapter).inc(counts["released_blocks"])
    canary = status.get("canary")
    if isinstance(canary, dict):
        Gauge("warmup_canary_active", "1 while a plan is on trial on a canary instance of this replica",
              registry=registry).set(1 if canary.get("trial") else 0)
        verdicts = Counter("warmup_canary_verdicts", "Plans on trial promoted or rolled back since the sidecar "
                           "started", ["verdict"], registry=registry)
        for verdict, count in dict(canary.get("counts") or {}).items():
            verdicts.labels(verdict).inc(count)
        cold = Gauge("warmup_canary_cold_share", "Cold share of the running trial's requests: the canary "
                     "instance's and the other instances'", ["side"], registry=registry)
        for side in ("canary", "rest"):
            if canary.get("trial"):
                cold.labels(side).set(canary["trial"][side]["cold_share"])
    for model, health in dict(status.get("models") or {}).items():
        healthy.labels(model).set(1 if health.get("state") == "healthy" else 0)
        probe = health.get("last_probe") or {}
        latency.labels(model).set(float(probe.get("latency_ms") or 0.0) / 1000)
        recoveries.labels(model).set(health.get("recoveries", 0))
        failed.labels(model).set(health.get("failed_recoveries", 0))
    return generate_latest(registry).decode()


#: The live check's per-adapter counts the sidecar exports as gauges: the report's key, the metric's name, its help.
_PIN_GAUGES = (
    ("pinned_blocks", "pinned_blocks", "KV blocks pinned under the plan now, per lora_adapter instance and adapter"),
    ("pin_hits", "pin_hits", "Block hits on blocks pinned under the plan since it became active, per lora_adapter "
     "instance and adapter"),
    ("shadow_hits", "pin_shadow_hits", "Block hits the blocks evicted to make room for the plan's pins would have "
     "had since it became active (the live check's shadow list), per lora_adapter instance and adapter"),
    ("expired_blocks", "pins_expired", "KV blocks whose pin ended at its retention since the plan became active, "
     "per lora_adapter instance and adapter"),
)

#: ``warmup_temperature``'s value per state (a router prefers the highest).
TEMPERATURE_LEVELS = {"cold": 0, "warm": 1, "hot": 2}


class _TemperatureCollector:
    """``warmup_temperature`` (0 cold, 1 warm, 2 hot) per scope and ``warmup_temperature_transitions_total``
    by scope, from and to state, from ``/status``'s ``temperature`` entry."""

    def __init__(self, temperature: dict[str, Any]) -> None:
        self._temperature = temperature

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        if not self._temperature:
            return
        gauge = GaugeMetricFamily("warmup_temperature", "Service temperature: 0 cold (not serving), 1 warm, 2 hot "
                                  "(planned hot set resident and probe TTFT within their bounds)",
                                  labels=["scope", "adapter"])
        gauge.add_metric(["replica", ""], TEMPERATURE_LEVELS[self._temperature["replica"]["state"]])
        for adapter, entry in self._temperature["adapters"].items():
            gauge.add_metric(["adapter", adapter], TEMPERATURE_LEVELS[entry["state"]])
        yield gauge
        counter = CounterMetricFamily("warmup_temperature_transitions", "Temperature transitions since the "
                                      "sidecar started, by scope (replica, adapter) and from and to state",
                                      labels=["scope", "from", "to"])
        for row in self._temperature["transitions"]:
            counter.add_metric([row["scope"], row["from"], row["to"]], row["count"])
        yield counter
