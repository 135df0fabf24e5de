"""Rolling re-plan on a schedule: the planner over the last hours of request logs, applied live.

Every ``replan_interval_s`` (off by default) a thread of the sidecar runs
:meth:`~warmup_tools.planning.live.RollingPlanner.run_once`: the plan now served (the control folder's
``plan.json``) is the previous plan, the new one is applied through the control folder (each instance
warms what it adds, unpins what it drops) and written as the repository's stanzas for the next start.
A run that fails is logged and shown in ``/status``; the next one is tried at the next interval.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable

from warmup_tools.sidecar.background import BackgroundThread

LOGGER = logging.getLogger(__name__)


class Replanner:
    """Calls ``run_once`` (returns a :class:`~warmup_tools.planning.live.ReplanResult`) every ``interval_s``."""

    def __init__(self, run_once: Callable[[], Any], interval_s: float) -> None:
        self._run_once = run_once
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last: dict[str, Any] | None = None
        self._error = ""
        self._runs = 0
        self._worker = BackgroundThread("sidecar-replan")

    def run_once(self) -> None:
        try:
            result = self._run_once()
        except Exception as exc:  # a failed re-plan keeps the plan served now
            LOGGER.exception("rolling re-plan failed; the plan served now stays")
            with self._lock:
                self._error, self._runs = f"{type(exc).__name__}: {exc}", self._runs + 1
            return
        with self._lock:
            self._last, self._error, self._runs = dataclasses.asdict(result), "", self._runs + 1

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"interval_s": self.interval_s, "runs": self._runs, "last": self._last, "error": self._error}

    def start(self) -> None:
        self._worker.start(self._loop)

    def stop(self, timeout: float = 30.0) -> None:
        self._worker.stop(timeout)

    def _loop(self) -> None:
        while not self._worker.stopping.wait(self.interval_s):
            self.run_once()
