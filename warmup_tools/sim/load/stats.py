"""Reading a Locust run's final statistics (``--json-file``) without importing Locust.

Locust's ``--csv`` files are rewritten once a second and not again at shutdown, so the last second of
a run can be missing from them; the JSON file is written at shutdown from the final statistics.
(Importing ``locust`` monkey-patches the whole process for gevent, so this module only reads JSON.)
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path


@dataclasses.dataclass(frozen=True, slots=True)
class LocustEntry:
    """One named request type: counts and the response-time histogram (ms, as Locust rounds them)."""

    name: str
    requests: int
    failures: int
    max_ms: float
    histogram: dict[float, int]

    def percentile(self, q: float) -> float:
        """Nearest-rank percentile (``q`` in [0, 1]) of the recorded response times, in ms."""
        if not self.histogram:
            return 0.0
        rank = max(1, math.ceil(q * sum(self.histogram.values())))
        seen = 0
        for value in sorted(self.histogram):
            seen += self.histogram[value]
            if seen >= rank:
                return value
        return max(self.histogram)


def read_stats_json(path: str | Path) -> dict[str, LocustEntry]:
    """``{name: entry}`` from the file Locust writes with ``--json-file <prefix>`` (``<prefix>.json``)."""
    path = Path(path)
    if path.suffix != ".json":
        path = path.with_name(path.name + ".json")
    entries: dict[str, LocustEntry] = {}
    for raw in json.loads(path.read_text()):
        histogram = {float(k): int(v) for k, v in (raw.get("response_times") or {}).items()}
        entries[raw["name"]] = LocustEntry(
            name=raw["name"], requests=int(raw["num_requests"]), failures=int(raw["num_failures"]),
            max_ms=float(raw.get("max_response_time") or 0.0), histogram=histogram)
    return entries
