import json

import numpy as np

from warmup_tools.embedding_cache.embedder import OnnxEmbedder
from warmup_tools.embedding_cache.service import EmbeddingService
from warmup_tools.embedding_cache.settings import EmbedderConfig, SemanticConfig


class Clock:
    now = 1000.0

    def __call__(self):
        return self.now


def test_misses_are_sampled_hits_counted_and_heat_stays_unbiased(demo_assets, tmp_path):
    clock = Clock()
    service = EmbeddingService(OnnxEmbedder(EmbedderConfig(demo_assets.embedder_dir)),
                               SemanticConfig(sample_rate=0.25, seed=1, flush_interval_s=5, deferred=False),
                                   heat_log=tmp_path / "heat.jsonl", clock=clock)
    sources = [service.handle(f"refund request number {i}", adapter="support").source for i in range(200)]
    computed = sources.count("computed")
    assert sources.count("skipped") == 200 - computed and 25 <= computed <= 75
    total = sum(e.requests for e in service.heat.snapshot() if e.window_s == 60)
    assert total == computed * 4  # each sampled miss stands for 1 / sample_rate requests
    clock.now += 120
    assert service.maybe_flush() is not None
    lines = [json.loads(line) for line in (tmp_path / "heat.jsonl").read_text().splitlines()]
    assert lines and sum(line["n"] for line in lines) == computed * 4


def test_warmup_always_computes_and_planned_centroids_assign_clusters(demo_assets, tmp_path):
    embedder = OnnxEmbedder(EmbedderConfig(demo_assets.embedder_dir))
    anchors = embedder.embed_batch(["How do I get a refund for my invoice?", "SELECT total revenue by region"])
    path = tmp_path / "centroids.json"
    path.write_text(json.dumps([{"cluster": 7, "centroid": anchors[0].tolist()},
                                {"cluster": 9, "centroid": anchors[1].tolist()}]))
    service = EmbeddingService(embedder, SemanticConfig(sample_rate=0.0, deferred=False), centroids_path=path)
    out = service.handle("I want a refund for my last invoice", warmup=True)
    assert out.source == "computed" and out.cluster_id == 7 and out.similarity > 0.5
    assert service.handle("query revenue per region in SQL", warmup=True).cluster_id == 9
    skipped = service.handle("never sampled")
    assert skipped.source == "skipped" and skipped.cluster_id == -1 and not np.any(skipped.vector)


def test_the_sidecars_probes_add_no_heat(demo_assets):
    from warmup_tools.common.records import PROBE_TENANT

    service = EmbeddingService(OnnxEmbedder(EmbedderConfig(demo_assets.embedder_dir)),
                               SemanticConfig(sample_rate=1.0, seed=1, deferred=False))
    for _ in range(5):
        service.handle("sidecar readiness probe", tenant=PROBE_TENANT)
    assert sum(e.requests for e in service.heat.snapshot()) == 0
    service.handle("sidecar readiness probe", tenant="acme")
    assert sum(e.requests for e in service.heat.snapshot() if e.window_s == 60) == 1


def test_deferred_misses_are_embedded_after_the_response_with_the_same_heat(demo_assets):
    service = EmbeddingService(OnnxEmbedder(EmbedderConfig(demo_assets.embedder_dir)),
                               SemanticConfig(sample_rate=1.0, seed=1, deferred=True))
    try:
        first = service.handle("a question nobody asked before", adapter="support")
        assert first.source == "deferred" and first.cluster_id == -1 and not np.any(first.vector)
        assert service.drain()
        again = service.handle("a question nobody asked before", adapter="support")
        assert again.source == "local" and again.cluster_id >= 0  # cached by the worker, then a hit
        assert sum(e.requests for e in service.heat.snapshot() if e.window_s == 60) == 2
        warm = service.handle("a warm-up sample", warmup=True)
        assert warm.source == "computed" and warm.cluster_id >= 0  # warm-up is never deferred
    finally:
        service.close()


