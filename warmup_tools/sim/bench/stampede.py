"""``python -m warmup_tools bench stampede``: a warm-up's keys expiring together, with and without the
shared tier's TTL jitter and single-flight lock.

A warm-up writes ``keys`` values to Redis at once, all with the same ``ttl_s``. ``instances`` threads, each
with its own :class:`~warmup_tools.caches.redis_tier.SharedTier` (client and connection pool) and an empty
local tier (instances that do not hold these keys locally: new ones, or ones that evicted them), then
request them back to back, each key drawn with Zipf(``zipf_s``) popularity (a warm-up's keys are the
popular ones), for one TTL cycle: until every value has expired, and before a recomputed one could expire
again. A computation costs ``compute_ms`` (a sleep standing in for the model: an embedding miss costs what
docs/benchmarks.md, "Tokenizer and embedding caches", measures).

For each of the four settings (jitter off/on, lock off/on) it prints the computations per recomputed key,
the peak recomputation rate (the most in any ``window_ms``, per second) and the request latency p50/p99
(a waiting instance pays up to ``redis_lock_wait_ms``).
"""

from __future__ import annotations

import collections
import itertools
import random
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, TextIO

import numpy as np

from warmup_tools.caches.redis_tier import SharedTier, TierKey, decode_array, encode_array
from warmup_tools.caches.settings import SharedTierSettings
from warmup_tools.caches.store import LocalCache
from warmup_tools.caches.tiered import TieredCache
from warmup_tools.common.digests import text_digest
from warmup_tools.common.settings import arg
from warmup_tools.sim.bench.support.servers import local_redis
from warmup_tools.sim.bench.support.tables import percentiles

#: (label, ttl_jitter, lock_wait_ms): the shared tier before jitter and the lock, and with each.
CONFIGS = (("no jitter, no lock", 0.0, 0.0), ("jitter 10%, no lock", 0.1, 0.0),
           ("no jitter, lock", 0.0, None), ("jitter 10%, lock", 0.1, None))


def run(assets_dir: Path, *, keys: Annotated[int, arg("keys written at once")] = 200,
        instances: Annotated[int, arg("instances requesting them")] = 8,
        ttl_s: Annotated[float, arg("the keys' TTL in seconds")] = 10.0,
        compute_ms: Annotated[float, arg("cost of one computation (simulated)")] = 20.0,
        zipf_s: Annotated[float, arg("key popularity exponent")] = 1.1,
        window_ms: float = 100.0,
        timeout_ms: Annotated[float, arg("redis_timeout_ms of the instances")] = 250.0,
        out: TextIO = sys.stdout) -> None:
    del assets_dir  # no model: the computation is simulated
    defaults = SharedTierSettings()
    out.write(f"\n{keys} keys written at once with ttl_s {ttl_s:g}; {instances} instances request them (Zipf "
              f"{zipf_s:g}) for one TTL cycle; a computation takes {compute_ms:g} ms; redis_timeout_ms "
              f"{timeout_ms:.0f} (so a busy machine does not open the circuit); lock settings "
              f"redis_lock_wait_ms {defaults.lock_wait_ms:.0f}, redis_lock_ms {defaults.lock_ms:.0f}, "
              f"redis_lock_poll_ms {defaults.lock_poll_ms:.0f}\n\n"
              f"| settings | keys recomputed | computations per recomputed key | the 10 hottest keys: computations "
              f"each | peak recomputes/s ({window_ms:g} ms window) | request p50 ms | request p99 ms | tier errors |\n"
              f"|---|---|---|---|---|---|---|---|\n")
    with local_redis() as url:
        if url is None:
            out.write("skipped: redis-server is not installed\n")
            return
        for label, jitter, lock_wait_ms in CONFIGS:
            settings = SharedTierSettings(
                url=url, ttl_s=ttl_s, ttl_jitter=jitter, timeout_ms=timeout_ms,
                lock_wait_ms=defaults.lock_wait_ms if lock_wait_ms is None else lock_wait_ms)
            r = _one(settings, keys=keys, instances=instances, compute_s=compute_ms / 1000.0, zipf_s=zipf_s)
            computed = r["computed"]
            peak = largest_burst([t for _, t in computed], window_ms / 1000.0) / (window_ms / 1000.0)
            per_key = collections.Counter(d for d, _ in computed)
            hottest = sum(per_key[d] for d in r["digests"][:10]) / 10
            p50, p99 = percentiles(r["latency"])
            out.write(f"| {label} | {len(per_key)} | {len(computed) / max(len(per_key), 1):.2f} | {hottest:.1f} | "
                      f"{peak:.0f} | {p50:.2f} | {p99:.2f} | {r['errors']} |\n")
            out.flush()


def _one(settings: SharedTierSettings, *, keys: int, instances: int, compute_s: float, zipf_s: float) -> dict:
    import redis

    admin = redis.Redis.from_url(settings.url)
    admin.flushall()
    admin.close()
    writer = SharedTier(settings)
    digests = [text_digest(f"warm-up prompt {i}") for i in range(keys)]
    value = np.arange(300, dtype=np.int32)
    for d in digests:  # the warm-up: every value written at once, with the same ttl_s
        writer.put(TierKey("tok", "t", "bench", d), encode_array(value))
    # NOTE: one TTL cycle: stop before the first recomputed value could expire again.
    until = time.monotonic() + settings.ttl_s * (1 + settings.ttl_jitter) + min(1.0, 0.5 * settings.ttl_s)
    tiers = [SharedTier(settings) for _ in range(instances)]
    computed: list[tuple[bytes, float]] = []
    latency: list[float] = []
    lock = threading.Lock()
    start = threading.Barrier(instances)
    cumulative = list(itertools.accumulate(1.0 / (rank + 1) ** zipf_s for rank in range(keys)))

    def compute(d: bytes) -> np.ndarray:
        time.sleep(compute_s)
        with lock:
            computed.append((d, time.monotonic()))
        return value

    def instance(i: int) -> None:
        cache = TieredCache(LocalCache(0, "lru"), tiers[i], kind="tok", fingerprint="bench", encode=encode_array,
                            decode=decode_array)
        rng = random.Random(i)
        mine: list[float] = []
        start.wait()
        while time.monotonic() < until:
            for d in rng.choices(digests, cum_weights=cumulative, k=256):
                t0 = time.perf_counter()
                cache.get_or_compute("t", d, lambda d=d: compute(d))
                mine.append(time.perf_counter() - t0)
        with lock:
            latency.extend(mine)

    threads = [threading.Thread(target=instance, args=(i,)) for i in range(instances)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = sum(t.stats.errors + t.stats.put_errors for t in tiers)
    for t in (writer, *tiers):
        t.close()
    return {"computed": computed, "latency": latency, "errors": errors, "digests": digests}


def largest_burst(times: list[float], window: float) -> int:
    """The most events within any ``window`` (times and window in the same unit)."""
    times = sorted(times)
    best, lo = 0, 0
    for hi, t in enumerate(times):
        while t - times[lo] > window:
            lo += 1
        best = max(best, hi - lo + 1)
    return best
