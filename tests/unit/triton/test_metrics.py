"""Cache lookups on /metrics: local hits are counted in the stub and sent as one increment, every other lookup
at once, and nothing counted is lost (a fake pb_utils; each metric call of the real one is a round trip)."""

from __future__ import annotations

import threading
import types

from tests.unit.lora_adapter.test_responses import FakeFamily
from warmup_tools.triton.metrics import CacheMetrics, PeriodicFlush


class CountingMetric:
    def __init__(self):
        self.value, self.calls = 0, 0

    def increment(self, value):
        self.value += value
        self.calls += 1

    def set(self, value):
        self.value = value
        self.calls += 1


def cache_metrics(flush_every=256):
    metrics = CacheMetrics(types.SimpleNamespace(MetricFamily=FakeFamily), "tokenizer_cache", "tok_0",
                           flush_every=flush_every)
    metrics._results = {source: CountingMetric() for source in ("local", "shared", "miss")}
    metrics._entries, metrics._bytes = CountingMetric(), CountingMetric()
    return metrics


STATS = types.SimpleNamespace(entries=3, bytes_used=300)


def test_local_hits_wait_and_any_other_lookup_sends_them_first():
    metrics = cache_metrics()
    for _ in range(5):
        metrics.record("local", STATS)
    hits = metrics._results["local"]
    assert (hits.value, hits.calls) == (0, 0)  # no round trip per hit
    metrics.record("miss", STATS)
    assert (hits.value, hits.calls) == (5, 1) and metrics._results["miss"].value == 1
    metrics.record("local", STATS)
    metrics.record("shared", STATS)
    assert (hits.value, hits.calls) == (6, 2) and metrics._results["shared"].value == 1


def test_skipped_misses_wait_send_the_hits_before_them_and_are_sent_by_any_other_lookup():
    metrics = cache_metrics()
    hits, misses = metrics._results["local"], metrics._results["miss"]
    metrics.record("skipped", STATS)
    metrics.record("skipped", STATS)
    assert (misses.value, misses.calls) == (0, 0)  # no round trip per skipped miss
    metrics.record("local", STATS)
    metrics.record("skipped", STATS)
    assert (hits.value, hits.calls) == (1, 1) and misses.value == 0  # the hit count is up to date
    metrics.record("computed", STATS)
    assert (misses.value, misses.calls) == (4, 2)  # three skipped together, then the computed one
    metrics.record("skipped", STATS)
    metrics.flush()
    assert misses.value == 5 and hits.value == 1


def test_hits_are_sent_every_flush_every_and_by_flush():
    metrics = cache_metrics(flush_every=4)
    for _ in range(9):
        metrics.record("local", STATS)
    hits = metrics._results["local"]
    assert (hits.value, hits.calls) == (8, 2)
    metrics.flush()
    metrics.flush()  # nothing left: no call
    assert (hits.value, hits.calls) == (9, 3)


def test_hits_counted_from_many_threads_are_all_sent():
    metrics = cache_metrics(flush_every=7)
    threads = [threading.Thread(target=lambda: [metrics.record("local", STATS) for _ in range(500)])
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    metrics.flush()
    assert metrics._results["local"].value == 2000


def test_the_periodic_flush_flushes_once_more_when_closed():
    flushed = []
    flusher = PeriodicFlush(lambda: flushed.append(1), interval_s=3600, name="test-flush")
    flusher.close()  # the interval never passed: the flush on close is the one call
    assert flushed == [1] and not flusher._thread.is_alive()