def test_a_full_deferred_queue_drops_and_counts_instead_of_blocking(demo_assets):
    service = EmbeddingService(OnnxEmbedder(EmbedderConfig(demo_assets.embedder_dir)),
                               SemanticConfig(sample_rate=1.0, seed=1, deferred=True, deferred_queue=1))
    service.close()  # the worker is gone: nothing drains the queue
    assert service.handle("first miss").source == "deferred"
    assert service.handle("second miss").source == "skipped" and service.dropped == 1


def test_a_direct_caller_gets_no_signal_of_another_tenant_s_similar_prompt(demo_assets):
    """What embedding_cache outputs (cluster_id, similarity) for tenant B's prompt is the same whether
    tenant A sent a similar one before or not."""
    embedder = OnnxEmbedder(EmbedderConfig(demo_assets.embedder_dir))

    def b_sees(a_prompts):
        service = EmbeddingService(embedder, SemanticConfig(sample_rate=1.0, deferred=False), cluster_key=b"k" * 32)
        a = [service.handle(p, tenant="acme") for p in a_prompts]
        return service.handle("I want a refund for my last invoice, please", tenant="globex"), a

    with_a, a_outcomes = b_sees(["How do I get a refund for my invoice?", "Refund my invoice"])
    without_a, _ = b_sees([])
    assert with_a.similarity == without_a.similarity == 1.0
    assert with_a.cluster_id not in {a.cluster_id for a in a_outcomes}  # never joins A's cluster
    assert with_a.reported_cluster_id == without_a.reported_cluster_id  # the model's output: the same id
    assert with_a.reported_cluster_id not in {a.reported_cluster_id for a in a_outcomes}


class RecordingTier:
    """A shared tier in memory that records the keys it is asked for (the embedder only calls get and put)."""

    def __init__(self) -> None:
        self.values: dict = {}
        self.keys: list = []

    def get(self, key):
        self.keys.append(key)
        return self.values.get(key)

    def put(self, key, payload) -> bool:
        self.keys.append(key)
        self.values[key] = payload
        return True

    def lock_or_wait(self, key, poll):
        return None, None  # no single flight: compute at once

    def unlock(self, lease) -> None:
        raise AssertionError("no lease was handed out")


def test_the_embedding_cache_is_keyed_by_tenant_in_both_tiers(demo_assets):
    shared = RecordingTier()
    embedder = OnnxEmbedder(EmbedderConfig(demo_assets.embedder_dir), shared=shared)
    text = "How do I get a refund for my invoice?"
    embedder.compute(text, "acme")
    assert embedder.lookup(text, "acme").source == "local"
    assert embedder.lookup(text, "beta").source == "miss"  # another tenant misses, locally and in the shared tier
    assert {key.tenant for key in shared.keys} == {"acme", "beta"}
    assert len(shared.values) == 1 and next(iter(shared.values)).tenant == "acme"

    # Through the service: another tenant's identical prompt is a miss that is not sampled (rate 0), with no
    # vector and no cluster, while the first tenant's is a hit.
    service = EmbeddingService(embedder, SemanticConfig(sample_rate=0.0, deferred=False))
    assert service.handle(text, tenant="acme").source == "local"
    other = service.handle(text, tenant="beta")
    assert other.source == "skipped" and not np.any(other.vector) and other.cluster_id == -1


def test_the_local_tier_is_built_from_the_settings_eviction_and_knobs(demo_assets):
    from warmup_tools.caches.policies.settings import EvictionSettings
    from warmup_tools.caches.policies.slru import SegmentedLRUPolicy

    default = OnnxEmbedder(EmbedderConfig(demo_assets.embedder_dir))
    assert default.local.eviction == "decayed_lfu" and default.local.policy.half_life_s == 600
    chosen = OnnxEmbedder(EmbedderConfig(demo_assets.embedder_dir, cache_bytes=1 << 20, eviction="slru",
                                         policy=EvictionSettings(protected_share=0.5)))
    assert isinstance(chosen.local.policy, SegmentedLRUPolicy) and chosen.local.policy.protected_budget == 1 << 19
    assert chosen.embed("a question") is not None and chosen.embed("a question") is not None
    assert chosen.local.stats.hits == 1 and chosen.local.stats.bytes_used <= 1 << 20
