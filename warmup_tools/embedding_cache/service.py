"""What one ``embedding_cache`` instance does per request: embed (cached or sampled), assign a semantic
cluster, count heat per (cluster, adapter), and periodically flush heat to a compact log."""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import random
import threading
import time
from pathlib import Path

import numpy as np

from warmup_tools.caches.tiered import CacheSource
from warmup_tools.common.records import PROBE_TENANT
from warmup_tools.embedding_cache.embedder import OnnxEmbedder
from warmup_tools.embedding_cache.heat import HeatEntry, HeatLogWriter, HeatSampler
from warmup_tools.embedding_cache.semantic import DEFAULT_TENANT, NO_CLUSTER, SemanticIndex, reported_cluster_id
from warmup_tools.embedding_cache.settings import SemanticConfig

LOGGER = logging.getLogger(__name__)

#: Where ``stanzas --plan`` leaves the plan's cluster centroids for this model.


@dataclasses.dataclass(frozen=True, slots=True)
class EmbeddingOutcome:
    vector: np.ndarray
    #: The cluster in this instance's index (heat statistics); callers see :attr:`reported_cluster_id`.
    cluster_id: int
    #: Cosine to the centroid of one of the caller's own tenant's clusters (0.0 with no cluster).
    similarity: float
    #: local, shared, computed, or skipped
    source: CacheSource
    #: What the model outputs as ``cluster_id``: a per-tenant id (:func:`reported_cluster_id`) or -1.
    reported_cluster_id: int = NO_CLUSTER


