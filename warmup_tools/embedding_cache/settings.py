"""Every ``embedding_cache`` parameter of ``config.pbtxt``, read once into one typed object.

The planner embeds with the same :class:`EmbedderConfig` the server runs (through
:meth:`EmbeddingCacheSettings.from_repository`), so its clusters are the server's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

from warmup_tools.caches.policies.settings import EvictionSettings
from warmup_tools.caches.settings import SharedTierSettings, eviction_setting
from warmup_tools.common.settings import check_settings, setting
from warmup_tools.triton.metrics import MetricsSettings
from warmup_tools.triton.params import ModelSettings
from warmup_tools.triton.trust import TrustSettings

MODEL_NAME = "embedding_cache"


@dataclasses.dataclass(frozen=True, slots=True)
class EmbedderConfig:
    """The ONNX sentence embedder and its exact cache (:class:`~warmup_tools.embedding_cache.embedder.OnnxEmbedder`)."""

    model_dir: Path = setting(doc="Folder holding model.onnx (mean-pooled, L2-normalised sentence embeddings) "
                                  "and tokenizer.json.", parameter="embedder_path")
    cache_bytes: int = setting(64 << 20, "Bytes of the local embedding cache (keys and vectors).", ge=1)
    eviction: str = eviction_setting("decayed_lfu")
    providers: str = setting("auto", "ONNX Runtime execution providers, comma-separated; auto: CUDA when "
                                     "available, else CPU.")
    num_threads: int = setting(1, "ONNX Runtime intra-op threads; 0 leaves ONNX Runtime's default.", ge=0, le=1024)
    policy: EvictionSettings = dataclasses.field(default_factory=EvictionSettings)

    def __post_init__(self) -> None:
        check_settings(self)


@dataclasses.dataclass(frozen=True, slots=True)
class SemanticConfig:
    """Semantic clusters and heat (:class:`~warmup_tools.embedding_cache.service.EmbeddingService`)."""

    sample_rate: float = setting(0.1, "Share of cache misses embedded for the semantic clusters and heat.",
                                 parameter="miss_sample_rate", ge=0, le=1)
    seed: int = setting(0, "Seed of the miss sampling (the same misses are sampled on every run).",
                        parameter="sample_seed")
    threshold: float = setting(0.82, "Cosine similarity at or above which a prompt joins a cluster.",
                               parameter="admit_threshold", ge=-1, le=1)
    deferred: bool = setting(True, "Embed sampled misses on a background thread, off the request path.",
                             parameter="deferred_misses")
    heat_log_dir: Path | None = setting(None, "Folder of the heat statistics (heat-<instance>.jsonl); empty: none.")
    flush_interval_s: float = setting(10.0, "Seconds between writes of the heat statistics.", gt=0)
    deferred_queue: int = setting(64, "Sampled misses waiting for the background embedder; more are dropped "
                                      "(counted).", ge=1, le=65536)
    max_entries: int = setting(4096, "Embeddings the semantic index keeps (oldest dropped first).", ge=1)
    max_clusters: int = setting(256, "Semantic clusters kept at most, over all tenants.", ge=1)

    def __post_init__(self) -> None:
        check_settings(self)


@dataclasses.dataclass(frozen=True, slots=True)
class EmbeddingCacheSettings(ModelSettings):
    """Every ``embedding_cache`` parameter (:meth:`from_parameters`)."""

    MODEL: ClassVar[str] = MODEL_NAME

    embedder: EmbedderConfig
    semantic: SemanticConfig = dataclasses.field(default_factory=SemanticConfig)
    shared: SharedTierSettings = dataclasses.field(default_factory=SharedTierSettings)
    trust: TrustSettings = dataclasses.field(default_factory=TrustSettings)
    metrics: MetricsSettings = dataclasses.field(default_factory=MetricsSettings)


