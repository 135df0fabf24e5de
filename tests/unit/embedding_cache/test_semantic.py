import numpy as np
import pytest

from warmup_tools.common.errors import InvalidInputError
from warmup_tools.embedding_cache.semantic import NO_CLUSTER, SemanticIndex

DIM = 64


def unit(v: np.ndarray) -> np.ndarray:
    return (v / np.linalg.norm(v, axis=-1, keepdims=True)).astype(np.float32)


def random_units(n: int, dim: int = DIM, seed: int = 0) -> np.ndarray:
    return unit(np.random.default_rng(seed).standard_normal((n, dim)))


def near(v: np.ndarray, rng: np.random.Generator, scale: float = 0.02) -> np.ndarray:
    return unit(v + scale * rng.standard_normal(v.shape))


def test_near_duplicates_are_not_admitted_twice_and_distinct_vectors_are():
    rng = np.random.default_rng(1)
    index = SemanticIndex(DIM, threshold=0.9)
    base = random_units(20, seed=2)  # random directions in 64-d are nearly orthogonal
    assert all(index.assign(v).admitted for v in base)
    for v in base:
        for _ in range(5):
            assert index.assign(near(v, rng)).admitted is False
    assert len(index) == 20
    assert index.stats.admitted == 20 and index.stats.duplicates == 100


def test_assignment_with_given_centroids_picks_the_nearest():
    rng = np.random.default_rng(3)
    centroids = random_units(8, seed=4)
    index = SemanticIndex(DIM, centroids=centroids, learn_online=False)
    index.set_centroids(centroids, ids=[10, 11, 12, 13, 14, 15, 16, 17])
    for i, c in enumerate(centroids):
        result = index.assign(near(c, rng))
        assert result.cluster_id == 10 + i
        assert result.similarity == pytest.approx(float(near(c, rng) @ c), abs=0.01)
    # without online learning the centroids do not move and no cluster is added
    np.testing.assert_allclose(index.centroids, centroids, atol=1e-6)
    far = unit(-centroids.sum(axis=0))
    assert index.assign(far).cluster_id in range(10, 18)
    assert index.stats.clusters_created == 0


def test_without_centroids_or_learning_there_is_no_cluster():
    result = SemanticIndex(DIM, learn_online=False).assign(random_units(1)[0])
    assert result.cluster_id == NO_CLUSTER and result.admitted


def test_online_learning_creates_clusters_up_to_max_clusters_then_assigns_to_nearest():
    index = SemanticIndex(DIM, threshold=0.8, max_clusters=5)
    vectors = random_units(12, seed=5)
    ids = [index.assign(v).cluster_id for v in vectors]
    assert ids[:5] == [0, 1, 2, 3, 4]
    assert set(ids[5:]) <= {0, 1, 2, 3, 4}
    assert index.stats.clusters_created == 5 and len(index.centroids) == 5


def test_online_update_is_a_renormalised_running_mean():
    index = SemanticIndex(DIM, threshold=0.5)
    rng = np.random.default_rng(6)
    base = random_units(1, seed=7)[0]
    members = [near(base, rng, 0.05) for _ in range(50)]
    first = index.assign(members[0])
    assert first.similarity == 1.0
    for v in members[1:]:
        assert index.assign(v).cluster_id == first.cluster_id
    centroid = index.centroids[0]
    assert np.linalg.norm(centroid) == pytest.approx(1.0, abs=1e-5)
    assert float(centroid @ unit(np.mean(members, axis=0))) > 0.999


def test_planned_centroids_are_not_dragged_by_one_prompt():
    centroids = random_units(2, seed=8)
    index = SemanticIndex(DIM, threshold=0.0, centroids=centroids)
    rng = np.random.default_rng(9)
    index.assign(near(centroids[0], rng, 0.5))
    assert float(index.centroids[0] @ centroids[0]) > 0.99


def test_memory_stays_bounded_under_20000_random_vectors():
    index = SemanticIndex(384, threshold=0.82, max_entries=1000, max_clusters=64)
    # vectors; per entry its cluster, tenant and last use; per cluster weight, id, tenant, last use, label, planned
    bound = (1000 + 64) * 384 * 4 + 1000 * 3 * 8 + 64 * (5 * 8 + 1)
    vectors = random_units(20_000, dim=384, seed=10)
    for i, v in enumerate(vectors):
        index.assign(v)
        if i % 997 == 0:
            assert len(index) <= 1000 and index.nbytes() <= bound
    assert len(index) == 1000 and index.nbytes() <= bound
    assert index.stats.evictions == 19_000 and len(index.centroids) == 64


def test_least_recently_matched_entry_is_evicted():
    rng = np.random.default_rng(11)
    index = SemanticIndex(DIM, threshold=0.9, max_entries=3)
    a, b, c, d = random_units(4, seed=12)
    for v in (a, b, c):
        index.assign(v)
    assert index.assign(near(a, rng)).admitted is False  # a matched: b is now least recent
    assert index.assign(d).admitted is True
    entries, _ = index.entries()
    kept = [max(float(e @ v) for e in entries) > 0.99 for v in (a, b, c, d)]
    assert kept == [True, False, True, True]


