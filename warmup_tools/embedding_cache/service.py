"""What one ``embedding_cache`` instance does per request: embed (cached or sampled), assign a semantic
cluster, count heat per (cluster, adapter), and periodically flush heat to a compact log."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from pathlib import Path

import numpy as np

from warmup_tools.caches.tiered import CacheSource
from warmup_tools.common.records import PROBE_TENANT
from warmup_tools.embedding_cache.embedder import OnnxEmbedder
from warmup_tools.embedding_cache.heat import HeatEntry, HeatLogWriter, HeatSampler
from warmup_tools.embedding_cache.semantic import SemanticIndex

LOGGER = logging.getLogger(__name__)

#: Where ``stanzas --plan`` leaves the plan's cluster centroids for this model.


@dataclasses.dataclass(frozen=True, slots=True)
class EmbeddingOutcome:
    vector: np.ndarray
    cluster_id: int
    similarity: float
    #: local, shared, computed, or skipped
    source: CacheSource


class EmbeddingService:
    def __init__(self, embedder: OnnxEmbedder, *, sample_rate: float = 0.1, seed: int = 0,
                 threshold: float = 0.82, max_entries: int = 4096, max_clusters: int = 256,
                 centroids_path: Path | None = None, heat_log: Path | None = None,
                 flush_interval_s: float = 10.0, clock=time.time) -> None:
        self.embedder = embedder
        self.sample_rate = sample_rate
        self.rng = random.Random(seed)
        self.index = SemanticIndex(embedder.dim, threshold=threshold, max_entries=max_entries,
                                   max_clusters=max_clusters)
        if centroids_path is not None and centroids_path.exists():
            self.load_centroids(centroids_path)
        self.heat = HeatSampler(clock=clock)
        self.heat_log = HeatLogWriter(heat_log) if heat_log is not None else None
        self._zeros = np.zeros(embedder.dim, dtype=np.float32)
        self._clock = clock
        self._flush_interval_s = flush_interval_s
        self._next_flush = clock() + flush_interval_s

    def handle(self, text: str, *, tenant: str = "default", adapter: str = "", prompt_tokens: int = 0,
               warmup: bool = False) -> EmbeddingOutcome:
        """Embed one prompt. Warm-up samples always compute; other misses compute at ``sample_rate``."""
        rate = 1.0 if warmup else self.sample_rate
        result = self.embedder.lookup_or_sample(text, rate, self.rng, tenant)
        if result.vector is None:
            return EmbeddingOutcome(self._zeros, -1, 0.0, result.source)
        assignment = self.index.assign(result.vector)
        if not warmup and tenant != PROBE_TENANT:  # health probes are not traffic
            # NOTE: hits are counted once; sampled misses stand for 1 / sample_rate requests each, so the
            # heat estimate stays unbiased while most misses skip the embedding.
            hit = result.source in (CacheSource.LOCAL, CacheSource.SHARED)
            weight = 1.0 if hit else 1.0 / max(self.sample_rate, 1e-9)
            self.heat.record(assignment.cluster_id, adapter, prompt_tokens=prompt_tokens, weight=weight)
        return EmbeddingOutcome(result.vector, assignment.cluster_id, assignment.similarity, result.source)

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
        self.index.set_centroids(matrix, ids if len(set(ids)) == len(ids) else None)
        return len(ids)
