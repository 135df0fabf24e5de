"""The package's metrics on Triton's ``/metrics``, through the Python backend's ``pb_utils.MetricFamily``.

Like :mod:`warmup_tools.triton.io`, the classes take the ``pb_utils`` module as an argument, so they
import anywhere and unit tests can hand them a fake.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable, Iterable

from warmup_tools.common.settings import check_settings, setting


class CacheMetrics:
    """A cache's lookups (hit or miss), entries and bytes, on Triton's /metrics.

    NOTE: metrics with identical labels are shared by every instance of a model; the gauges carry the
    instance name so instances do not overwrite each other, the counters add up across instances.

    NOTE: each metric call of the Python backend is a round trip to the server (a large share of a cache hit's
    whole ``execute``), so the lookups that change nothing are counted here
    and sent as one increment each: local hits, and misses the embedding step skipped on purpose (unsampled;
    the common case for a prompt that does not repeat). They are sent every ``flush_every`` lookups, by
    :meth:`flush` (the model's flush thread every ``flush_s``, and ``finalize``), and before any lookup that
    changes a cache is recorded (a shared-tier hit, a computed miss: every count Triton shows is then up to
    date after it); a skipped miss sends the hits counted before it (the hit count is then up to date).
    """

    def __init__(self, pb_utils: Any, model: str, instance: str, *, flush_every: int = 256) -> None:
        lookups = pb_utils.MetricFamily(
            name="warmup_cache_lookups_total",
            description="Cache lookups by model and result (hit: local tier, shared_hit: Redis tier, miss)",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        entries = pb_utils.MetricFamily(
            name="warmup_cache_entries", description="Entries held by a model instance's cache",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        used = pb_utils.MetricFamily(
            name="warmup_cache_bytes", description="Bytes held by a model instance's cache",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        self._families = (lookups, entries, used)
        self._results = {
            source: lookups.Metric(labels={"model": model, "result": result})
            for source, result in (("local", "hit"), ("shared", "shared_hit"), ("miss", "miss"))  # CacheSource values
        }
        self._entries = entries.Metric(labels={"model": model, "instance": instance})
        self._bytes = used.Metric(labels={"model": model, "instance": instance})
        self._last = (-1, -1)
        self._flush_every = flush_every
        self._pending_hits = 0
        self._pending_misses = 0
        self._lock = threading.Lock()

    def record(self, source: str, stats: Any) -> None:
        """One lookup answered from ``source`` (a CacheSource: local, shared, skipped, or anything else: a
        miss)."""
        with self._lock:
            if source == "local":
                self._pending_hits += 1
            elif source == "skipped":
                self._send_hits()
                self._pending_misses += 1
            else:
                self._send_pending()
                self._results.get(source, self._results["miss"]).increment(1)
                if (stats.entries, stats.bytes_used) != self._last:
                    self._entries.set(stats.entries)
                    self._bytes.set(stats.bytes_used)
                    self._last = (stats.entries, stats.bytes_used)
                return
            if self._pending_hits + self._pending_misses >= self._flush_every:
                self._send_pending()

    def flush(self) -> None:
        """Send the lookups counted since the last send."""
        with self._lock:
            self._send_pending()

    def _send_pending(self) -> None:
        self._send_hits()
        if self._pending_misses:
            self._results["miss"].increment(self._pending_misses)
            self._pending_misses = 0

    def _send_hits(self) -> None:
        if self._pending_hits:
            self._results["local"].increment(self._pending_hits)
            self._pending_hits = 0


@dataclasses.dataclass(frozen=True, slots=True)
class MetricsSettings:
    """How often a model sends the counts it keeps in its stub (:class:`CacheMetrics`, :class:`SchedulerMetrics`)."""

    flush_s: float = setting(1.0, "Seconds between sends of the counts a model keeps locally: cache hits (a miss "
                                  "or a shared-tier hit sends them at once), scheduler steps and output tokens (an "
                                  "idle scheduler sends them at once).", parameter="metrics_flush_s",
                             gt=0, le=60)

    def __post_init__(self) -> None:
        check_settings(self)


class PeriodicFlush:
    """A daemon thread that calls ``flush`` every ``interval_s`` until :meth:`close` (which flushes once more)."""

    def __init__(self, flush: Callable[[], None], interval_s: float, name: str) -> None:
        self._flush = flush
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._flush()


#: Buckets (seconds) of the server-side time-to-first-token histogram.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class GenerationMetrics:
    """Per-adapter requests, cold requests, cached vs prefilled prompt tokens and TTFT on /metrics."""

    def __init__(self, pb_utils: Any, model: str, instance: str) -> None:
        self._model = model
        self._instance = instance
        self.requests = pb_utils.MetricFamily(
            name="warmup_generate_requests_total",
            description="Generate requests by adapter; cold=true when no prompt token came from the KV cache",
            kind=pb_utils.MetricFamily.COUNTER)
        self.tokens = pb_utils.MetricFamily(
            name="warmup_prompt_tokens_total",
            description="Prompt tokens by adapter and source (cached: from the KV prefix cache; prefilled: computed)",
            kind=pb_utils.MetricFamily.COUNTER)
        self.ttft = pb_utils.MetricFamily(
            name="warmup_ttft_seconds", description="Server-side time to first token by adapter",
            kind=pb_utils.MetricFamily.HISTOGRAM)
        self._per_adapter: dict[str, tuple[Any, ...]] = {}
        self.cache_bytes = pb_utils.MetricFamily(
            name="warmup_kv_cache_bytes", description="KV prefix cache bytes held per adapter and instance",
            kind=pb_utils.MetricFamily.GAUGE)
        self.running_bytes = pb_utils.MetricFamily(
            name="warmup_kv_running_bytes",
            description="KV bytes the running sequences hold against kv_cache_bytes, per instance (cached blocks, "
                        "which live sequences may evict, are not counted: vLLM's KV cache usage)",
            kind=pb_utils.MetricFamily.GAUGE)
        self.evictions = pb_utils.MetricFamily(
            name="warmup_kv_evictions_total", description="KV prefix cache blocks evicted per adapter",
            kind=pb_utils.MetricFamily.COUNTER)
        self.hit_ratio = pb_utils.MetricFamily(
            name="warmup_kv_hit_ratio",
            description="Share of prompt tokens served from the KV prefix cache, per adapter and instance",
            kind=pb_utils.MetricFamily.GAUGE)
        self.state = pb_utils.MetricFamily(
            name="warmup_adapter_state", description="1 for the adapter's current lifecycle state on an instance",
            kind=pb_utils.MetricFamily.GAUGE)
        self.plan_blocks = pb_utils.MetricFamily(
            name="warmup_kv_plan_blocks",
            description="KV blocks of the warm-up plan's hot set per adapter and instance",
            kind=pb_utils.MetricFamily.GAUGE)
        self.plan_resident = pb_utils.MetricFamily(
            name="warmup_kv_plan_blocks_resident",
            description="KV blocks of the warm-up plan's hot set resident in the instance's cache, per adapter",
            kind=pb_utils.MetricFamily.GAUGE)
        self.pinned = pb_utils.MetricFamily(
            name="warmup_kv_pinned_blocks",
            description="KV blocks pinned under the warm-up plan now, per adapter and instance",
            kind=pb_utils.MetricFamily.GAUGE)
        self.pin_hits = pb_utils.MetricFamily(
            name="warmup_kv_pin_hits",
            description="Block hits on blocks pinned under the warm-up plan since it became active, per adapter "
                        "and instance",
            kind=pb_utils.MetricFamily.GAUGE)
        self.shadow_hits = pb_utils.MetricFamily(
            name="warmup_kv_pin_shadow_hits",
            description="Block hits the blocks evicted to make room for the plan's pins would have had since it "
                        "became active (the live check's shadow list), per adapter and instance",
            kind=pb_utils.MetricFamily.GAUGE)
        self.pin_state = pb_utils.MetricFamily(
            name="warmup_kv_pin_state",
            description="1 for the state of the live check of the plan's pins (none, pinned, expired, released), "
                        "per instance",
            kind=pb_utils.MetricFamily.GAUGE)
        # NOTE: a family must outlive its metrics (the Python backend refuses to touch a metric whose family was
        # collected): each family is kept beside the metric.
        self._pins_released_family = pb_utils.MetricFamily(
            name="warmup_kv_pins_released_total",
            description="KV blocks whose pins the live check released early because they cost live traffic more "
                        "hits than they gave",
            kind=pb_utils.MetricFamily.COUNTER)
        self._pins_released = self._pins_released_family.Metric(labels={"model": model})
        self._pins_expired_family = pb_utils.MetricFamily(
            name="warmup_kv_pins_expired_total",
            description="KV blocks whose pin ended at its retention (then ordinary blocks of the eviction policy)",
            kind=pb_utils.MetricFamily.COUNTER)
        self._pins_expired = self._pins_expired_family.Metric(labels={"model": model})
        self._released = self._expired = 0
        self._pin_states: set[str] = set()
        self._cross_tenant_family = pb_utils.MetricFamily(
            name="warmup_kv_cross_tenant_hits_total",
            description="KV blocks refused because they were written for another tenant (expected: 0)",
            kind=pb_utils.MetricFamily.COUNTER)
        self._cross_tenant = self._cross_tenant_family.Metric(labels={"model": model})
        self._crossed = 0
        self._gauges: dict[tuple[str, ...], Any] = {}
        self._values: dict[tuple[Any, ...], float] = {}
        self._evicted: dict[str, int] = {}
        self._tokens: dict[str, list[int]] = {}

    def record(self, adapter: str | None, prompt_tokens: int, cached_tokens: int, ttft_s: float) -> None:
        name = adapter or "base"
        metrics = self._per_adapter.get(name)
        if metrics is None:
            labels = {"model": self._model, "adapter": name}
            metrics = (
                self.requests.Metric(labels={**labels, "cold": "false"}),
                self.requests.Metric(labels={**labels, "cold": "true"}),
                self.tokens.Metric(labels={**labels, "source": "cached"}),
                self.tokens.Metric(labels={**labels, "source": "prefilled"}),
                self.ttft.Metric(labels=labels, buckets=list(TTFT_BUCKETS)),
            )
            self._per_adapter[name] = metrics
        warm, cold, cached, prefilled, ttft = metrics
        totals = self._tokens.setdefault(name, [0, 0])
        totals[0] += cached_tokens
        totals[1] += prompt_tokens
        self._set(self.hit_ratio, {"adapter": name}, totals[0] / totals[1] if totals[1] else 0.0)
        (cold if cached_tokens == 0 else warm).increment(1)
        cached.increment(cached_tokens)
        prefilled.increment(prompt_tokens - cached_tokens)
        ttft.observe(ttft_s)

    def record_state(self, service: Any) -> None:
        """Cache bytes and evictions per adapter, and each adapter's lifecycle state, after a batch."""
        cache = service.engine.prefix_cache
        if cache is not None:
            crossed = cache.stats.cross_tenant_hits
            if crossed > self._crossed:
                self._cross_tenant.increment(crossed - self._crossed)
                self._crossed = crossed
            for owner, used in list(cache.stats.bytes_by_owner.items()):
                self._set(self.cache_bytes, {"adapter": owner or "base"}, used)
            self._set(self.running_bytes, {}, cache.stats.running_bytes)
            for owner, count in list(cache.stats.evictions_by_owner.items()):
                name = owner or "base"
                delta = count - self._evicted.get(name, 0)
                if delta > 0:
                    self._metric(self.evictions, {"adapter": name}, per_instance=False).increment(delta)
                    self._evicted[name] = count
            released, expired = cache.stats.released_pins, cache.stats.expired_pins
            if released > self._released:
                self._pins_released.increment(released - self._released)
                self._released = released
            if expired > self._expired:
                self._pins_expired.increment(expired - self._expired)
                self._expired = expired
        plan = getattr(service, "plan", None)
        for name, coverage in (plan.coverage_now if plan is not None else {}).items():
            self._set(self.plan_blocks, {"adapter": name}, coverage.planned)
            self._set(self.plan_resident, {"adapter": name}, coverage.resident)
        pins = plan.pins_now if plan is not None else None  # NOTE: the last status's report (no cache walk here)
        if pins is not None:
            # NOTE: each state ever reported keeps its series, at 0 once it is not the state (triton may not import
            # control, where the list of states is).
            self._pin_states.add(pins.state)
            for state in self._pin_states:
                self._set(self.pin_state, {"state": state}, 1 if pins.state == state else 0)
            for name, counts in pins.adapters.items():
                self._set(self.pinned, {"adapter": name}, counts.pinned_blocks)
                self._set(self.pin_hits, {"adapter": name}, counts.pin_hits)
                self._set(self.shadow_hits, {"adapter": name}, counts.shadow_hits)
        for name, status in service.lifecycle.snapshot().items():
            for state in type(status.state):
                self._set(self.state, {"adapter": name, "state": state.value}, 1 if status.state is state else 0)

    def _set(self, family: Any, labels: dict[str, str], value: float) -> None:
        """Set a per-instance gauge, skipping the IPC to the server when the value did not change."""
        key = (id(family), *sorted(labels.items()))
        if self._values.get(key) != value:
            self._metric(family, labels).set(value)
            self._values[key] = value

    def _metric(self, family: Any, labels: dict[str, str], per_instance: bool = True) -> Any:
        full = {"model": self._model, **labels}
        if per_instance:
            full["instance"] = self._instance
        key = (id(family), *sorted(full.items()))
        metric = self._gauges.get(key)
        if metric is None:
            metric = self._gauges[key] = family.Metric(labels=full)
        return metric


class SchedulerMetrics:
    """The continuous-batching scheduler on /metrics: running and waiting sequences, steps, sequences per
    step, step time, preemptions and output tokens per adapter.

    :meth:`observe` is the scheduler's observer (called on its thread after each step that ran a
    forward, or that changed the running or waiting count). The gauges are sent when they change (routers
    and the sidecar read them). NOTE: everything else is counted here and sent together (every ``flush_s``,
    and each time the scheduler falls idle): each metric call is a round trip to the server, and three of
    them per step cost a single stream several percent of its tokens/s (CHANGELOG.md, "Scheduler"). For the same
    reason the steps are counters (steps, the
    sequences they ran, their seconds: means per step by division), not per-step histograms.
    """

    def __init__(self, pb_utils: Any, model: str, instance: str, *, flush_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        family = pb_utils.MetricFamily
        labels = {"model": model, "instance": instance}
        self._model = model
        # NOTE: the families are kept: Triton refuses a Metric whose MetricFamily was garbage collected.
        self._families = (
            family(name="warmup_scheduler_running_sequences",
                   description="Sequences in the running batch of an instance", kind=family.GAUGE),
            family(name="warmup_scheduler_waiting_sequences",
                   description="Sequences waiting for a running slot on an instance", kind=family.GAUGE),
            family(name="warmup_scheduler_steps_total", description="Scheduler steps that ran a forward",
                   kind=family.COUNTER),
            family(name="warmup_scheduler_step_sequences_total",
                   description="Sequences those steps ran (divided by the steps: the mean batch size)",
                   kind=family.COUNTER),
            family(name="warmup_scheduler_step_seconds_total",
                   description="Seconds those steps took (divided by the steps: the mean step time)",
                   kind=family.COUNTER),
            family(name="warmup_scheduler_preemptions_total",
                   description="Running sequences preempted (KV dropped, recomputed later)", kind=family.COUNTER),
            family(name="warmup_output_tokens_total", description="Generated tokens by adapter",
                   kind=family.COUNTER),
        )
        running, waiting, steps, sequences, seconds, preemptions, self._tokens_family = self._families
        self._running = running.Metric(labels=labels)
        self._waiting = waiting.Metric(labels=labels)
        self._steps = steps.Metric(labels=labels)
        self._sequences = sequences.Metric(labels=labels)
        self._seconds = seconds.Metric(labels=labels)
        self._preemptions = preemptions.Metric(labels={"model": model})
        self._tokens: dict[str, Any] = {}
        self._last = {"running": -1, "waiting": -1, "preemptions": 0}
        self._sent_tokens: dict[str, int] = {}
        #: Steps, their sequences and seconds counted since the last send.
        self._pending = [0, 0, 0.0]
        self._flush_s = flush_s
        self._clock = clock
        self._flushed = clock()

    def observe(self, report: Any, scheduler: Any) -> None:
        stats = scheduler.stats
        for key, metric, value in (("running", self._running, stats.running),
                                   ("waiting", self._waiting, stats.waiting)):
            if self._last[key] != value:
                metric.set(value)
                self._last[key] = value
        if report.batch_size:  # a step that ran no forward (only dropped sequences) is no batch
            self._pending[0] += 1
            self._pending[1] += report.batch_size
            self._pending[2] += report.seconds
        idle = not stats.running and not stats.waiting
        if idle or self._clock() - self._flushed >= self._flush_s:
            self._flush(stats)

    def _flush(self, stats: Any) -> None:
        self._flushed = self._clock()
        steps, sequences, seconds = self._pending
        if steps:
            self._steps.increment(steps)
            self._sequences.increment(sequences)
            self._seconds.increment(seconds)
            self._pending = [0, 0, 0.0]
        if stats.preemptions > self._last["preemptions"]:
            self._preemptions.increment(stats.preemptions - self._last["preemptions"])
            self._last["preemptions"] = stats.preemptions
        for adapter, total in list(stats.output_tokens.items()):
            delta = total - self._sent_tokens.get(adapter, 0)
            if delta > 0:
                name = adapter or "base"
                metric = self._tokens.get(name)
                if metric is None:
                    metric = self._tokens[name] = self._tokens_family.Metric(
                        labels={"model": self._model, "adapter": name})
                metric.increment(delta)
                self._sent_tokens[adapter] = total


class HeatMetrics:
    """Heat per (cluster, adapter, window) on /metrics: the ``top`` hottest keys of each window.

    NOTE: the Python backend keeps every series a model ever created (its metric family holds them), so
    the number of series is capped: at most ``max_series`` (cluster, adapter, window) series are created;
    keys beyond the cap are summed into one ``cluster="other", adapter="other"`` series per window, and a
    series whose key left the top is set to 0. /metrics stays bounded whatever adapter names or cluster
    ids clients send.
    """

    OTHER = "other"

    def __init__(self, pb_utils: Any, instance: str, top: int = 50, max_series: int = 512) -> None:
        self._family = pb_utils.MetricFamily(
            name="warmup_heat_requests",
            description="Estimated requests per semantic cluster and adapter over a sliding window",
            kind=pb_utils.MetricFamily.GAUGE)
        self._instance = instance
        self._top = top
        self._max_series = max_series
        self._metrics: dict[tuple[str, str, float], Any] = {}

    def _series(self, key: tuple[str, str, float]) -> Any:
        metric = self._metrics.get(key)
        if metric is None:
            cluster, adapter, window = key
            metric = self._metrics[key] = self._family.Metric(labels={
                "cluster": cluster, "adapter": adapter, "window": f"{window:g}s", "instance": self._instance})
        return metric

    def publish(self, entries: Iterable[Any]) -> None:
        by_window: dict[float, list[Any]] = {}
        for entry in entries:
            by_window.setdefault(entry.window_s, []).append(entry)
        values: dict[tuple[str, str, float], float] = {}
        for window, items in by_window.items():
            for entry in sorted(items, key=lambda e: -e.requests)[: self._top]:
                key = (str(entry.cluster_id), entry.adapter or "base", window)
                if key not in self._metrics and len(self._metrics) >= self._max_series - len(by_window):
                    key = (self.OTHER, self.OTHER, window)  # room is kept for one overflow series per window
                values[key] = values.get(key, 0.0) + entry.requests
        for key, value in values.items():
            self._series(key).set(value)
        for key in set(self._metrics) - set(values):
            self._metrics[key].set(0)

    @property
    def series(self) -> int:
        return len(self._metrics)


#: Every reason a KV snapshot (or part of one) is skipped (:mod:`warmup_tools.kv.snapshot_verify`): the labels
#: of ``warmup_kv_snapshot_skipped_total`` are these, so /metrics stays bounded whatever a file holds.
SNAPSHOT_SKIP_REASONS = ("format", "version", "checksum", "truncated", "too_large", "unreadable", "payload",
                         "unknown_key", "mac", "not_finite", "base_model", "tokenizer", "dtype", "storage",
                         "block_size", "salt", "adapter", "hash", "verify", "error")


class SnapshotMetrics:
    """KV snapshots on /metrics: snapshots skipped by reason, blocks and bytes restored, snapshots written."""

    def __init__(self, pb_utils: Any, model: str) -> None:
        family = pb_utils.MetricFamily
        # NOTE: the families are kept: Triton refuses a Metric whose MetricFamily was garbage collected.
        self._families = (
            family(name="warmup_kv_snapshot_skipped_total",
                   description="KV snapshots skipped at restore (not matching, damaged, failed verification) by "
                               "reason; adapter: blocks of an adapter not served with the same weights dropped",
                   kind=family.COUNTER),
            family(name="warmup_kv_snapshot_restored_blocks_total",
                   description="KV blocks restored from snapshots at start", kind=family.COUNTER),
            family(name="warmup_kv_snapshot_restored_bytes_total",
                   description="KV bytes restored from snapshots at start", kind=family.COUNTER),
            family(name="warmup_kv_snapshot_writes_total", description="KV snapshots written", kind=family.COUNTER),
        )
        skipped, blocks, restored_bytes, writes = self._families
        labels = {"model": model}
        self._skipped = {reason: skipped.Metric(labels={**labels, "reason": reason})
                         for reason in SNAPSHOT_SKIP_REASONS}
        self._blocks = blocks.Metric(labels=labels)
        self._bytes = restored_bytes.Metric(labels=labels)
        self._writes = writes.Metric(labels=labels)

    def record_restore(self, report: Any) -> None:
        for reason, count in report.skipped.items():
            self._skipped.get(reason, self._skipped["error"]).increment(count)
        self._blocks.increment(report.blocks)
        self._bytes.increment(report.bytes)

    def record_write(self, info: Any) -> None:
        if info is not None:
            self._writes.increment(1)