def test_set_centroids_reassigns_indexed_entries():
    index = SemanticIndex(DIM)
    vectors = random_units(10, seed=13)
    for v in vectors:
        index.assign(v)
    index.set_centroids(vectors[:2], ids=[7, 9])
    _, clusters = index.entries()
    assert clusters[0] == 7 and clusters[1] == 9 and set(clusters.tolist()) <= {7, 9}
    assert index.assign(vectors[0]).cluster_id == 7


def test_bad_inputs_are_rejected():
    index = SemanticIndex(DIM)
    with pytest.raises(InvalidInputError):
        index.assign(np.zeros(DIM))
    with pytest.raises(InvalidInputError):
        index.assign(np.ones(DIM + 1))
    with pytest.raises(ValueError):
        index.set_centroids(random_units(3), ids=[1, 1, 2])
    with pytest.raises(ValueError):
        SemanticIndex(DIM, max_clusters=2, centroids=random_units(3))


def test_unnormalised_input_is_normalised():
    index = SemanticIndex(DIM)
    v = random_units(1, seed=14)[0]
    index.assign(3.0 * v)
    assert index.assign(v).admitted is False


def test_one_tenant_s_flood_cannot_evict_every_other_tenant_s_entries():
    rng = np.random.default_rng(0)
    index = SemanticIndex(8, threshold=0.999, max_entries=40, max_clusters=4, max_entries_per_tenant=10)
    quiet = [rng.normal(size=8).astype(np.float32) for _ in range(5)]
    for v in quiet:
        assert index.assign(v, tenant="quiet").admitted
    for _ in range(1000):  # a flood of distinct prompts from one tenant
        index.assign(rng.normal(size=8).astype(np.float32), tenant="flood")
    entries, _ = index.entries()
    assert len(entries) <= 40 and index.nbytes() < 64 * 1024
    unit = [v / np.linalg.norm(v) for v in quiet]
    kept = sum(any(np.allclose(e, u, atol=1e-5) for e in entries) for u in unit)
    assert kept == 5  # the flood replaced its own entries (10 at most), never the quiet tenant's


# ------------------------------------------------------------------------------- tenants share nothing
def _b_after(a_vectors, b_vector, **options):
    """What tenant B's prompt is assigned after tenant A sent ``a_vectors`` (and one of B's own before)."""
    index = SemanticIndex(DIM, threshold=0.8, **options)
    a_clusters = {index.assign(v, tenant="acme").cluster_id for v in a_vectors}
    result = index.assign(b_vector, tenant="globex")
    return result, a_clusters


@pytest.mark.parametrize("options", [{}, {"max_clusters": 2}])
def test_tenant_b_s_prompt_similar_to_tenant_a_s_gets_no_signal_of_a(options):
    rng = np.random.default_rng(3)
    a = random_units(2, seed=4)
    b = near(a[0], rng, 0.05)  # B's prompt: a near copy of one of A's
    assert float(a[0] @ b) > 0.9
    with_a, a_clusters = _b_after(a, b, **options)
    without_a, _ = _b_after([], b, **options)
    # The same similarity and the same kind of answer whether A exists or not, and never A's cluster.
    assert with_a.similarity == without_a.similarity == 1.0
    assert with_a.cluster_id not in a_clusters | {NO_CLUSTER}
    assert (with_a.admitted, with_a.label) == (without_a.admitted, without_a.label) == (True, -2)


def test_planned_centroids_belong_to_their_tenant():
    centroids = random_units(2, seed=5)
    index = SemanticIndex(DIM, threshold=0.8, learn_online=False)
    index.set_centroids(centroids, ids=[7, 9], tenants=["acme", "globex"])
    assert index.assign(centroids[0], tenant="acme").cluster_id == 7
    assert index.assign(centroids[0], tenant="globex").cluster_id == 9  # its own, though A's is nearer
    assert index.assign(centroids[0], tenant="initech").cluster_id == NO_CLUSTER  # none of its own


def test_a_full_cluster_table_gives_a_tenant_below_its_share_a_slot_of_one_above_it():
    index = SemanticIndex(DIM, threshold=0.99, max_clusters=4, max_clusters_per_tenant=1)
    vectors = random_units(6, seed=6)
    flood = [index.assign(v, tenant="flood").cluster_id for v in vectors[:4]]
    assert len(set(flood)) == 4  # alone, it uses the whole table
    quiet = index.assign(vectors[4], tenant="quiet")
    assert quiet.similarity == 1.0 and quiet.cluster_id not in flood
    assert index.assign(vectors[5], tenant="quiet").cluster_id == quiet.cluster_id  # at its share: its own


def test_the_cluster_id_a_caller_sees_is_per_tenant_and_keyed():
    from warmup_tools.embedding_cache.semantic import REPORTED_CLUSTER_IDS, reported_cluster_id

    key = b"k" * 32
    ids = {reported_cluster_id(key, tenant, n) for tenant in ("acme", "globex") for n in range(50)}
    assert len(ids) == 100 and all(0 <= i < REPORTED_CLUSTER_IDS for i in ids)
    assert reported_cluster_id(key, "acme", 3) == reported_cluster_id(key, "acme", 3)  # stable
    assert reported_cluster_id(key, "acme", 3) != reported_cluster_id(b"x" * 32, "acme", 3)  # keyed
    assert reported_cluster_id(key, "acme", NO_CLUSTER) == NO_CLUSTER
