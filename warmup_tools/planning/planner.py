"""Warm-up planner: decide from real request logs which KV prefixes, embeddings and tokenisations to warm.

Pipeline (:func:`build_plan`):

1. **Read and attribute.** Records are grouped by KV scope, ``(tenant, adapter)``, because KV computed
   for one tenant or adapter is never served to another (see :class:`~warmup_tools.kv.prefix_cache.CacheScope`).
   Identical prompts are deduplicated (weighted by count). Redacted records (no ``prompt``) still count
   for heat: one whose ``prompt_digest`` matches a prompt seen in clear in its scope is attributed to it,
   the rest scale their scope's heat up (missing at random), and none of them is ever planned.
2. **Embed** with the project's embedder, once per distinct text, in length-sorted batches. Embedding is
   the expensive step (~14 ms for a 200-token prompt on one CPU core), so at most
   ``max_points_per_group`` distinct prompts per scope and ``max_embeddings`` overall are embedded: a
   seeded sample weighted by decayed request count (Efraimidis-Spirakis), shared fairly between scopes.
3. **Cluster** each scope's sample with scikit-learn's HDBSCAN on L2-normalised embeddings projected on
   their leading principal axes (one per 16 sampled prompts, at least 2, at most 16). Why this method:

   * the number of templates is unknown and HDBSCAN needs no ``k``; its noise label is the long tail,
     which should not be warmed at all;
   * mean-pooled embeddings of prompts that share a system prompt and template but differ in the user part
     form tight blobs, yet in all 384 dimensions the user parts' variance drowns the gap between two
     templates that share a system prompt (measured: purity 0.74-0.84 without projection). The few
     leading principal axes of a scope are the between-template directions, and with them purity was 1.0
     on the same data. Axes estimated from few points are noise themselves (16 axes from 30-60 points:
     purity 0.76-0.89), hence the number of axes grows with the sample;
   * ``allow_single_cluster`` because a scope often serves a single template; ``min_samples=3`` (not
     ``min_cluster_size``) so sparse samples are not mostly noise, yet one template is rarely split in
     two; a prompt repeated ``n`` times enters as ``min(n, min_cluster_size)`` identical points, so a hot
     duplicate is a cluster even alone;
   * HDBSCAN also groups unrelated one-off prompts into a loose "cluster" when nothing else is near them.
     A cluster whose members sit on average further than ``max_spread`` (0.6; template clusters measure
     0.34-0.43, bags of unrelated prompts 0.72-0.79) from their centroid is returned to noise.

   Prompts HDBSCAN did not place (left out of the sample, or noise in it) are placed through token
   blocks, the similarity that matters to a prefix cache and a cheap one (tokenising is ~0.15 ms a
   prompt): one that carries a cluster's whole chosen prefix (step 5) joins it, since it would hit that
   cluster's warmed KV (this also rescues the members HDBSCAN calls noise in small, sparse samples); an
   unsampled one that carries none takes the majority label of the deepest block it shares with the
   sample (noise if it shares no full block).
4. **Heat** per cluster: decayed frequency, ``sum(0.5 ** ((now - ts) / half_life_s))`` over its requests,
   divided by the decayed length of the observed span, i.e. an estimate of requests per hour. The
   estimator is scored on held-out data (fit on the first 80% of the span, predict each cluster's count
   in the last 20%, weighted absolute percentage error). A learnt forecast (gradient boosted trees over
   recent counts, trend, time of day, tenant and adapter; :mod:`warmup_tools.planning.forecast`) is scored
   the same way and replaces the decayed frequency only when its error is lower; both errors are reported.
5. **Prefix per cluster**: follow the block chain carried by at least ``share`` (0.8) of the cluster's
   requests (count-weighted) as deep as it goes; only full blocks are cached, and a request reuses at
   most ``(len(prompt) - 1) // block_size`` blocks (the last token is always prefilled, see
   ``generation.py``), so a block counts only where it is usable. Fewer than one block: no candidate.
6. **Select** under :class:`Budgets` greedily by expected saved prefill per byte. The value model is
   exact for nested prefixes: the cached blocks of a scope form a prefix-closed set, a request saves
   ``block_size`` tokens for every cached block on its chain, so the saving of a set of prefixes is
   ``block_size * sum(rate of requests through each cached block)``. A candidate costs and gains only its
   blocks not yet chosen: identical prefixes from two clusters are one item, a prefix of a chosen item
   is free (its cluster is listed on the covering item), and an extension pays for its extra blocks.
   A candidate that does not fit is cut to the blocks that do (``truncated``).
7. **Emit** a versioned, content-hashed :class:`Plan` (JSON, sorted keys).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import gzip
import hashlib
import io
import json
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Protocol, Sequence

import numpy as np

from warmup_tools.common.errors import AssetError, ConfigError, WarmupToolsError
from warmup_tools.planning.forecast import HeatForecast, forecast_heat
from warmup_tools.tokenizer_cache.service import text_digest
from warmup_tools.tokenizer_cache.service import tokenizer_fingerprint as _tokenizer_fingerprint

LOGGER = logging.getLogger(__name__)

#: Version of the plan file layout; :meth:`Plan.load` refuses any other.
PLAN_FORMAT = 1

#: Cluster label of prompts that belong to no cluster (HDBSCAN's noise: the long tail).
NOISE = -1

_GZIP_MAGIC = b"\x1f\x8b"
_MIN_SPAN_S = 60.0


class PlanError(ConfigError):
    """A plan file is missing, unreadable, of another format, or was edited after it was built."""


class LogFormatError(WarmupToolsError, ValueError):
    """A request log line or record is malformed; the message names the file and line (or record)."""


class Embedder(Protocol):
    def embed_batch(self, texts: list[str]) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Budgets:
    """What one warm-up may use, per model instance (every instance warms the same plan)."""

    #: KV bytes of warmed prefixes per adapter ("" is the base model), over all tenants.
    kv_bytes_per_adapter: int
    #: KV bytes of warmed prefixes over all adapters.
    kv_bytes_total: int
    #: Prompt embeddings to pre-compute into the embedding cache.
    embedding_entries: int = 256
    #: Texts to register with the tokenizer cache.
    tokenizer_entries: int = 256
    #: Time the KV warm-up may take, estimated from the prefill tokens it computes.
    warm_seconds: float = 60.0
    #: Prefill throughput of one instance, used to turn prefill tokens into warm seconds.
    prefill_tokens_per_s: float = 3000.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"budget {field.name} must be a number, got {value!r}")
            if value < 0:
                raise ConfigError(f"budget {field.name} must be >= 0, got {value!r}")
        if self.prefill_tokens_per_s <= 0:
            raise ConfigError(f"budget prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Budgets:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown budget key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.default is dataclasses.MISSING and f.name not in data)
        if missing:
            raise ConfigError(f"budget key(s) {', '.join(missing)} are required")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
    #: Share of the observed span held out to score the heat estimate.
    holdout: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.half_life_s <= 0 or not 0.0 < self.share <= 1.0 or self.min_cluster_size < 2:
            raise ConfigError("half_life_s > 0, 0 < share <= 1 and min_cluster_size >= 2 are required")
        if min(self.max_points_per_group, self.max_embeddings, self.embed_batch_size, self.points_per_component) < 1:
            raise ConfigError("max_points_per_group, max_embeddings, embed_batch_size and points_per_component "
                              "must be >= 1")
        if not 0.0 < self.holdout < 1.0:
            raise ConfigError(f"holdout must be in (0, 1), got {self.holdout!r}")


@dataclasses.dataclass(slots=True)
class Plan:
    """A versioned warm-up plan. ``plan_id`` hashes what is warmed: items, block size and tokenizer."""

    plan_id: str
    created: str
    block_size: int
    tokenizer_fingerprint: str
    budgets: dict[str, Any]
    settings: dict[str, Any]
    summary: dict[str, Any]
    items: list[dict[str, Any]]
    embedding_items: list[dict[str, Any]]
    tokenizer_templates: list[dict[str, Any]]
    clusters: list[dict[str, Any]]
    format: int = PLAN_FORMAT

    @staticmethod
    def content_id(items: Sequence[Mapping[str, Any]], block_size: int, fingerprint: str) -> str:
        payload = {"block_size": block_size, "items": list(items), "tokenizer_fingerprint": fingerprint}
        return hashlib.sha256(_canonical(payload).encode("utf-8")).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return _canonical(self.to_dict())

    def save(self, path: Path) -> None:
        """Write the plan atomically (a reader never sees half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(self.to_json())
                out.write("\n")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: Path) -> Plan:
        """Read and validate a plan file; :class:`PlanError` says what is wrong and what to do."""
        path = Path(path)
        rebuild = "rebuild it from the request logs with warmup_tools.planning.planner.build_plan"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise PlanError(f"plan file {path} does not exist; {rebuild}") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PlanError(f"plan file {path} is not readable JSON ({exc}); {rebuild}") from None
        if not isinstance(data, dict):
            raise PlanError(f"plan file {path} does not hold a JSON object; {rebuild}")
        if data.get("format") != PLAN_FORMAT:
            raise PlanError(f"plan file {path} has format {data.get('format')!r}, this version of warmup_tools "
                            f"reads format {PLAN_FORMAT}; {rebuild}")
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in data]
        unknown = sorted(set(data) - set(names))
        if missing or unknown:
            raise PlanError(f"plan file {path} is malformed (missing: {', '.join(missing) or '-'}; "
                            f"unknown: {', '.join(unknown) or '-'}); {rebuild}")
        plan = cls(**data)
        block_size = plan.block_size
        if not isinstance(block_size, int) or block_size < 1:
            raise PlanError(f"plan file {path}: block_size must be a positive integer; {rebuild}")
        for index, item in enumerate(plan.items):
            ids = item.get("token_ids") if isinstance(item, dict) else None
            if (not isinstance(ids, list) or not ids or len(ids) % block_size
                    or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
                raise PlanError(f"plan file {path}: item {index} needs token_ids, a non-empty list of integers "
                                f"whose length is a multiple of block_size {block_size}; {rebuild}")
        expected = cls.content_id(plan.items, plan.block_size, plan.tokenizer_fingerprint)
        if expected != plan.plan_id:
            raise PlanError(f"plan file {path} names plan_id {plan.plan_id} but its content hashes to {expected}: "
                            f"it was edited after it was built; {rebuild}")
        return plan


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
    """What :func:`analyse_traffic` found; :func:`build_plan` turns it into a :class:`Plan`."""

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
    scopes: dict[tuple[str, str], _Scope]


# ------------------------------------------------------------------------------------------ public API
def iter_log_records(paths: str | Path | Iterable[str | Path]) -> Iterator[dict[str, Any]]:
    """Request records from JSON Lines files (gzip-compressed ones are detected by content).

    Blank lines are skipped; anything else that is not a JSON object raises :class:`LogFormatError`
    (a ``ValueError``) naming ``file:line``.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    for path in map(Path, paths):
        try:
            with path.open("rb") as probe:
                compressed = probe.read(2) == _GZIP_MAGIC
        except OSError as exc:
            raise LogFormatError(f"{path}: cannot read request log ({exc.strerror or exc})") from None
        raw = gzip.open(path, "rb") if compressed else path.open("rb")
        lineno = 0
        try:
            with io.TextIOWrapper(raw, encoding="utf-8") as lines:
                for lineno, line in enumerate(lines, start=1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise LogFormatError(
                            f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
                    if not isinstance(record, dict):
                        raise LogFormatError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
                    yield record
        except UnicodeDecodeError as exc:
            raise LogFormatError(f"{path}:{lineno + 1}: not UTF-8 text ({exc.reason})") from None
        except (EOFError, gzip.BadGzipFile, OSError) as exc:
            raise LogFormatError(f"{path}:{lineno + 1}: damaged or truncated file ({exc})") from None


def prefix_kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 4) -> int:
    """KV bytes one token takes: ``2 * layers * kv_heads * head_dim * dtype_bytes``, from config.json."""
    config_path = Path(model_dir) / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AssetError(f"{config_path} does not exist; point the planner at a Hugging Face model folder") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise AssetError(f"{config_path} is not readable JSON ({exc})") from None
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError) as exc:
        raise AssetError(f"{config_path} lacks a usable {exc} entry for the KV size") from None
    return 2 * layers * kv_heads * head_dim * int(dtype_bytes)


def shared_prefix(
    token_lists: Sequence[Sequence[int]],
    weights: Sequence[float] | None = None,
    *,
    block_size: int = 16,
    share: float = 0.8,
) -> PrefixChoice:
    """The longest block prefix carried by at least ``share`` of the (weighted) token lists.

    Only blocks a request can reuse count: at most ``(len(ids) - 1) // block_size`` of them. Returns an
    empty choice when not even one block is shared widely enough.
    """
    trie = _BlockTrie(block_size)
    weights = [1.0] * len(token_lists) if weights is None else list(weights)
    chains = [trie.chain(ids) for ids in token_lists]
    path, carried = _choose_chain(chains, weights, share)
    if not path:
        return PrefixChoice((), 0.0)
    member = next(i for i, c in enumerate(chains) if len(c) >= len(path) and c[len(path) - 1] == path[-1])
    return PrefixChoice(tuple(int(t) for t in token_lists[member][: len(path) * block_size]), carried)


def analyse_traffic(
    records: Iterable[Mapping[str, Any]],
    tokenizer: Any,
    embedder: Embedder,
    *,
    now: float | None = None,
    block_size: int = 16,
    options: PlanOptions = PlanOptions(),
    progress: bool = True,
) -> TrafficAnalysis:
    """Attribute, embed, cluster and heat the traffic in ``records`` (steps 1-5 of the module docstring)."""
    if block_size < 1:
        raise ConfigError(f"block_size must be >= 1, got {block_size}")
    rows = [_normalise(index, record) for index, record in enumerate(records)]
    if now is None:
        now = max((r.ts for r in rows), default=0.0)
    t_first = min((r.ts for r in rows), default=now)
    eff_hours = _decayed_hours(max(now - t_first, _MIN_SPAN_S), options.half_life_s)

    scopes: dict[tuple[str, str], _Scope] = {}
    for row in rows:
        scope = scopes.setdefault((row.tenant, row.adapter), _Scope(row.tenant, row.adapter, _BlockTrie(block_size)))
        row.weight = 0.5 ** (max(now - row.ts, 0.0) / options.half_life_s)
        scope.total_weight += row.weight
        if row.prompt is not None:
            prompt = scope.prompts.get(row.prompt)
            if prompt is None:
                prompt = scope.prompts[row.prompt] = _Prompt(row.prompt)
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
    for scope in _progress(sorted(scopes.values(), key=_Scope.key), progress, "clustering", "scope"):
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
    for scope in sorted(scopes.values(), key=_Scope.key):
        scale = scope.total_weight / scope.attributed_weight if scope.attributed_weight > 0 else 0.0
        for prompt in scope.prompts.values():
            factor = factors.get((scope.tenant, scope.adapter, prompt.label), 1.0)
            rate = prompt.decayed * scale / eff_hours * factor
            for node in prompt.chain:
                scope.trie.rate[node] += rate
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


def build_plan(
    records: Iterable[Mapping[str, Any]],
    tokenizer: Any,
    embedder: Embedder,
    budgets: Budgets,
    *,
    now: float | None = None,
    block_size: int = 16,
    kv_bytes_per_token: int,
    progress: bool = True,
    options: PlanOptions = PlanOptions(),
    tokenizer_fingerprint: str | None = None,
    created: datetime.datetime | None = None,
) -> Plan:
    """Analyse ``records`` and choose what to warm under ``budgets``; see the module docstring.

    ``tokenizer_fingerprint`` defaults to a hash of ``tokenizer.backend_tokenizer.to_str()`` (the same
    as :class:`~warmup_tools.tokenizer_cache.service.TokenizerService` uses); ``created`` to the current time.
    """
    if kv_bytes_per_token < 1:
        raise ConfigError(f"kv_bytes_per_token must be >= 1, got {kv_bytes_per_token}")
    analysis = analyse_traffic(records, tokenizer, embedder, now=now, block_size=block_size,
                               options=options, progress=progress)
    fingerprint = tokenizer_fingerprint or _tokenizer_fingerprint(tokenizer)
    chosen = _select(analysis, budgets, kv_bytes_per_token)
    items = [_item_json(pick, analysis, kv_bytes_per_token, tokenizer) for pick in chosen]
    by_id = {c.cluster: c for c in analysis.clusters}
    warmed_clusters = sorted({c for pick in chosen for c in pick.proposers + pick.covered},
                             key=lambda c: (-by_id[c].heat_per_hour, c))
    embedding_items = [
        {"text": by_id[c].representative, "cluster": c, "tenant": by_id[c].tenant, "adapter": by_id[c].adapter}
        for c in warmed_clusters
    ][: budgets.embedding_entries]
    tokenizer_templates = [
        {"text": item["text"], "tenant": item["tenant"], "adapter": item["adapter"], "tokens": item["tokens"]}
        for item in items
    ][: budgets.tokenizer_entries]
    new_tokens = sum(item["new_tokens"] for item in items)
    summary = {
        "records": analysis.records,
        "planned_records": analysis.planned_records,
        "redacted_records": analysis.redacted_records,
        "unique_prompts": analysis.unique_prompts,
        "embedded_prompts": analysis.embedded_prompts,
        "clusters": len(analysis.clusters),
        "noise_share": round(analysis.noise_share, 4),
        "heat_model": analysis.heat_model,
        "heat_error_metric": f"wape_last_{options.holdout:g}_of_span",
        "heat_error_baseline": None if analysis.heat_error_baseline is None else round(analysis.heat_error_baseline, 4),
        "heat_error_learnt": None if analysis.heat_error_learnt is None else round(analysis.heat_error_learnt, 4),
        "learnt_predictor": analysis.heat_model_reason,
        "as_of": _iso(analysis.now),
        "items": len(items),
        "kv_bytes": sum(item["kv_bytes"] for item in items),
        "expected_saved_tokens_per_hour": round(sum(item["expected_saved_tokens_per_hour"] for item in items), 1),
        "expected_warm_seconds": round(new_tokens / budgets.prefill_tokens_per_s, 3),
    }
    cluster_json = [
        {"tenant": c.tenant, "adapter": c.adapter, "cluster": c.cluster, "size": c.size,
         "unique_prompts": c.unique_prompts, "sampled": c.sampled, "heat_per_hour": round(c.heat_per_hour, 4),
         "prefix_tokens": c.prefix.tokens if c.prefix else 0,
         "centroid": [round(float(x), 5) for x in c.centroid]}
        for c in analysis.clusters
    ]
    settings = dataclasses.asdict(options) | {"kv_bytes_per_token": kv_bytes_per_token}
    return Plan(
        plan_id=Plan.content_id(items, block_size, fingerprint),
        created=(created or datetime.datetime.now(datetime.timezone.utc)).isoformat(timespec="seconds"),
        block_size=block_size,
        tokenizer_fingerprint=fingerprint,
        budgets=budgets.to_dict(),
        settings=settings,
        summary=summary,
        items=items,
        embedding_items=embedding_items,
        tokenizer_templates=tokenizer_templates,
        clusters=cluster_json,
    )


def format_summary(plan: Plan) -> str:
    """A short text report of ``plan``: totals, then one row per KV item."""
    s = plan.summary
    budgets = plan.budgets
    baseline = s.get("heat_error_baseline")
    learnt = s.get("heat_error_learnt")
    lines = [
        f"plan {plan.plan_id} (format {plan.format}, {plan.block_size}-token blocks, tokenizer "
        f"{plan.tokenizer_fingerprint}, heat as of {s.get('as_of')})",
        f"records {s['records']}: {s['planned_records']} with a prompt, {s['redacted_records']} redacted; "
        f"{s['unique_prompts']} distinct prompts, {s['embedded_prompts']} embedded; "
        f"{s['clusters']} clusters, {s['noise_share']:.1%} of planned records in the long tail",
        f"heat: {s['heat_model']} (half-life {plan.settings.get('half_life_s', 0) / 3600:g} h); held-out error "
        f"({s['heat_error_metric']}): baseline {'n/a' if baseline is None else f'{baseline:.3f}'}, "
        f"learnt {'n/a' if learnt is None else f'{learnt:.3f}'} ({s['learnt_predictor']})",
        f"warm: {s['items']} KV prefixes, {_size(s['kv_bytes'])} of {_size(budgets['kv_bytes_total'])} "
        f"(per adapter {_size(budgets['kv_bytes_per_adapter'])}), {s['expected_warm_seconds']:.1f} s of "
        f"{budgets['warm_seconds']:g} s; expected saving {s['expected_saved_tokens_per_hour']:,.0f} prefill tokens/h",
        f"caches: {len(plan.embedding_items)} embedding entries, {len(plan.tokenizer_templates)} tokenizer templates",
    ]
    if not plan.items:
        lines.append("no KV prefix is worth warming (no cluster shares a full block, or the budgets are zero)")
        return "\n".join(lines)
    header = ("#", "tenant", "adapter", "cluster", "tokens", "new", "KV", "req/h", "saved tok/h", "share")
    rows = [
        (str(i), item["tenant"], item["adapter"] or "(base)", str(item["cluster"]), str(item["tokens"]),
         str(item["new_tokens"]), _size(item["kv_bytes"]), f"{item['heat_per_hour']:.1f}",
         f"{item['expected_saved_tokens_per_hour']:,.0f}", f"{item['share']:.0%}" + ("*" if item["truncated"] else ""))
        for i, item in enumerate(plan.items)
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    numeric = {0, 3, 4, 5, 6, 7, 8, 9}
    for row in [header, *rows]:
        lines.append("  ".join(c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    if any(item["truncated"] for item in plan.items):
        lines.append("* cut to the blocks that fit the budget")
    return "\n".join(lines)


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
class _Prompt:
    """One distinct prompt text of one scope."""

    text: str
    count: int = 0
    decayed: float = 0.0
    rows: list[int] = dataclasses.field(default_factory=list)
    ids: list[int] = dataclasses.field(default_factory=list)
    chain: list[int] = dataclasses.field(default_factory=list)
    sampled: bool = False
    label: int = NOISE

    def add(self, row: _Row) -> None:
        self.count += 1
        self.decayed += row.weight
        self.rows.append(row.index)


class _BlockTrie:
    """Interns block chains: a node id names a whole prefix (like a chained block hash, but exact)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._nodes: dict[tuple[int, tuple[int, ...]], int] = {}
        self.rate: list[float] = []

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
            out.append(node)
            parent = node
        return out


@dataclasses.dataclass(slots=True)
class _Scope:
    tenant: str
    adapter: str
    trie: _BlockTrie
    prompts: dict[str, _Prompt] = dataclasses.field(default_factory=dict)
    by_digest: dict[str, _Prompt] = dataclasses.field(default_factory=dict)
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

    def members(self) -> dict[int, list[_Prompt]]:
        out: dict[int, list[_Prompt]] = collections.defaultdict(list)
        for prompt in self.prompts.values():
            if prompt.label != NOISE:
                out[prompt.label].append(prompt)
        return out


@dataclasses.dataclass(slots=True)
class _Pick:
    scope: _Scope
    chain: list[int]
    #: Clusters whose chosen prefix this is; and clusters whose prefix it covers (already warmed by it).
    proposers: list[int]
    covered: list[int]
    new_blocks: int
    saved_per_hour: float
    truncated: bool
    shared_with: int | None


def _normalise(index: int, record: Mapping[str, Any]) -> _Row:
    if not isinstance(record, Mapping):
        raise LogFormatError(f"record {index}: expected an object, got {type(record).__name__}")
    ts = record.get("ts")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise LogFormatError(f"record {index}: 'ts' must be epoch seconds, got {ts!r}")
    prompt = record.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise LogFormatError(f"record {index}: 'prompt' must be text, got {type(prompt).__name__}")
    digest = record.get("prompt_digest")
    return _Row(
        index=index,
        ts=float(ts),
        tenant=str(record.get("tenant") or "default"),
        adapter=str(record.get("adapter") or ""),
        prompt=prompt if prompt else None,
        digest=str(digest) if digest else None,
    )


def _decayed_hours(span_s: float, half_life_s: float) -> float:
    """The decayed length of a span: ``integral of 0.5 ** (age / half_life)`` over it, in hours.

    Dividing a decayed count by it gives requests per hour (a steady rate comes out unchanged).
    """
    return half_life_s / math.log(2) * (1.0 - 0.5 ** (span_s / half_life_s)) / 3600.0


def _tokenise(scopes: Mapping[tuple[str, str], _Scope], tokenizer: Any, progress: bool) -> None:
    prompts = [(s, p) for s in scopes.values() for p in s.prompts.values()]
    cache: dict[str, list[int]] = {}
    for scope, prompt in _progress(prompts, progress, "tokenising", "prompt"):
        ids = cache.get(prompt.text)
        if ids is None:
            ids = cache[prompt.text] = list(tokenizer.encode(prompt.text, add_special_tokens=True))
        prompt.ids = ids
        prompt.chain = scope.trie.chain(ids)


def _embed_samples(scopes: Mapping[tuple[str, str], _Scope], embedder: Embedder, options: PlanOptions,
                   progress: bool) -> dict[bytes, np.ndarray]:
    ordered = sorted(scopes.values(), key=_Scope.key)
    quotas = _water_fill([min(len(s.prompts), options.max_points_per_group) for s in ordered], options.max_embeddings)
    wanted: dict[bytes, str] = {}
    for scope, quota in zip(ordered, quotas):
        prompts = list(scope.prompts.values())
        if quota >= len(prompts):
            chosen = prompts
        else:
            rng = np.random.default_rng(_derived_seed(options.seed, scope.tenant, scope.adapter))
            weights = np.array([max(p.decayed, 1e-12) for p in prompts])
            keys = np.log(rng.random(len(prompts))) / weights  # Efraimidis-Spirakis: top keys = weighted sample
            chosen = [prompts[i] for i in np.argsort(-keys, kind="stable")[:quota]]
        for prompt in chosen:
            prompt.sampled = True
            wanted.setdefault(text_digest(prompt.text), prompt.text)
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


def _cluster_scope(scope: _Scope, vectors: Mapping[bytes, np.ndarray], options: PlanOptions) -> None:
    from sklearn.cluster import HDBSCAN  # noqa: PLC0415

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


def _split_templates(scope: _Scope, vectors: Mapping[bytes, np.ndarray], embedder: Embedder,
                     options: PlanOptions) -> None:
    """Split a cluster held together by its shared opening into the templates that follow it.

    NOTE: the embedder reads only the first 256 tokens, and within one (tenant, adapter) most prompts
    open with the same system prompt, so whole-prompt embeddings put all of a scope's templates in one
    cluster. That cluster is right for the opening (every request shares it), so it stays; its members
    are embedded again without the opening most of them share (cut back to a paragraph break), and the
    groups HDBSCAN finds there become clusters of their own, with their longer shared prefixes. Members
    it leaves as noise stay in the parent cluster.
    """
    from sklearn.cluster import HDBSCAN  # noqa: PLC0415

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
        unit = np.asarray(embedder.embed_batch(rests), dtype=np.float32)
        unit = unit / np.maximum(np.linalg.norm(unit, axis=1, keepdims=True), 1e-12)
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


def _spread(unit: np.ndarray, members: Sequence[_Prompt], idx: Sequence[int]) -> float:
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


def _assign_rest(scope: _Scope, share: float) -> None:
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


def _cluster_info(scope: _Scope, members: list[_Prompt], vectors: Mapping[bytes, np.ndarray], scale: float,
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


def _forecast_factors(scopes: Mapping[tuple[str, str], _Scope], forecast: HeatForecast,
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


def _select(analysis: TrafficAnalysis, budgets: Budgets, kv_bytes_per_token: int) -> list[_Pick]:
    """Greedy by marginal saved prefill tokens per KV byte, under every budget (module docstring, step 6)."""
    bs = analysis.block_size
    block_bytes = bs * kv_bytes_per_token
    candidates: dict[tuple[tuple[str, str], int], tuple[_Scope, list[int], list[int]]] = {}
    for info in analysis.clusters:
        scope = analysis.scopes[(info.tenant, info.adapter)]
        chain = scope.chains.get(info.cluster)
        if not chain:
            continue
        key = (scope.key(), chain[-1])  # a node names its whole chain
        if key in candidates:
            candidates[key][2].append(info.cluster)  # the same prefix from another cluster: one item
        else:
            candidates[key] = (scope, chain, [info.cluster])
    chosen: dict[tuple[str, str], dict[int, int]] = collections.defaultdict(dict)  # scope -> node -> pick
    used_adapter: dict[str, int] = collections.defaultdict(int)
    used_total = 0
    used_seconds = 0.0
    picks: list[_Pick] = []
    pending = sorted(candidates.values(), key=lambda c: (c[0].key(), c[1]))
    while pending:
        best = None
        for position, (scope, chain, clusters) in enumerate(pending):
            owned = chosen[scope.key()]
            start = next((i for i, node in enumerate(chain) if node not in owned), len(chain))
            new = chain[start:]
            gain = sum(scope.trie.rate[n] for n in new) * bs
            ratio = gain / (len(new) * block_bytes) if new else -1.0
            if best is None or ratio > best[0]:
                best = (ratio, position, start, gain)
        ratio, position, start, gain = best
        scope, chain, clusters = pending.pop(position)
        owned = chosen[scope.key()]
        if ratio < 0:  # every block already chosen: its requests are served by the covering item
            picks[owned[chain[-1]]].covered.extend(clusters)
            continue
        room_bytes = min(budgets.kv_bytes_per_adapter - used_adapter[scope.adapter],
                         budgets.kv_bytes_total - used_total)
        room_tokens = (budgets.warm_seconds - used_seconds) * budgets.prefill_tokens_per_s
        fits = min(len(chain) - start, int(room_bytes // block_bytes), int((room_tokens + 1e-6) // bs))
        if fits < 1:
            continue
        truncated = fits < len(chain) - start
        chain = chain[: start + fits]
        new = chain[start:]
        for node in new:
            owned[node] = len(picks)
        used_adapter[scope.adapter] += len(new) * block_bytes
        used_total += len(new) * block_bytes
        used_seconds += len(new) * bs / budgets.prefill_tokens_per_s
        picks.append(_Pick(scope, chain, list(clusters), [], len(new), sum(scope.trie.rate[n] for n in new) * bs,
                           truncated, owned[chain[start - 1]] if start else None))
    return picks


def _item_json(pick: _Pick, analysis: TrafficAnalysis, kv_bytes_per_token: int, tokenizer: Any) -> dict[str, Any]:
    scope, bs = pick.scope, analysis.block_size
    depth = len(pick.chain)
    by_id = {c.cluster: c for c in analysis.clusters}
    primary = max(pick.proposers, key=lambda c: (by_id[c].heat_per_hour, -c))
    members = [p for p in scope.prompts.values() if scope.cluster_ids.get(p.label) == primary]
    carriers = [p for p in members if len(p.chain) >= depth and p.chain[depth - 1] == pick.chain[-1]]
    share = sum(p.count for p in carriers) / max(sum(p.count for p in members), 1)
    example = min(carriers, key=lambda p: (-p.count, p.text))
    token_ids = [int(t) for t in example.ids[: depth * bs]]
    tokens = len(token_ids)
    heat = scope.trie.rate[pick.chain[-1]]
    kv_bytes = pick.new_blocks * bs * kv_bytes_per_token
    reason = (f"cluster {primary} of {by_id[primary].size} requests ({share:.0%} share this {tokens}-token prefix); "
              f"{heat:.1f} req/h carry it (decayed); saves {pick.saved_per_hour:,.0f} prefill tokens/h "
              f"for {_size(kv_bytes)}")
    if pick.shared_with is not None:
        reason += f"; its first {tokens - pick.new_blocks * bs} tokens are warmed by item {pick.shared_with}"
    others = sorted(set(pick.proposers + pick.covered) - {primary})
    if others:
        reason += f"; also serves cluster(s) {', '.join(map(str, others))}"
    if pick.truncated:
        reason += "; cut to the blocks that fit the budget"
    return {
        "kind": "kv_prefix",
        "tenant": scope.tenant,
        "adapter": scope.adapter,
        "cluster": primary,
        "clusters": sorted(set(pick.proposers + pick.covered)),
        "token_ids": token_ids,
        "text": _prefix_text(tokenizer, example.text, token_ids),
        "tokens": tokens,
        "new_tokens": pick.new_blocks * bs,
        "kv_bytes": kv_bytes,
        "heat_per_hour": round(heat, 4),
        "expected_saved_tokens_per_hour": round(pick.saved_per_hour, 2),
        "members": by_id[primary].size,
        "share": round(share, 4),
        "truncated": pick.truncated,
        "reason": reason,
    }


def _prefix_text(tokenizer: Any, text: str, token_ids: Sequence[int]) -> str:
    """The span of the original prompt that the prefix tokens cover (a decode where offsets are missing)."""
    try:
        encoding = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
        offsets = encoding["offset_mapping"]
        if list(encoding["input_ids"][: len(token_ids)]) == list(token_ids):
            return text[: max(end for _, end in offsets[: len(token_ids)])]
    except (TypeError, KeyError, ValueError, NotImplementedError):
        pass
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)


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


def _derived_seed(seed: int, *labels: str) -> int:
    digest = hashlib.sha256(json.dumps([seed, *labels]).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little")


def _progress(items: Sequence[Any], enabled: bool, desc: str, unit: str) -> Iterable[Any]:
    if not enabled:
        return items
    from tqdm import tqdm  # noqa: PLC0415

    return tqdm(items, desc=desc, unit=unit, leave=False)


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).isoformat(timespec="seconds")


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"
