"""What the sidecar does when a stub dies: reload its model, or restart tritonserver.

A request that a decoupled model (lora_adapter) is already serving when its stub dies never gets a final
response from Triton 2.51: the Python backend hands each such request's response factory to the stub and
keeps no list of them, the factory holds the model alive, and neither the unload nor the reload sends
anything (docs/faults.md). Only closing the client's connection ends it, and only tritonserver's exit
closes every connection at once, whichever client holds it. A restart costs every request in flight on
the server and a start-up, so the sidecar restarts only where it buys something: with ``on_stub_death``
``restart``, for a model that is decoupled (or whose configuration cannot be read). A model that is not
decoupled is reloaded, as before: Triton answers its requests with the stub error.

NOTE: the dead instance's scheduler gauges on Triton's ``/metrics`` (running and waiting sequences,
which keep the dead stub's last values) are read for the log only. They lag a request by its first
step: a stub killed right after a stream's first token was seen reporting 0, and reloading on that
left the stream to its client's deadline. A zero cannot prove the instance held nothing.

:func:`decide` is the rule (no I/O); :class:`StubDeathFacts` reads what it needs from the server.
"""

from __future__ import annotations

import dataclasses
import logging
import math

LOGGER = logging.getLogger(__name__)

#: The scheduler's gauges per instance, as lora_adapter exports them (triton/metrics.py, SchedulerMetrics).
RUNNING_SEQUENCES = "warmup_scheduler_running_sequences"
WAITING_SEQUENCES = "warmup_scheduler_waiting_sequences"
#: The tokens a model generated, by adapter (SchedulerMetrics): what the monitor reads as the model's progress.
OUTPUT_TOKENS = "warmup_output_tokens_total"

RESTART = "restart"
RELOAD = "reload"


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """``action`` (:data:`RESTART` or :data:`RELOAD`) and why, for the log and ``/status``."""

    action: str
    reason: str


def decide(mode: str, model: str, decoupled: bool | None, in_flight: int | None) -> Decision:
    """What to do about ``model``'s dead stub. ``decoupled``/``in_flight``: None when unknown; ``in_flight``
    (the gauges' last values) is only reported (see the note above)."""
    if mode != RESTART:
        return Decision(RELOAD, "on_stub_death is reload")
    if decoupled is False:
        return Decision(RELOAD, f"{model} is not decoupled: Triton answers its requests with the stub error")
    kind = "decoupled" if decoupled else "possibly decoupled (its configuration could not be read)"
    gauges = "unknown" if in_flight is None else str(in_flight)
    return Decision(RESTART, f"{model} is {kind}: Triton never answers the requests its dead instance held "
                             f"(its gauges last said {gauges})")


class StubDeathFacts:
    """Reads from tritonserver whether a model is decoupled and how many sequences an instance held.

    ``http_url`` is Triton's HTTP endpoint (``host:port``; the model configuration, which comes from the
    model's config.pbtxt), ``metrics_url`` its ``/metrics``. Every read is bounded by ``timeout_s`` and
    answers None when it fails.
    """

    def __init__(self, http_url: str, metrics_url: str | None, timeout_s: float = 1.0) -> None:
        import requests

        self.http_url = http_url
        self.metrics_url = metrics_url
        self.timeout_s = timeout_s
        self._session = requests.Session()

    def decoupled(self, model: str) -> bool | None:
        import requests

        try:
            response = self._session.get(f"http://{self.http_url}/v2/models/{model}/config", timeout=self.timeout_s)
            if response.status_code != 200:
                return None
            policy = response.json().get("model_transaction_policy") or {}
        except (requests.RequestException, ValueError, AttributeError) as exc:
            LOGGER.warning("cannot read %s's configuration: %s", model, exc)
            return None
        return bool(policy.get("decoupled", False))

    def in_flight(self, model: str, instance: str) -> int | None:
        """Running plus waiting sequences of ``instance`` (its last values), None when not on /metrics."""
        if self.metrics_url is None or not instance:
            return None
        import requests
        from prometheus_client.parser import text_string_to_metric_families

        try:
            text = self._session.get(self.metrics_url, timeout=self.timeout_s).text
            values = [sample.value for family in text_string_to_metric_families(text)
                      for sample in family.samples
                      if sample.name in (RUNNING_SEQUENCES, WAITING_SEQUENCES)
                      and sample.labels.get("model") == model and sample.labels.get("instance") == instance]
        except (requests.RequestException, ValueError) as exc:
            LOGGER.warning("cannot read %s's sequences on /metrics: %s", instance, exc)
            return None
        if len(values) != 2 or not all(math.isfinite(v) and v >= 0 for v in values):
            return None  # the instance never reported both gauges
        return int(sum(values))

    def output_tokens(self) -> dict[str, float] | None:
        """Tokens each model generated so far (its adapters summed), None when ``/metrics`` cannot be read. The
        counts are sent by the scheduler every ``metrics_flush_s`` while it runs (and when it falls idle)."""
        if self.metrics_url is None:
            return None
        import requests
        from prometheus_client.parser import text_string_to_metric_families

        totals: dict[str, float] = {}
        try:
            text = self._session.get(self.metrics_url, timeout=self.timeout_s).text
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == OUTPUT_TOKENS and math.isfinite(sample.value):
                        model = sample.labels.get("model", "")
                        totals[model] = totals.get(model, 0.0) + sample.value
        except (requests.RequestException, ValueError) as exc:
            LOGGER.warning("cannot read the generated tokens on /metrics: %s", exc)
            return None
        return totals

    def close(self) -> None:
        self._session.close()
