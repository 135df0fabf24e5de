"""Choosing what to warm under the budgets, and the plan that says so.

Steps 6 and 7 of the pipeline described in :mod:`warmup_tools.planning.analyse`.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
from typing import Any, Iterable, Mapping, Sequence

from warmup_tools.common.digests import tokenizer_fingerprint as fingerprint_of
from warmup_tools.common.errors import ConfigError
from warmup_tools.common.records import RequestRecord
from warmup_tools.kv.config import DEFAULT_BLOCK_SIZE
from warmup_tools.planning.analyse import (
    DEFAULT_OPTIONS,
    Embedder,
    PlanOptions,
    ScopeTraffic,
    TrafficAnalysis,
    analyse_traffic,
)
from warmup_tools.planning.plan import Budgets, Plan


def build_plan(
    records: Iterable[RequestRecord | Mapping[str, Any]],
    tokenizer: Any,
    embedder: Embedder,
    budgets: Budgets,
    *,
    now: float | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_bytes_per_token: int,
    progress: bool = True,
    options: PlanOptions = DEFAULT_OPTIONS,
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
    fingerprint = tokenizer_fingerprint or fingerprint_of(tokenizer)
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


@dataclasses.dataclass(slots=True)
class _Pick:
    scope: ScopeTraffic
    chain: list[int]
    #: Clusters whose chosen prefix this is; and clusters whose prefix it covers (already warmed by it).
    proposers: list[int]
    covered: list[int]
    new_blocks: int
    saved_per_hour: float
    truncated: bool
    shared_with: int | None


def _select(analysis: TrafficAnalysis, budgets: Budgets, kv_bytes_per_token: int) -> list[_Pick]:
    """Greedy by marginal saved prefill tokens per KV byte, under every budget (module docstring, step 6)."""
    bs = analysis.block_size
    block_bytes = bs * kv_bytes_per_token
    candidates: dict[tuple[tuple[str, str], int], tuple[ScopeTraffic, list[int], list[int]]] = {}
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
        for position, (scope, chain, _) in enumerate(pending):
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


def _iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).isoformat(timespec="seconds")


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"

