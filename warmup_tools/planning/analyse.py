"""Warm-up planner: decide from real request logs which KV prefixes, embeddings and tokenisations to warm.

Pipeline (:func:`warmup_tools.planning.select.build_plan`); this module does steps 1 to 5:

1. **Read and attribute.** Records are grouped by KV scope, ``(tenant, adapter)``, because KV computed
   for one tenant or adapter is never served to another (see :class:`~warmup_tools.kv.prefix_cache.CacheScope`).
   Identical prompts are deduplicated (weighted by count). Redacted records (no ``prompt``) still count
   for heat: one whose ``prompt_digest`` matches a prompt seen in clear in its scope is attributed to it,
   the rest scale their scope's heat up (missing at random), and none of them is ever planned.
2. **Embed** with the project's embedder, once per distinct text, in length-sorted batches: at most
   ``max_points_per_group`` distinct prompts per scope and ``max_embeddings`` overall, a seeded sample weighted
   by decayed request count (Efraimidis-Spirakis) shared fairly between scopes, and only their first
   ``embed_chars`` characters.
3. **Cluster** each scope's sample with scikit-learn's HDBSCAN on L2-normalised embeddings projected on their
   leading principal axes (one per 16 sampled prompts, at least 2, at most 16), ``allow_single_cluster``,
   ``min_samples=3``, a prompt repeated ``n`` times entering as ``min(n, min_cluster_size)`` points; a cluster
   whose members sit on average further than ``max_spread`` from their centroid is returned to noise. Prompts
   HDBSCAN did not place are placed through token blocks: one that carries a cluster's whole chosen prefix
   (step 5) joins it; an unsampled one that carries none takes the majority label of the deepest block it
   shares with the sample (noise if it shares no full block). Why each of these choices, with what was
   measured: docs/planner.md, "How the planner chooses".
4. **Heat** per cluster: decayed frequency, ``sum(0.5 ** ((now - ts) / half_life_s))`` over its requests,
   divided by the decayed length of the observed span, i.e. an estimate of requests per hour. The
   estimator is scored on held-out data (fit on the first 80% of the span, predict each cluster's count
   in the last 20%, weighted absolute percentage error). A learnt forecast (gradient boosted trees over
   recent counts, trend, time of day, tenant and adapter; :mod:`warmup_tools.planning.forecast`) is scored
   the same way and replaces the decayed frequency only when its error is lower; both errors are reported.
5. **Prefix per cluster**, to explain the plan (not to decide it): the block chain carried by at least
   ``share`` (0.8) of the cluster's requests (count-weighted), as deep as it goes. Only full blocks are
   cached, and a request reuses at most ``(len(prompt) - 1) // block_size`` blocks (the last token is
   always prefilled, see ``generation.py``), so a block counts only where it is usable.
6. **Select KV blocks on the prefix tree** (:mod:`warmup_tools.planning.select`). KV reuse is about exact
   token prefixes, not about meaning: distinct system prompts that open with the same words share one
   embedding cluster, but only their first few tokens. So each scope's block-aligned token prefixes form
   a tree (:class:`BlockTrie`, the same chaining the server hashes), each node carrying the decayed,
   forecast-scaled rate of requests through it. A request saves ``block_size`` prefill tokens for every
   cached block on its chain, so a set of cached blocks (prefix-closed) saves ``block_size * sum(rate)``;
   each block costs the same KV bytes and warm seconds. A child's rate never exceeds its parent's, hence
   taking the hottest frontier block first, under every budget, picks the best prefix-closed set. Blocks
   carried by fewer than ``min_block_requests`` logged requests are not candidates. The chosen blocks
   become one item per leaf (a nested prefix counted only for its extra blocks), and each item names
   the cluster whose requests carry it most. Each item is pinned for its reuse horizon, ``retention_s``
   (:mod:`warmup_tools.planning.horizons`).
7. **Size by replay** (given the target's KV settings): the budget the selection runs under is cut to the warm
   share that served the most prompt tokens when the log's tail was replayed against the target's cache with a
   plan made from the rest (:mod:`warmup_tools.planning.replay`; none when no share gains).
8. **Emit** a versioned, content-hashed :class:`~warmup_tools.common.plan.Plan` (JSON, sorted keys).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from typing import Any, Iterable, Mapping, Protocol, Sequence

import numpy as np

from warmup_tools.common.digests import stable_seed, text_digest
from warmup_tools.common.errors import ConfigError, FileFormatError
from warmup_tools.common.records import RecordError, RequestRecord
from warmup_tools.kv.config import DEFAULT_BLOCK_SIZE
from warmup_tools.planning.forecast import HeatForecast, forecast_heat

LOGGER = logging.getLogger(__name__)


#: Cluster label of prompts that belong to no cluster (HDBSCAN's noise: the long tail).
NOISE = -1


_MIN_SPAN_S = 60.0


class Embedder(Protocol):
    def embed_batch(self, texts: list[str]) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True, slots=True)
class PlanOptions:
    """How traffic is analysed; the defaults are what the module docstring argues for."""

    half_life_s: float = 6 * 3600.0
    #: Share of a cluster's requests (count-weighted) that must carry a prefix for it to be chosen.
    share: float = 0.8
    min_cluster_size: int = 5
    min_samples: int | None = 3
    #: At most this many principal axes (0: cluster the raw embeddings), and one per
    #: ``points_per_component`` sampled prompts (at least 2).
    pca_components: int = 16
    points_per_component: int = 16
    #: Clusters looser than this (mean L2 distance of unit embeddings to their centroid) become noise.
    max_spread: float | None = 0.6
    max_points_per_group: int = 512
    max_embeddings: int = 1024
    embed_batch_size: int = 64
    #: Characters of a prompt that are embedded for clustering (the embedder reads 256 tokens at most, and
    #: its cost grows with length); and of a member's text after its cluster's shared opening, for the
    #: template split.
    embed_chars: int = 600
    split_chars: int = 200
    #: Share of the observed span held out to score the heat estimate.
    holdout: float = 0.2
    seed: int = 0
    #: A KV block is a candidate only when at least this many logged requests carry it: a block seen
    #: once is a one-off prompt's, whose decayed rate overstates its chance to recur.
    min_block_requests: int = 2
    #: With budget left once those blocks are chosen, warm whole one-off prompts that share no block with any
    #: other request of their scope (the requests that would otherwise start cold), the most likely to recur
    #: per block first; see :func:`warmup_tools.planning.select._select`.
    warm_one_off_prompts: bool = True
    #: Rolling plans: a block the previous plan warmed ranks as if its rate were this much higher, so an
    #: item is replaced only by one that is clearly hotter and plans do not flap between runs.
    hysteresis: float = 0.25
    #: How the KV budget is split across adapters whose hot sets do not all fit: ``measured`` (by each
    #: adapter's cold share and traffic, :mod:`warmup_tools.planning.arbitrate`) or ``fixed`` (every
    #: adapter up to ``kv_bytes_per_adapter``, the hottest blocks anywhere first).
    arbitration: str = "measured"
    #: Reuse horizons (``retention_s`` of each item, :mod:`warmup_tools.planning.horizons`): this quantile of the
    #: gaps between consecutive logged requests that carry an item's whole prefix, ...
    retention_quantile: float = 0.9
    #: ... bounded to ``[min_retention_s, max_retention_s]`` seconds; ...
    min_retention_s: float = 30.0
    max_retention_s: float = 3600.0
    #: ... and from the gaps of the item's class (a shared template's prefix or one session's) when the item
    #: itself has fewer than this many gaps.
    min_retention_gaps: int = 3
    #: Replay sizing (:mod:`warmup_tools.planning.replay`): the last ``replay_tail`` of the log's span is
    #: replayed against the target's KV cache with a plan made from the rest, at each of ``replay_shares``
    #: (shares of ``kv_cache_bytes``; those above what the warm-up cap allows become that cap, which is always
    #: tried), and the final plan is cut to the share that served the most prompt tokens (ties: the smaller).
    replay_tail: float = 0.3
    replay_shares: tuple[float, ...] = (0.0, 0.05, 0.1, 0.2, 0.35, 0.5)
    #: Fewer replayable records (with a prompt) in the tail than this: no replay, the plan is sized by the
    #: budgets alone (as before replay sizing), and its summary says so.
    replay_min_records: int = 50
    #: Replicas that each warm this plan behind a prefix-affine router: the replay serves one replica's share of
    #: the tail (:func:`warmup_tools.planning.replay.one_replicas_share`), as each replica will see it.
    replay_replicas: int = 1

    def __post_init__(self) -> None:
        if self.half_life_s <= 0 or not 0.0 < self.share <= 1.0 or self.min_cluster_size < 2:
            raise ConfigError("half_life_s > 0, 0 < share <= 1 and min_cluster_size >= 2 are required")
        if min(self.max_points_per_group, self.max_embeddings, self.embed_batch_size, self.points_per_component) < 1:
            raise ConfigError("max_points_per_group, max_embeddings, embed_batch_size and points_per_component "
                              "must be >= 1")
        if not 0.0 < self.holdout < 1.0:
            raise ConfigError(f"holdout must be in (0, 1), got {self.holdout!r}")
        if self.arbitration not in ("measured", "fixed"):
            raise ConfigError(f"arbitration must be measured or fixed, got {self.arbitration!r}")
        if self.min_block_requests < 1 or not 0.0 <= self.hysteresis <= 10.0:
            raise ConfigError(f"min_block_requests must be >= 1 and hysteresis in [0, 10], got "
                              f"{self.min_block_requests!r} and {self.hysteresis!r}")
        if (not 0.0 < self.retention_quantile <= 1.0 or not 0.0 < self.min_retention_s <= self.max_retention_s
                or not math.isfinite(self.max_retention_s) or self.min_retention_gaps < 1):
            raise ConfigError("0 < retention_quantile <= 1, 0 < min_retention_s <= max_retention_s (finite) and "
                              f"min_retention_gaps >= 1 are required, got {self.retention_quantile!r}, "
                              f"{self.min_retention_s!r}, {self.max_retention_s!r}, {self.min_retention_gaps!r}")
        if not 1 <= self.replay_replicas <= 4096:
            raise ConfigError(f"replay_replicas must be 1 to 4096, got {self.replay_replicas!r}")
        if not 0.0 < self.replay_tail < 1.0 or self.replay_min_records < 1:
            raise ConfigError(f"replay_tail must be in (0, 1) and replay_min_records >= 1, got {self.replay_tail!r} "
                              f"and {self.replay_min_records!r}")
        if not self.replay_shares or not all(0.0 <= s <= 1.0 for s in self.replay_shares):
            raise ConfigError(f"replay_shares must be shares of the KV budget in [0, 1], got {self.replay_shares!r}")


#: The analysis options the module docstring argues for.
DEFAULT_OPTIONS = PlanOptions()


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixChoice:
    """The prefix chosen for a group of prompts: full blocks only, and the weighted share carrying it."""

    token_ids: tuple[int, ...]
    share: float

    @property
    def tokens(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass(slots=True)
class ClusterInfo:
    """One cluster of one scope. ``cluster`` is unique in the plan; sizes count requests."""

    tenant: str
    adapter: str
    cluster: int
    size: int
    unique_prompts: int
    sampled: int
    heat_per_hour: float
    centroid: np.ndarray
    representative: str
    prefix: PrefixChoice | None


@dataclasses.dataclass(slots=True)
class TrafficAnalysis:
    """What :func:`analyse_traffic` found; :func:`~warmup_tools.planning.select.build_plan` turns it into a plan."""

    now: float
    block_size: int
    options: PlanOptions
    records: int
    planned_records: int
    redacted_records: int
    unique_prompts: int
    embedded_prompts: int
    clusters: list[ClusterInfo]
    #: Per input record: its cluster id, NOISE, or None for a redacted record whose digest matches no
    #: prompt seen in clear in its scope.
    record_clusters: list[int | None]
    noise_share: float
    heat_error_baseline: float | None
    heat_error_learnt: float | None
    #: decayed_frequency, or learnt_gbdt when the learnt forecast beat it on the held-out window.
    heat_model: str
    heat_model_reason: str
    scopes: dict[tuple[str, str], ScopeTraffic]


# ------------------------------------------------------------------------------------------ public API
def shared_prefix(
    token_lists: Sequence[Sequence[int]],
    weights: Sequence[float] | None = None,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    share: float = 0.8,
) -> PrefixChoice:
    """The longest block prefix carried by at least ``share`` of the (weighted) token lists.

    Only blocks a request can reuse count: at most ``(len(ids) - 1) // block_size`` of them. Returns an
    empty choice when not even one block is shared widely enough.
    """
    trie = BlockTrie(block_size)
    weights = [1.0] * len(token_lists) if weights is None else list(weights)
    chains = [trie.chain(ids) for ids in token_lists]
    path, carried = _choose_chain(chains, weights, share)
    if not path:
        return PrefixChoice((), 0.0)
    member = next(i for i, c in enumerate(chains) if len(c) >= len(path) and c[len(path) - 1] == path[-1])
    return PrefixChoice(tuple(int(t) for t in token_lists[member][: len(path) * block_size]), carried)


def analyse_traffic(
    records: Iterable[RequestRecord | Mapping[str, Any]],
    tokenizer: Any,
    embedder: Embedder,
    *,
    now: float | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    options: PlanOptions = DEFAULT_OPTIONS,
    progress: bool = True,
) -> TrafficAnalysis:
    """Attribute, embed, cluster and heat the traffic in ``records`` (steps 1-5 of the module docstring)."""
    if block_size < 1:
        raise ConfigError(f"block_size must be >= 1, got {block_size}")
    rows = [normalise_record(index, record) for index, record in enumerate(records)]
    if now is None:
        now = max((r.ts for r in rows), default=0.0)
    t_first = min((r.ts for r in rows), default=now)
    eff_hours = _decayed_hours(max(now - t_first, _MIN_SPAN_S), options.half_life_s)

    scopes: dict[tuple[str, str], ScopeTraffic] = {}
    for row in rows:
        scope = scopes.get((row.tenant, row.adapter))
        if scope is None:
            scope = scopes[(row.tenant, row.adapter)] = ScopeTraffic(row.tenant, row.adapter, BlockTrie(block_size))
        row.weight = 0.5 ** (max(now - row.ts, 0.0) / options.half_life_s)
        scope.total_weight += row.weight
        if row.prompt is not None:
            prompt = scope.prompts.get(row.prompt)
            if prompt is None:
                prompt = scope.prompts[row.prompt] = PromptStats(row.prompt)
            prompt.add(row)
            if row.digest is not None:
                scope.by_digest.setdefault(row.digest, prompt)
    record_clusters: list[int | None] = [None] * len(rows)
    redacted = 0
    for row in rows:
        if row.prompt is None:
            redacted += 1
            prompt = scopes[(row.tenant, row.adapter)].by_digest.get(row.digest) if row.digest else None
            if prompt is not None:
                prompt.add(row)
    for scope in scopes.values():
        scope.finish()

    _tokenise(scopes, tokenizer, progress)
    vectors = _embed_samples(scopes, embedder, options, progress)
    for scope in _progress(sorted(scopes.values(), key=ScopeTraffic.key), progress, "clustering", "scope"):
        _cluster_scope(scope, vectors, options)
        _split_templates(scope, vectors, embedder, options)
        _assign_rest(scope, options.share)

    events = [(rows[index].ts, (scope.tenant, scope.adapter, prompt.label), scope.tenant, scope.adapter)
              for scope in scopes.values() for prompt in scope.prompts.values() if prompt.label != NOISE
              for index in prompt.rows]
    forecast = forecast_heat(events, now=now, half_life_s=options.half_life_s, holdout=options.holdout,
                             seed=options.seed)
    factors = _forecast_factors(scopes, forecast, eff_hours)

    clusters: list[ClusterInfo] = []
    for scope in sorted(scopes.values(), key=ScopeTraffic.key):
        scale = scope.total_weight / scope.attributed_weight if scope.attributed_weight > 0 else 0.0
        for prompt in scope.prompts.values():
            factor = factors.get((scope.tenant, scope.adapter, prompt.label), 1.0)
            rate = prompt.decayed * scale / eff_hours * factor
            for node in prompt.chain:
                scope.trie.rate[node] += rate
                scope.trie.count[node] += prompt.count
        for local, members in sorted(scope.members().items()):
            info, chain = _cluster_info(scope, members, vectors, scale, eff_hours, options, len(clusters))
            info.heat_per_hour *= factors.get((scope.tenant, scope.adapter, local), 1.0)
            scope.cluster_ids[local] = info.cluster
            scope.chains[info.cluster] = chain
            clusters.append(info)
        for prompt in scope.prompts.values():
            label = scope.cluster_ids.get(prompt.label, NOISE)
            for index in prompt.rows:
                record_clusters[index] = label

    planned = sum(p.count for s in scopes.values() for p in s.prompts.values())
    noise = sum(p.count for s in scopes.values() for p in s.prompts.values() if p.label == NOISE)
    return TrafficAnalysis(
        now=now,
        block_size=block_size,
        options=options,
        records=len(rows),
        planned_records=sum(1 for r in rows if r.prompt is not None),
        redacted_records=redacted,
        unique_prompts=sum(len(s.prompts) for s in scopes.values()),
        embedded_prompts=len(vectors),
        clusters=clusters,
        record_clusters=record_clusters,
        noise_share=noise / planned if planned else 0.0,
        heat_error_baseline=forecast.baseline_error,
        heat_error_learnt=forecast.learnt_error,
        heat_model=forecast.model,
        heat_model_reason=forecast.reason,
        scopes=scopes,
    )


# ---------------------------------------------------------------------------------------------- helpers
@dataclasses.dataclass(slots=True)
class _Row:
    index: int
    ts: float
    tenant: str
    adapter: str
    prompt: str | None
    digest: str | None
    weight: float = 0.0


@dataclasses.dataclass(slots=True)
class PromptStats:
    """One distinct prompt text of one scope."""

    text: str
    count: int = 0
    decayed: float = 0.0
    rows: list[int] = dataclasses.field(default_factory=list)
    #: Arrival of each of ``rows`` (epoch seconds), for reuse horizons.
    times: list[float] = dataclasses.field(default_factory=list)
    ids: list[int] = dataclasses.field(default_factory=list)
    chain: list[int] = dataclasses.field(default_factory=list)
    sampled: bool = False
    label: int = NOISE

    def add(self, row: _Row) -> None:
        self.count += 1
        self.decayed += row.weight
        self.rows.append(row.index)
        self.times.append(row.ts)


class BlockTrie:
    """The prefix tree of one scope over block-aligned token prefixes.

    A node id names a whole prefix, like the server's chained block hash (but exact). Each node carries
    the decayed request rate through it (``rate``, requests per hour) and the number of requests through
    it (``count``); a child's rate and count never exceed its parent's.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._nodes: dict[tuple[int, tuple[int, ...]], int] = {}
        self.rate: list[float] = []
        self.count: list[int] = []
        #: Parent node of each node (-1 for a first block).
        self.parent: list[int] = []

    def __len__(self) -> int:
        return len(self.rate)

    def chain(self, ids: Sequence[int]) -> list[int]:
        """Node ids of the usable full blocks of ``ids`` (the last token is always prefilled)."""
        bs = self.block_size
        usable = max(len(ids) - 1, 0) // bs
        parent, out = -1, []
        for b in range(usable):
            key = (parent, tuple(ids[b * bs : (b + 1) * bs]))
            node = self._nodes.get(key)
            if node is None:
                node = self._nodes[key] = len(self.rate)
                self.rate.append(0.0)
                self.count.append(0)
                self.parent.append(parent)
            out.append(node)
            parent = node
        return out

    def find(self, ids: Sequence[int]) -> list[int]:
        """Node ids of the full blocks of ``ids`` already in the tree (all of ``ids``, cut where one is missing)."""
        bs = self.block_size
        parent, out = -1, []
        for b in range(len(ids) // bs):
            node = self._nodes.get((parent, tuple(ids[b * bs : (b + 1) * bs])))
            if node is None:
                break
            out.append(node)
            parent = node
        return out

    def children(self) -> list[list[int]]:
        """Child node ids of every node, and at index ``len(self)`` the first blocks (the roots)."""
        out: list[list[int]] = [[] for _ in range(len(self.rate) + 1)]
        for node, parent in enumerate(self.parent):
            out[parent if parent >= 0 else len(self.rate)].append(node)
        return out


@dataclasses.dataclass(slots=True)
class ScopeTraffic:
    tenant: str
    adapter: str
    trie: BlockTrie
    prompts: dict[str, PromptStats] = dataclasses.field(default_factory=dict)
    by_digest: dict[str, PromptStats] = dataclasses.field(default_factory=dict)
    total_weight: float = 0.0
    attributed_weight: float = 0.0
    #: Local HDBSCAN label -> cluster id in the plan.
    cluster_ids: dict[int, int] = dataclasses.field(default_factory=dict)
    #: Cluster id -> the trie nodes of its chosen prefix (empty: no full block shared widely enough).
    chains: dict[int, list[int]] = dataclasses.field(default_factory=dict)

    def key(self) -> tuple[str, str]:
        return (self.tenant, self.adapter)

    def finish(self) -> None:
        # NOTE: prompts are ordered by text so every later step (sampling, labels, ids) is deterministic.
        self.prompts = dict(sorted(self.prompts.items()))
        self.attributed_weight = sum(p.decayed for p in self.prompts.values())

    def members(self) -> dict[int, list[PromptStats]]:
        out: dict[int, list[PromptStats]] = collections.defaultdict(list)
        for prompt in self.prompts.values():
            if prompt.label != NOISE:
                out[prompt.label].append(prompt)
        return out


def normalise_record(index: int, record: RequestRecord | Mapping[str, Any]) -> _Row:
    """Record ``index`` of a log as the analysis reads it; :class:`FileFormatError` naming it when it is not one."""
    if not isinstance(record, RequestRecord):
        if not isinstance(record, Mapping):
            raise FileFormatError(f"record {index}: expected an object, got {type(record).__name__}")
        try:
            record = RequestRecord.from_json(record)
        except RecordError as exc:
            raise FileFormatError(f"record {index}: {exc}") from None
    return _Row(index=index, ts=record.ts, tenant=record.tenant, adapter=record.adapter, prompt=record.prompt,
                digest=record.prompt_digest)


def _decayed_hours(span_s: float, half_life_s: float) -> float:
    """The decayed length of a span: ``integral of 0.5 ** (age / half_life)`` over it, in hours.

    Dividing a decayed count by it gives requests per hour (a steady rate comes out unchanged).
    """
    return half_life_s / math.log(2) * (1.0 - 0.5 ** (span_s / half_life_s)) / 3600.0


def _tokenise(scopes: Mapping[tuple[str, str], ScopeTraffic], tokenizer: Any, progress: bool) -> None:
    prompts = [(s, p) for s in scopes.values() for p in s.prompts.values()]
    cache: dict[str, list[int]] = {}
    for scope, prompt in _progress(prompts, progress, "tokenising", "prompt"):
        ids = cache.get(prompt.text)
        if ids is None:
            ids = cache[prompt.text] = list(tokenizer.encode(prompt.text, add_special_tokens=True))
        prompt.ids = ids
        prompt.chain = scope.trie.chain(ids)


def _embed_samples(scopes: Mapping[tuple[str, str], ScopeTraffic], embedder: Embedder, options: PlanOptions,
                   progress: bool) -> dict[bytes, np.ndarray]:
    ordered = sorted(scopes.values(), key=ScopeTraffic.key)
    quotas = _water_fill([min(len(s.prompts), options.max_points_per_group) for s in ordered], options.max_embeddings)
    wanted: dict[bytes, str] = {}
    for scope, quota in zip(ordered, quotas):
        prompts = list(scope.prompts.values())
        if quota >= len(prompts):
            chosen = prompts
        else:
            rng = np.random.default_rng(stable_seed(options.seed, scope.tenant, scope.adapter))
            weights = np.array([max(p.decayed, 1e-12) for p in prompts])
            keys = np.log(rng.random(len(prompts))) / weights  # Efraimidis-Spirakis: top keys = weighted sample
            chosen = [prompts[i] for i in np.argsort(-keys, kind="stable")[:quota]]
        for prompt in chosen:
            prompt.sampled = True
            wanted.setdefault(text_digest(prompt.text), prompt.text[: options.embed_chars])
    # NOTE: batches of similar length waste little on padding, which is most of the cost of long prompts.
    todo = sorted(wanted.items(), key=lambda kv: (len(kv[1]), kv[0]))
    vectors: dict[bytes, np.ndarray] = {}
    batches = [todo[i : i + options.embed_batch_size] for i in range(0, len(todo), options.embed_batch_size)]
    for batch in _progress(batches, progress, "embedding", "batch"):
        out = np.asarray(embedder.embed_batch([text for _, text in batch]), dtype=np.float32)
        if out.ndim != 2 or out.shape[0] != len(batch):
            raise ValueError(f"embedder returned shape {out.shape} for {len(batch)} texts")
        out = out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        for (key, _), vector in zip(batch, out):
            vectors[key] = vector
    return vectors


def _cluster_scope(scope: ScopeTraffic, vectors: Mapping[bytes, np.ndarray], options: PlanOptions) -> None:
    from sklearn.cluster import HDBSCAN

    sampled = [p for p in scope.prompts.values() if p.sampled]
    repeats = [min(p.count, options.min_cluster_size) for p in sampled]
    if sum(repeats) < options.min_cluster_size:
        return
    unit = np.stack([vectors[text_digest(p.text)] for p in sampled])
    points = _project(unit, min(options.pca_components, max(2, len(sampled) // options.points_per_component)))
    rows = np.repeat(np.arange(len(sampled)), repeats)
    labels = HDBSCAN(
        min_cluster_size=options.min_cluster_size,
        min_samples=options.min_samples,
        allow_single_cluster=True,
        copy=True,
    ).fit(points[rows]).labels_
    first = np.searchsorted(rows, np.arange(len(sampled)))
    for prompt, label in zip(sampled, labels[first]):
        prompt.label = int(label)
    if options.max_spread is None:
        return
    for label in sorted(set(int(x) for x in labels) - {NOISE}):
        idx = [i for i, p in enumerate(sampled) if p.label == label]
        w = np.array([sampled[i].count for i in idx], dtype=np.float64)
        members = unit[idx]
        centre = (members * w[:, None]).sum(0) / w.sum()
        spread = float((np.linalg.norm(members - centre, axis=1) * w).sum() / w.sum())
        if spread > options.max_spread:
            LOGGER.debug("scope %s/%s: cluster of %d prompts is too loose (spread %.2f); long tail",
                         scope.tenant, scope.adapter, len(idx), spread)
            for i in idx:
                sampled[i].label = NOISE


def _split_templates(scope: ScopeTraffic, vectors: Mapping[bytes, np.ndarray], embedder: Embedder,
                     options: PlanOptions) -> None:
    """Split a cluster held together by its shared opening into the templates that follow it.

    NOTE: the embedder reads only the first 256 tokens, and within one (tenant, adapter) most prompts
    open with the same system prompt, so whole-prompt embeddings put all of a scope's templates in one
    cluster. That cluster is right for the opening (every request shares it), so it stays; its members
    are embedded again without the opening most of them share (cut back to a paragraph break), and the
    groups HDBSCAN finds there become clusters of their own, with their longer shared prefixes. Members
    it leaves as noise stay in the parent cluster.
    """
    from sklearn.cluster import HDBSCAN

    sampled = [p for p in scope.prompts.values() if p.sampled]
    next_label = max([p.label for p in sampled] + [NOISE]) + 1
    for label in sorted({p.label for p in sampled} - {NOISE}):
        members = [p for p in sampled if p.label == label]
        if len(members) < 2 * options.min_cluster_size:
            continue
        lead = _majority_prefix([m.text for m in members], 0.5)
        lead = lead[: lead.rfind("\n\n") + 2] if "\n\n" in lead else ""
        rests = [m.text[len(lead):] if m.text.startswith(lead) else m.text for m in members]
        if not lead or not all(r.strip() for r in rests):
            continue
        # NOTE: what tells templates apart is how the text goes on right after the opening, so the
        # first ``split_chars`` characters of the rest are embedded (embedding cost grows with length).
        unit = _embed_sorted(embedder, [r[: options.split_chars] for r in rests], options.embed_batch_size)
        points = _project(unit, min(options.pca_components, max(2, len(members) // options.points_per_component)))
        repeats = [min(m.count, options.min_cluster_size) for m in members]
        rows = np.repeat(np.arange(len(members)), repeats)
        sub = HDBSCAN(min_cluster_size=options.min_cluster_size, min_samples=options.min_samples,
                      copy=True).fit(points[rows]).labels_[np.searchsorted(rows, np.arange(len(members)))]
        groups = sorted(set(int(x) for x in sub) - {NOISE})
        if len(groups) < 2:
            continue
        spreads = {g: _spread(unit, members, [i for i, x in enumerate(sub) if x == g]) for g in groups}
        grouped = [i for i, x in enumerate(sub) if x != NOISE]
        # Split only when the groups are real: each much tighter than all of them together.
        sizes = {g: sum(members[i].count for i, x in enumerate(sub) if x == g) for g in groups}
        within = sum(spreads[g] * sizes[g] for g in groups) / sum(sizes.values())
        if _spread(unit, members, grouped) < 1.3 * within:
            continue
        for group in groups:
            if options.max_spread is not None and spreads[group] > options.max_spread:
                continue  # a loose group of one-off user parts: they stay with the opening
            for i, x in enumerate(sub):
                if x == group:
                    members[i].label = next_label
            next_label += 1


def _embed_sorted(embedder: Embedder, texts: Sequence[str], batch_size: int) -> np.ndarray:
    """Unit embeddings of ``texts`` in their order, computed in batches of similar length (little padding)."""
    order = sorted(range(len(texts)), key=lambda i: (len(texts[i]), i))
    out = np.zeros((len(texts), 0), dtype=np.float32)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        vectors = np.asarray(embedder.embed_batch([texts[i] for i in idx]), dtype=np.float32)
        if out.shape[1] == 0:
            out = np.zeros((len(texts), vectors.shape[1]), dtype=np.float32)
        out[idx] = vectors
    return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)


def _spread(unit: np.ndarray, members: Sequence[PromptStats], idx: Sequence[int]) -> float:
    """Count-weighted mean distance of the members ``idx`` to their centroid."""
    w = np.array([members[i].count for i in idx], dtype=np.float64)
    centre = (unit[idx] * w[:, None]).sum(0) / w.sum()
    return float((np.linalg.norm(unit[idx] - centre, axis=1) * w).sum() / w.sum())


def _majority_prefix(texts: Sequence[str], share: float) -> str:
    """The longest leading text shared by at least ``share`` of ``texts`` (binary search on its length)."""
    if not texts:
        return ""
    need = max(1, math.ceil(share * len(texts)))

    def best(length: int) -> tuple[str, int]:
        counts: dict[str, int] = {}
        for text in texts:
            if len(text) >= length:
                counts[text[:length]] = counts.get(text[:length], 0) + 1
        return max(counts.items(), key=lambda kv: kv[1]) if counts else ("", 0)

    lo, hi = 0, max(len(t) for t in texts)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if best(mid)[1] >= need:
            lo = mid
        else:
            hi = mid - 1
    return best(lo)[0] if lo else ""


def _project(unit: np.ndarray, components: int) -> np.ndarray:
    n, d = unit.shape
    k = min(components, n - 1, d)
    if components <= 0 or k < 2:
        return unit.astype(np.float64)
    centred = unit.astype(np.float64) - unit.mean(axis=0)
    # NOTE: exact SVD (not randomised) so labels never depend on a random state; n is capped, so it is cheap.
    _, _, vt = np.linalg.svd(centred, full_matrices=False)
    return centred @ vt[:k].T


def _assign_rest(scope: ScopeTraffic, share: float) -> None:
    """Place the prompts HDBSCAN did not: by the cluster prefix they carry, else (unsampled) by block vote."""
    ends: dict[int, int] = {}  # last trie node of a cluster's chosen prefix -> the cluster
    weight: collections.Counter[int] = collections.Counter()
    for label, members in sorted(scope.members().items()):
        weight[label] = sum(m.count for m in members)
        path, _ = _choose_chain([m.chain for m in members], [m.count for m in members], share)
        # NOTE: clusters that chose the same prefix (one template split in two) give it to the heavier.
        if path and (path[-1] not in ends or weight[label] > weight[ends[path[-1]]]):
            ends[path[-1]] = label
    unplaced = [p for p in scope.prompts.values() if p.label == NOISE]
    for prompt in unplaced:
        carried = [ends[node] for node in prompt.chain if node in ends]
        if carried:
            prompt.label = carried[-1]  # the longest prefix it carries
    votes: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for prompt in scope.prompts.values():
        if prompt.sampled:
            for node in prompt.chain:
                votes[node][prompt.label] += prompt.count
    for prompt in unplaced:
        if prompt.sampled or prompt.label != NOISE:
            continue
        deepest = None
        for node in prompt.chain:
            if node not in votes:
                break
            deepest = node
        if deepest is not None:
            prompt.label = min(votes[deepest].items(), key=lambda kv: (-kv[1], kv[0]))[0]


def _choose_chain(chains: Sequence[Sequence[int]], weights: Sequence[float], share: float) -> tuple[list[int], float]:
    """Follow the heaviest next block while it is carried by >= ``share`` of the total weight.

    For ``share > 0.5`` the block carried by that much weight is unique at every depth, so this finds
    the longest such prefix exactly.
    """
    total = float(sum(weights))
    alive = [i for i, c in enumerate(chains) if c]
    path: list[int] = []
    carried = 0.0
    while alive and total > 0:
        depth = len(path)
        acc: dict[int, float] = collections.defaultdict(float)
        for i in alive:
            if len(chains[i]) > depth:
                acc[chains[i][depth]] += weights[i]
        if not acc:
            break
        node, weight = min(acc.items(), key=lambda kv: (-kv[1], kv[0]))
        if weight < share * total - 1e-9:
            break
        path.append(node)
        carried = weight / total
        alive = [i for i in alive if len(chains[i]) > depth and chains[i][depth] == node]
    return path, carried


def _cluster_info(scope: ScopeTraffic, members: list[PromptStats], vectors: Mapping[bytes, np.ndarray], scale: float,
                  eff_hours: float, options: PlanOptions, cluster_id: int) -> tuple[ClusterInfo, list[int]]:
    path, carried = _choose_chain([m.chain for m in members], [m.count for m in members], options.share)
    prefix = None
    if path:
        member = next(m for m in members if len(m.chain) >= len(path) and m.chain[len(path) - 1] == path[-1])
        prefix = PrefixChoice(tuple(member.ids[: len(path) * scope.trie.block_size]), carried)
    embedded = [(vectors[text_digest(m.text)], m.count) for m in members if m.sampled]
    centroid = np.zeros(0, dtype=np.float32)
    if embedded:
        total = sum((v * c for v, c in embedded), np.zeros_like(embedded[0][0], dtype=np.float64))
        centroid = total / max(float(np.linalg.norm(total)), 1e-12)
    representative = min(members, key=lambda m: (-m.count, -m.decayed, m.text)).text
    info = ClusterInfo(
        tenant=scope.tenant,
        adapter=scope.adapter,
        cluster=cluster_id,
        size=sum(m.count for m in members),
        unique_prompts=len(members),
        sampled=sum(1 for m in members if m.sampled),
        heat_per_hour=sum(m.decayed for m in members) * scale / eff_hours,
        centroid=centroid,
        representative=representative,
        prefix=prefix,
    )
    return info, path


def _forecast_factors(scopes: Mapping[tuple[str, str], ScopeTraffic], forecast: HeatForecast,
                      eff_hours: float) -> dict[tuple[str, str, int], float]:
    """Per (tenant, adapter, label): learnt rate / decayed-frequency rate, when the learnt model is used."""
    if forecast.learnt_rates is None:
        return {}
    decayed: dict[tuple[str, str, int], float] = collections.defaultdict(float)
    for scope in scopes.values():
        scale = scope.total_weight / scope.attributed_weight if scope.attributed_weight > 0 else 0.0
        for prompt in scope.prompts.values():
            decayed[(scope.tenant, scope.adapter, prompt.label)] += prompt.decayed * scale / eff_hours
    return {key: rate / decayed[key] for key, rate in forecast.learnt_rates.items() if decayed.get(key, 0) > 0}


def _progress(items: Sequence[Any], enabled: bool, desc: str, unit: str) -> Iterable[Any]:
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit=unit, leave=False)


def _water_fill(wants: Sequence[int], total: int) -> list[int]:
    """Share ``total`` between groups: each gets what it wants up to an equal level (small groups in full)."""
    if sum(wants) <= total:
        return list(wants)
    out = [0] * len(wants)
    remaining, left = total, len(wants)
    for i in sorted(range(len(wants)), key=lambda i: (wants[i], i)):
        out[i] = min(wants[i], remaining // left)
        remaining -= out[i]
        left -= 1
    return out
