"""Heat sampling: request counts per (cluster, adapter) over sliding windows, and a rotating JSON-lines log.

A :class:`HeatSampler` counts (possibly sampled) requests in time buckets of ``bucket_s`` seconds; a window
of ``w`` seconds is the sum of the last ``ceil(w / bucket_s)`` buckets, the current one included, so it
covers between ``w - bucket_s`` and ``w`` seconds of history. Closed buckets are drained as compact
records that a :class:`HeatLogWriter` appends to disk.

NOTE: the heat log is an operational metric (dashboards, ad-hoc analysis of what is hot right now),
not the planner's input: the planner learns from the request log, which has the prompt text and the
exact tokens a KV prefix needs (:mod:`warmup_tools.common.records`). Clusters in the heat log are the
embedding step's online clusters, which a plan may renumber.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import OrderedDict
from typing import Callable, Sequence

from warmup_tools.common.jsonl import RotatingJsonLines

#: Cluster id under which requests are counted once ``max_keys`` distinct keys are live.
OVERFLOW_CLUSTER = -1
#: Adapter name of the last-resort overflow key.
OVERFLOW_ADAPTER = "*"
#: Overflow keys (-1, adapter) allowed beyond ``max_keys``, so each adapter keeps its own overflow count.
OVERFLOW_ADAPTER_KEYS = 64

Key = tuple[int, str]


@dataclasses.dataclass(frozen=True, slots=True)
class HeatEntry:
    cluster_id: int
    adapter: str
    window_s: float
    #: Estimated requests (sampled counts scaled by their weights).
    requests: float
    #: Estimated prompt tokens (sampled tokens scaled by their weights).
    prompt_tokens: float


@dataclasses.dataclass(slots=True)
class HeatStats:
    records: int = 0
    #: Records counted under an overflow key because ``max_keys`` keys were live.
    overflowed: int = 0
    #: Closed buckets dropped (older than the largest window) before anyone drained them.
    undrained_dropped: int = 0
    live_keys: int = 0


class HeatSampler:
    """Per (cluster, adapter) request and prompt-token counts over sliding windows.

    Callers that sample requests at ``sample_rate`` record each sampled one; its weight defaults to
    ``1 / sample_rate`` so the counts estimate all traffic without bias.
    """

    def __init__(self, windows_s: Sequence[float] = (60, 300, 3600), bucket_s: float = 10.0,
                 clock: Callable[[], float] = time.time, sample_rate: float = 1.0, *,
                 max_keys: int = 10_000) -> None:
        if bucket_s <= 0:
            raise ValueError("bucket_s must be > 0")
        if not windows_s or any(w <= 0 for w in windows_s):
            raise ValueError("windows_s must be a non-empty list of positive durations")
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError("sample_rate must lie in (0, 1]")
        if max_keys < 1:
            raise ValueError("max_keys must be >= 1")
        self.windows_s = tuple(sorted(float(w) for w in windows_s))
        self.bucket_s = float(bucket_s)
        self.sample_rate = float(sample_rate)
        self.max_keys = max_keys
        self.stats = HeatStats()
        self._clock = clock
        self._lock = threading.Lock()
        #: Buckets a window spans, the current one included.
        self._spans = [max(1, math.ceil(w / self.bucket_s - 1e-9)) for w in self.windows_s]
        self._retained = self._spans[-1]
        #: bucket index -> key -> [requests, prompt tokens]; oldest first.
        self._buckets: OrderedDict[int, dict[Key, list[float]]] = OrderedDict()
        #: key -> number of retained buckets holding it.
        # NOTE: the key cap bounds memory whatever the stream of cluster ids or adapter names: at most
        # max_keys + OVERFLOW_ADAPTER_KEYS + 1 live keys, each in at most the retained buckets. A request
        # whose key is new once max_keys keys are live is counted under (-1, adapter), or under (-1, "*")
        # once OVERFLOW_ADAPTER_KEYS more keys are live too: totals stay right, only the split is lost.
        self._live: dict[Key, int] = {}
        self._current = -1
        self._drained_upto = -1

    def record(self, cluster_id: int, adapter: str, *, prompt_tokens: int = 0, weight: float | None = None) -> None:
        """Count one (sampled) request of ``cluster_id`` on ``adapter`` now."""
        w = 1.0 / self.sample_rate if weight is None else float(weight)
        with self._lock:
            self._advance()
            bucket = self._buckets.setdefault(self._current, {})
            key = (int(cluster_id), str(adapter))
            counts = bucket.get(key)
            if counts is None:
                key = self._admit_key(key)
                counts = bucket.get(key)
                if counts is None:
                    counts = bucket[key] = [0.0, 0.0]
                    self._live[key] = self._live.get(key, 0) + 1
            counts[0] += w
            counts[1] += w * prompt_tokens
            self.stats.records += 1
            self.stats.live_keys = len(self._live)

    def snapshot(self) -> list[HeatEntry]:
        """Counts per key for every window, for keys with non-zero counts in that window."""
        with self._lock:
            self._advance()
            entries: list[HeatEntry] = []
            newest_first = list(self._buckets.items())[::-1]
            totals: dict[Key, list[float]] = {}
            used = 0
            # windows are sorted, so each one adds older buckets to the totals of the one before
            for window_s, span in zip(self.windows_s, self._spans):
                oldest = self._current - span + 1
                while used < len(newest_first) and newest_first[used][0] >= oldest:
                    for key, (n, tokens) in newest_first[used][1].items():
                        total = totals.setdefault(key, [0.0, 0.0])
                        total[0] += n
                        total[1] += tokens
                    used += 1
                entries.extend(HeatEntry(key[0], key[1], window_s, n, tokens)
                               for key, (n, tokens) in sorted(totals.items()) if n)
            return entries

    def drain_log(self) -> list[dict]:
        """JSON-serialisable records of the buckets closed since the last drain, each bucket once:
        ``{"t": bucket start, "dt": bucket_s, "cluster": id, "adapter": a, "n": requests, "tokens": t}``."""
        with self._lock:
            self._advance()
            records = []
            for index, bucket in self._buckets.items():
                if index <= self._drained_upto or index >= self._current:
                    continue
                start = _compact(index * self.bucket_s)
                for (cluster_id, adapter), (n, tokens) in sorted(bucket.items()):
                    records.append({"t": start, "dt": _compact(self.bucket_s), "cluster": cluster_id,
                                    "adapter": adapter, "n": _compact(n), "tokens": _compact(tokens)})
            self._drained_upto = self._current - 1
            return records

    def __len__(self) -> int:
        """Number of live (cluster, adapter) keys."""
        return len(self._live)

    # -- helpers ----------------------------------------------------------------------------------------

    def _advance(self) -> None:
        """Move the current bucket to now and drop buckets older than the largest window."""
        # NOTE: a clock that steps back (wall time) keeps counting into the latest bucket, so closed and
        # drained buckets never change afterwards.
        self._current = max(self._current, int(self._clock() // self.bucket_s))
        oldest = self._current - self._retained + 1
        while self._buckets:
            index = next(iter(self._buckets))
            if index >= oldest:
                break
            bucket = self._buckets.pop(index)
            if index > self._drained_upto:
                self.stats.undrained_dropped += 1
            for key in bucket:
                self._live[key] -= 1
                if not self._live[key]:
                    del self._live[key]
        self.stats.live_keys = len(self._live)

    def _admit_key(self, key: Key) -> Key:
        if key in self._live or len(self._live) < self.max_keys:
            return key
        self.stats.overflowed += 1
        overflow = (OVERFLOW_CLUSTER, key[1])
        if overflow in self._live or len(self._live) < self.max_keys + OVERFLOW_ADAPTER_KEYS:
            return overflow
        return (OVERFLOW_CLUSTER, OVERFLOW_ADAPTER)


#: Appends drained heat records as JSON lines, rotating by size.
HeatLogWriter = RotatingJsonLines


def _compact(value: float) -> int | float:
    """An int when the float is integral, so the log stays short."""
    return int(value) if float(value).is_integer() else round(value, 6)