class EmbeddingService:
    """Embedding, semantic clusters and heat for one instance.

    With ``deferred`` (how the model runs), a sampled live miss is embedded by a worker thread after the
    response went out: embedding a prompt costs tens of milliseconds on a CPU, and on the request path
    it held up every request queued behind it (a TTFT tail at concurrency). The request gets cluster -1,
    as an unsampled miss does; the worker caches the vector, assigns its cluster and counts its heat.
    At most ``deferred_queue`` misses wait; beyond that they are dropped (counted in ``dropped``).
    Warm-up samples are always embedded on the spot.
    """

    def __init__(self, embedder: OnnxEmbedder, config: SemanticConfig, *,
                 centroids_path: Path | None = None, heat_log: Path | None = None, clock=time.time,
                 cluster_key: bytes = b"") -> None:
        """``cluster_key`` keys the cluster ids callers see (:func:`reported_cluster_id`): the deployment's
        in trust mode, so every instance reports a planned cluster alike."""
        self.embedder = embedder
        self.config = config
        self.cluster_key = cluster_key
        # NOTE: the caches, the semantic index and the heat sampler each hold their own lock, so the worker
        # and the request path share them without one here.
        self.dropped = 0
        self._work: queue.Queue[tuple[str, str, str, int] | None] | None = None
        self._worker: threading.Thread | None = None
        if config.deferred:
            self._work = queue.Queue(maxsize=config.deferred_queue)
            self._worker = threading.Thread(target=self._run, name="embedding-deferred", daemon=True)
        self.sample_rate = config.sample_rate
        self.rng = random.Random(config.seed)
        self.index = SemanticIndex(embedder.dim, threshold=config.threshold, max_entries=config.max_entries,
                                   max_clusters=config.max_clusters)
        if centroids_path is not None and centroids_path.exists():
            self.load_centroids(centroids_path)
        self.heat = HeatSampler(clock=clock)
        self.heat_log = HeatLogWriter(heat_log) if heat_log is not None else None
        self._zeros = np.zeros(embedder.dim, dtype=np.float32)
        self._clock = clock
        self._flush_interval_s = config.flush_interval_s
        self._next_flush = clock() + config.flush_interval_s
        if self._worker is not None:
            self._worker.start()

    def handle(self, text: str, *, tenant: str = "default", adapter: str = "", prompt_tokens: int = 0,
               warmup: bool = False) -> EmbeddingOutcome:
        """Embed one prompt. Warm-up samples always compute; other misses compute at ``sample_rate``
        (after the response, with ``deferred``)."""
        rate = 1.0 if warmup else self.sample_rate
        result = self.embedder.lookup(text, tenant)
        if result.vector is not None:
            return self._account(result.vector, result.source, adapter, prompt_tokens, tenant, warmup)
        if not sampled(rate, self.rng):
            return EmbeddingOutcome(self._zeros, -1, 0.0, CacheSource.SKIPPED)
        if self._work is not None and not warmup:
            try:
                self._work.put_nowait((text, tenant, adapter, prompt_tokens))
                return EmbeddingOutcome(self._zeros, -1, 0.0, CacheSource.DEFERRED)
            except queue.Full:
                self.dropped += 1
                return EmbeddingOutcome(self._zeros, -1, 0.0, CacheSource.SKIPPED)
        return self._compute(text, tenant, adapter, prompt_tokens, warmup)

    def drain(self, timeout_s: float = 60.0) -> bool:
        """Wait until every deferred miss is embedded (tests, shutdown); False on timeout."""
        if self._work is None:
            return True
        deadline = time.monotonic() + timeout_s
        while self._work.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._work.unfinished_tasks

    def close(self) -> None:
        if self._work is not None and self._worker is not None:
            self._work.put(None)
            self._worker.join(10)

    def _compute(self, text: str, tenant: str, adapter: str, prompt_tokens: int, warmup: bool) -> EmbeddingOutcome:
        vector = self.embedder.compute(text, tenant)
        return self._account(vector, CacheSource.COMPUTED, adapter, prompt_tokens, tenant, warmup)

    def _account(self, vector: np.ndarray, source: CacheSource, adapter: str, prompt_tokens: int, tenant: str,
                 warmup: bool) -> EmbeddingOutcome:
        assignment = self.index.assign(vector, tenant)  # the tenant's own clusters only
        if not warmup and tenant != PROBE_TENANT:  # health probes are not traffic
            # NOTE: hits are counted once; sampled misses stand for 1 / sample_rate requests each, so the
            # heat estimate stays unbiased while most misses skip the embedding.
            hit = source in (CacheSource.LOCAL, CacheSource.SHARED)
            weight = 1.0 if hit else 1.0 / max(self.sample_rate, 1e-9)
            self.heat.record(assignment.cluster_id, adapter, prompt_tokens=prompt_tokens, weight=weight)
        similarity = assignment.similarity if assignment.cluster_id != NO_CLUSTER else 0.0
        return EmbeddingOutcome(vector, assignment.cluster_id, similarity, source,
                                reported_cluster_id(self.cluster_key, tenant, assignment.label))

    def _run(self) -> None:
        assert self._work is not None
        while True:
            item = self._work.get()
            try:
                if item is None:
                    return
                self._compute(*item, warmup=False)
            except Exception:  # a failed deferred embedding loses heat, never the worker
                LOGGER.exception("deferred embedding failed")
            finally:
                self._work.task_done()

    def maybe_flush(self) -> list[HeatEntry] | None:
        """Every ``flush_interval_s``: append closed heat buckets to the log; return the heat snapshot."""
        now = self._clock()
        if now < self._next_flush:
            return None
        self._next_flush = now + self._flush_interval_s
        if self.heat_log is not None:
            try:
                self.heat_log.write(self.heat.drain_log())
            except OSError as exc:  # NOTE: a full disk loses heat lines, never a request
                LOGGER.error("heat log: %s", exc)
        return self.heat.snapshot()

    def load_centroids(self, path: Path) -> int:
        clusters = json.loads(path.read_text())
        if not clusters:
            return 0
        ids = [int(c["cluster"]) for c in clusters]
        matrix = np.asarray([c["centroid"] for c in clusters], dtype=np.float32)
        # NOTE: a planned cluster is its tenant's (the plan found it in that tenant's prompts); a file
        # written before centroids named their tenant gives them all to the default tenant.
        tenants = [str(c.get("tenant") or DEFAULT_TENANT) for c in clusters]
        self.index.set_centroids(matrix, ids if len(set(ids)) == len(ids) else None, tenants)
        return len(ids)


def sampled(rate: float, rng: random.Random) -> bool:
    """Whether a miss is one of the ``rate`` share that is embedded.

    NOTE: embedding a 256-token prompt costs tens of milliseconds on a CPU, more than a warm prefill.
    Skipping most misses keeps that cost low; the sampled share still gives unbiased heat counts (scale by
    1 / sample_rate) and fills the cache for the prompts that repeat.
    """
    return rate >= 1.0 or (rate > 0.0 and rng.random() < rate)
