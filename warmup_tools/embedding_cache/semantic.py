"""The semantic layer of the embedding cache: nearest-cluster assignment and an index of distinct prompts.

Every prompt embedding (L2-normalised, so a dot product is a cosine) is assigned to the nearest cluster
centroid **of its own tenant**, where centroids come from a warm-up plan (:meth:`SemanticIndex.set_centroids`,
each planned cluster belongs to the tenant the plan found it in) or are learnt online by leader clustering
from that tenant's prompts only. Separately, a bounded index keeps one embedding per group of
near-duplicate prompts of one tenant. Both lookups are one matrix-vector product each.

NOTE: clusters are per tenant because the model's outputs (``cluster_id``, ``similarity``) reach whoever
calls ``embedding_cache`` directly: a cluster another tenant's prompts formed would tell that caller a
similar prompt was sent. For the same reason the id a caller sees is :func:`reported_cluster_id`, a
keyed digest of its tenant and the cluster, not the running counter behind it (which would count every
tenant's clusters). What tenants still share is the capacity (``max_clusters``, with a fair share per
tenant once it is full): how many clusters others hold, never what their prompts say.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from warmup_tools.common.errors import InvalidInputError
from warmup_tools.common.files import write_atomic

#: Where ``stanzas --plan`` leaves the plan's cluster centroids, relative to the embedding_cache folder;
#: every instance loads them at start (one writer: :func:`write_centroids`).
CENTROIDS_FILE = Path("warmup") / "wt_centroids.json"

#: Cluster id reported when there are no centroids and none may be learnt.
NO_CLUSTER = -1
#: How many prompts a centroid from a warm-up plan counts for in the running mean.
#: NOTE: a planned centroid summarises many prompts; with a weight of 1 the first online update would move it
#: halfway to a single prompt and undo the plan.
PLANNED_CENTROID_WEIGHT = 100.0
#: First capacity of the entry matrix; it doubles up to max_entries.
INITIAL_CAPACITY = 64
#: Reported cluster ids lie in [0, REPORTED_CLUSTER_IDS) (lora_adapter's ``cluster_id`` input accepts them).
REPORTED_CLUSTER_IDS = 1 << 20
#: The tenant of planned centroids from a file that does not name one.
DEFAULT_TENANT = "default"


@dataclasses.dataclass(frozen=True, slots=True)
class Assignment:
    """Where one prompt embedding went.

    ``cluster_id`` is one of the tenant's own clusters (or :data:`NO_CLUSTER`); ``similarity`` is the cosine
    between the vector and its centroid as it was before this vector updated it (1.0 when the vector started
    a new cluster, -1.0 with :data:`NO_CLUSTER`). It is not the similarity to the nearest indexed entry.
    ``admitted`` says whether the vector entered the index of distinct entries (False: a near duplicate of
    one of the tenant's indexed entries).
    """

    cluster_id: int
    similarity: float
    admitted: bool
    #: The cluster's name within its tenant (what :func:`reported_cluster_id` keys): a planned cluster's
    #: plan id, an online one's per-tenant ordinal as ``-2 - ordinal``; :data:`NO_CLUSTER` with none.
    label: int = NO_CLUSTER


@dataclasses.dataclass(slots=True)
class SemanticStats:
    assigned: int = 0
    clusters_created: int = 0
    admitted: int = 0
    duplicates: int = 0
    evictions: int = 0
    entries: int = 0
    clusters: int = 0


class SemanticIndex:
    """Nearest-cluster assignment plus a bounded index of distinct prompt embeddings."""

    def __init__(self, dim: int = 384, *, threshold: float = 0.82, max_entries: int = 4096,
                 max_clusters: int = 256, centroids: np.ndarray | None = None, learn_online: bool = True,
                 max_entries_per_tenant: int | None = None, max_clusters_per_tenant: int | None = None) -> None:
        """``max_entries_per_tenant`` (default a quarter of ``max_entries``, at least 1) keeps one tenant's
        flood of distinct prompts from evicting every other tenant's entries: once the index is full, a
        tenant at its share replaces its own least recently used entry (a lone tenant still uses it all).
        ``max_clusters_per_tenant`` (default a quarter of ``max_clusters``, at least 1) works the same way
        for clusters: once ``max_clusters`` are in use, a tenant below its share replaces the least recently
        used online cluster of a tenant above it, and one at its share joins its nearest own cluster."""
        if dim < 1:
            raise ValueError("dim must be >= 1")
        if not -1.0 <= threshold <= 1.0:
            raise ValueError("threshold is a cosine: it must lie in [-1, 1]")
        if max_entries < 0 or max_clusters < 0:
            raise ValueError("max_entries and max_clusters must be >= 0")
        self.dim = dim
        self.threshold = float(threshold)
        self.max_entries = max_entries
        self.max_clusters = max_clusters
        self.max_entries_per_tenant = (max(1, max_entries // 4) if max_entries_per_tenant is None
                                       else max_entries_per_tenant)
        self.max_clusters_per_tenant = (max(1, max_clusters // 4) if max_clusters_per_tenant is None
                                        else max_clusters_per_tenant)
        self.learn_online = learn_online
        self.stats = SemanticStats()
        self._lock = threading.Lock()
        # NOTE: all state lives in fixed-width numpy arrays whose row counts never exceed max_clusters and
        # max_entries, so memory is bounded whatever the traffic (see nbytes()).
        self._centroids = np.zeros((max_clusters, dim), dtype=np.float32)
        self._weights = np.zeros(max_clusters, dtype=np.float64)
        self._cluster_ids = np.zeros(max_clusters, dtype=np.int64)
        #: A 63-bit hash of the tenant each cluster belongs to, when it was last used, and whether a plan made it.
        self._cluster_tenants = np.zeros(max_clusters, dtype=np.int64)
        self._cluster_used = np.zeros(max_clusters, dtype=np.int64)
        self._cluster_planned = np.zeros(max_clusters, dtype=bool)
        self._cluster_labels = np.zeros(max_clusters, dtype=np.int64)
        self._n_clusters = 0
        self._next_cluster_id = 0
        capacity = min(max_entries, INITIAL_CAPACITY)
        self._entries = np.zeros((capacity, dim), dtype=np.float32)
        self._entry_clusters = np.zeros(capacity, dtype=np.int64)
        #: A 63-bit hash of the tenant of each entry (the per-tenant share).
        self._entry_tenants = np.zeros(capacity, dtype=np.int64)
        #: Logical time of each entry's admission or last match: the least recent is evicted first.
        self._last_used = np.zeros(capacity, dtype=np.int64)
        self._n_entries = 0
        self._tick = 0
        if centroids is not None:
            self.set_centroids(centroids)

    # -- public API -------------------------------------------------------------------------------------

    def assign(self, vector: np.ndarray, tenant: str = "default") -> Assignment:
        """Assign ``vector`` to its nearest cluster (learning one when allowed) and admit it to the index
        of distinct entries unless an indexed entry is at least ``threshold`` similar."""
        v = self._unit(vector)
        with self._lock:
            self._tick += 1
            key = _tenant_key(tenant)
            slot, similarity = self._assign_cluster(v, key)
            cluster_id = int(self._cluster_ids[slot]) if slot >= 0 else NO_CLUSTER
            label = int(self._cluster_labels[slot]) if slot >= 0 else NO_CLUSTER
            admitted = self._admit(v, cluster_id, key)
            self.stats.assigned += 1
            return Assignment(cluster_id, similarity, admitted, label)

    def set_centroids(self, centroids: np.ndarray, ids: Sequence[int] | None = None,
                      tenants: Sequence[str] | None = None) -> None:
        """Replace the clusters by ``centroids`` (k x dim, rows are normalised) with ``ids`` (default 0..k-1),
        each the cluster of one of ``tenants`` (default :data:`DEFAULT_TENANT`); indexed entries are
        re-assigned to their nearest new centroid of their own tenant."""
        matrix = np.asarray(centroids, dtype=np.float32)
        if matrix.ndim != 2 or matrix.shape[1] != self.dim:
            raise ValueError(f"centroids must have shape (k, {self.dim}), not {matrix.shape}")
        k = matrix.shape[0]
        if k > self.max_clusters:
            raise ValueError(f"{k} centroids exceed max_clusters={self.max_clusters}")
        norms = np.linalg.norm(matrix, axis=1, keepdims=True)
        if k and (not np.all(np.isfinite(norms)) or np.any(norms == 0)):
            raise ValueError("centroids must be finite and non-zero")
        id_array = np.arange(k, dtype=np.int64) if ids is None else np.asarray(list(ids), dtype=np.int64)
        if id_array.shape != (k,) or len(set(id_array.tolist())) != k:
            raise ValueError("ids must be k distinct integers")
        owners = [DEFAULT_TENANT] * k if tenants is None else list(tenants)
        if len(owners) != k:
            raise ValueError("tenants must name one tenant per centroid")
        with self._lock:
            self._centroids[:k] = matrix / norms if k else matrix
            self._centroids[k:] = 0.0
            self._weights[:k] = PLANNED_CENTROID_WEIGHT
            self._weights[k:] = 0.0
            self._cluster_ids[:k] = id_array
            self._cluster_tenants[:k] = [_tenant_key(t) for t in owners]
            self._cluster_used[:k] = self._tick
            self._cluster_planned[:k] = True
            self._cluster_labels[:k] = id_array
            self._cluster_planned[k:] = False
            self._n_clusters = k
            self._next_cluster_id = int(id_array.max()) + 1 if k else 0
            n = self._n_entries
            if n and k:
                sims = self._entries[:n] @ self._centroids[:k].T
                own = self._entry_tenants[:n, None] == self._cluster_tenants[None, :k]
                sims = np.where(own, sims, -np.inf)
                nearest = np.argmax(sims, axis=1)
                self._entry_clusters[:n] = np.where(own.any(axis=1), self._cluster_ids[nearest], NO_CLUSTER)
            elif n:
                self._entry_clusters[:n] = NO_CLUSTER
            self.stats.clusters = k

    @property
    def centroids(self) -> np.ndarray:
        """A copy of the current centroids (k x dim)."""
        with self._lock:
            return self._centroids[:self._n_clusters].copy()

    @property
    def cluster_ids(self) -> np.ndarray:
        with self._lock:
            return self._cluster_ids[:self._n_clusters].copy()

    def entries(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the indexed distinct embeddings (n x dim) and the cluster id of each."""
        with self._lock:
            n = self._n_entries
            return self._entries[:n].copy(), self._entry_clusters[:n].copy()

    def nbytes(self) -> int:
        """Bytes held by the index's arrays (at most about (max_entries + max_clusters) * dim * 4)."""
        arrays = (self._centroids, self._weights, self._cluster_ids, self._entries, self._entry_clusters,
                  self._last_used, self._entry_tenants, self._cluster_tenants, self._cluster_used,
                  self._cluster_planned, self._cluster_labels)
        return int(sum(a.nbytes for a in arrays))

    def __len__(self) -> int:
        return self._n_entries

    # -- helpers ----------------------------------------------------------------------------------------

    def _unit(self, vector: np.ndarray) -> np.ndarray:
        v = np.asarray(vector, dtype=np.float32).reshape(-1)
        if v.shape[0] != self.dim:
            raise InvalidInputError(f"embedding has {v.shape[0]} values, the semantic index expects {self.dim}")
        norm = float(np.linalg.norm(v))
        if not np.isfinite(norm) or norm == 0.0:
            raise InvalidInputError("embedding must be finite and non-zero")
        # NOTE: embeddings arrive normalised; normalising again costs one dot product and keeps cosines honest
        # for callers that pass raw vectors.
        return v if abs(norm - 1.0) < 1e-4 else v / norm

    def _assign_cluster(self, v: np.ndarray, tenant: int) -> tuple[int, float]:
        """The slot of the nearest of the tenant's own clusters, or of a new one of its own, and the
        similarity; slot -1 for none (call with the lock held)."""
        k = self._n_clusters
        own = np.flatnonzero(self._cluster_tenants[:k] == tenant)
        if own.size:
            sims = self._centroids[own] @ v
            best = int(own[int(np.argmax(sims))])
            similarity = float(sims.max())
        else:
            best, similarity = -1, -1.0
        if (not own.size or similarity < self.threshold) and self.learn_online and self.max_clusters:
            slot = (k if k < self.max_clusters
                    else self._evictable_cluster() if own.size < self.max_clusters_per_tenant else None)
            if slot is not None:
                self._new_cluster(slot, v, tenant, own)
                return slot, 1.0
        if not own.size:
            return -1, -1.0
        self._cluster_used[best] = self._tick
        if self.learn_online:
            self._weights[best] += 1.0
            centroid = self._centroids[best]
            centroid += (v - centroid) / np.float32(self._weights[best])
            norm = float(np.linalg.norm(centroid))
            if norm > 0.0:
                centroid /= norm
        return best, similarity

    def _evictable_cluster(self) -> int | None:
        """The least recently used online cluster of a tenant above its share (planned ones stay), or None."""
        k = self._n_clusters
        _, inverse, counts = np.unique(self._cluster_tenants[:k], return_inverse=True, return_counts=True)
        online = np.flatnonzero(~self._cluster_planned[:k] & (counts[inverse] > self.max_clusters_per_tenant))
        if not online.size:
            return None
        slot = int(online[int(np.argmin(self._cluster_used[online]))])
        gone = self._cluster_ids[slot]
        n = self._n_entries
        self._entry_clusters[:n][self._entry_clusters[:n] == gone] = NO_CLUSTER
        return slot

    def _new_cluster(self, slot: int, v: np.ndarray, tenant: int, own: np.ndarray) -> int:
        online = own[~self._cluster_planned[own]]
        # NOTE: the tenant's own count, so what it is shown depends on its own prompts only.
        ordinal = int((-2 - self._cluster_labels[online]).max()) + 1 if online.size else 0
        self._cluster_labels[slot] = -2 - ordinal
        cluster_id = self._next_cluster_id
        self._next_cluster_id += 1
        self._centroids[slot] = v
        self._weights[slot] = 1.0
        self._cluster_ids[slot] = cluster_id
        self._cluster_tenants[slot] = tenant
        self._cluster_used[slot] = self._tick
        self._cluster_planned[slot] = False
        if slot == self._n_clusters:
            self._n_clusters += 1
        self.stats.clusters_created += 1
        self.stats.clusters = self._n_clusters
        return cluster_id

    def _admit(self, v: np.ndarray, cluster_id: int, tenant: int = 0) -> bool:
        n = self._n_entries
        own = self._entry_tenants[:n] == tenant
        if n and own.any():
            candidates = np.flatnonzero(own)  # a near duplicate of the tenant's own entries only
            sims = self._entries[candidates] @ v
            nearest = int(candidates[int(np.argmax(sims))])
            if sims.max() >= self.threshold:
                self._last_used[nearest] = self._tick
                self.stats.duplicates += 1
                return False
        if self.max_entries == 0:
            return False
        if n and n >= self.max_entries and int(np.count_nonzero(own)) >= self.max_entries_per_tenant:
            # A full index, and the tenant at its share: its own least recently used entry makes room.
            slot = int(np.flatnonzero(own)[np.argmin(self._last_used[:n][own])])
            self.stats.evictions += 1
        elif n < self.max_entries:
            if n == self._entries.shape[0]:
                self._grow()
            slot = n
            self._n_entries = n + 1
        else:
            slot = int(np.argmin(self._last_used[:n]))
            self.stats.evictions += 1
        self._entries[slot] = v
        self._entry_clusters[slot] = cluster_id
        self._entry_tenants[slot] = tenant
        self._last_used[slot] = self._tick
        self.stats.admitted += 1
        self.stats.entries = self._n_entries
        return True

    def _grow(self) -> None:
        capacity = min(self.max_entries, max(1, 2 * self._entries.shape[0]))
        n = self._n_entries
        entries = np.zeros((capacity, self.dim), dtype=np.float32)
        entries[:n] = self._entries[:n]
        clusters = np.zeros(capacity, dtype=np.int64)
        clusters[:n] = self._entry_clusters[:n]
        last_used = np.zeros(capacity, dtype=np.int64)
        last_used[:n] = self._last_used[:n]
        tenants = np.zeros(capacity, dtype=np.int64)
        tenants[:n] = self._entry_tenants[:n]
        self._entries, self._entry_clusters, self._last_used = entries, clusters, last_used
        self._entry_tenants = tenants


def reported_cluster_id(key: bytes, tenant: str, label: int) -> int:
    """The id a caller of ``tenant`` is shown for the cluster of :attr:`Assignment.label` ``label``: a keyed
    digest in [0, :data:`REPORTED_CLUSTER_IDS`), stable for the tenant, unrelated across tenants, and
    silent about any other tenant's clusters; :data:`NO_CLUSTER` stays."""
    if label == NO_CLUSTER:
        return NO_CLUSTER
    digest = hashlib.blake2b(f"{tenant}\0{label}".encode("utf-8"), key=key[:64], digest_size=8).digest()
    return int.from_bytes(digest, "little") % REPORTED_CLUSTER_IDS


def _tenant_key(tenant: str) -> int:
    return int.from_bytes(hashlib.blake2b(tenant.encode("utf-8"), digest_size=8).digest(), "little") >> 1


def write_centroids(path: Path, clusters: Iterable[Mapping[str, Any]]) -> int:
    """Write ``[{"cluster": id, "tenant": name, "centroid": [...]}, ...]`` atomically (removing the file
    when empty); each planned cluster belongs to the tenant whose prompts formed it."""
    rows = [{"cluster": int(c["cluster"]), "tenant": str(c.get("tenant") or DEFAULT_TENANT),
             "centroid": list(c["centroid"])} for c in clusters if c.get("centroid")]
    if not rows:
        Path(path).unlink(missing_ok=True)
        return 0
    write_atomic(Path(path), json.dumps(rows))
    return len(rows)
