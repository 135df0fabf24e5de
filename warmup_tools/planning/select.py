"""Choosing what to warm under the budgets, and the plan that says so.

Steps 6 to 8 of the pipeline described in :mod:`warmup_tools.planning.analyse`.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import heapq
import logging
from typing import Any, Iterable, Mapping, Sequence

from warmup_tools.common.digests import tokenizer_fingerprint
from warmup_tools.common.errors import ConfigError
from warmup_tools.common.plan import Budgets, Plan
from warmup_tools.common.records import RequestRecord
from warmup_tools.kv.config import DEFAULT_BLOCK_SIZE, KVCacheConfig
from warmup_tools.planning.analyse import (
    DEFAULT_OPTIONS,
    NOISE,
    Embedder,
    PlanOptions,
    PromptStats,
    ScopeTraffic,
    TrafficAnalysis,
    analyse_traffic,
    normalise_record,
)
from warmup_tools.planning.arbitrate import AdapterNeed, arbitrate, shares_json
from warmup_tools.planning.horizons import Horizon, Horizons
from warmup_tools.planning.replay import (
    ReplayRequest,
    WarmItem,
    choose_share,
    make_replay_cache,
    replay_fleet,
    route,
)

LOGGER = logging.getLogger(__name__)


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
    fingerprint: str | None = None,
    created: datetime.datetime | None = None,
    previous: Plan | None = None,
    kv: KVCacheConfig | None = None,
) -> Plan:
    """Analyse ``records`` and choose what to warm under ``budgets``; see the module docstring.

    ``fingerprint`` (of the tokenizer) defaults to a hash of ``tokenizer.backend_tokenizer.to_str()``
    (the same as :class:`~warmup_tools.tokenizer_cache.service.TokenizerService` uses); ``created`` to the
    current time. With ``previous`` (a rolling plan), blocks it warmed are kept unless clearly beaten
    (``options.hysteresis``) and the summary says which items were added, kept and dropped.

    With ``kv`` (the target's KV cache settings, :class:`~warmup_tools.planning.target.PlanTarget`), the warm
    set is sized by replay (:func:`_replay_sizing`): the plan is cut to the share of ``kv.budget_bytes`` that
    served the most prompt tokens on the log's tail, and has no KV item when no share gains over none.
    Without it, or with too little log to split, the budgets alone size it; ``summary.replay`` says which.
    """
    if kv_bytes_per_token < 1:
        raise ConfigError(f"kv_bytes_per_token must be >= 1, got {kv_bytes_per_token}")
    records = list(records)
    fingerprint = fingerprint or tokenizer_fingerprint(tokenizer)
    if previous is not None and (previous.block_size != block_size or previous.tokenizer_fingerprint != fingerprint):
        LOGGER.warning("previous plan %s was made for another block size or tokenizer; planning without it",
                       previous.plan_id)
        previous = None
    sizing: dict[str, Any] = {"state": "off", "reason": "no KV cache settings were given: sized by the budgets"}
    if kv is not None:
        embedder = _MemoEmbedder(embedder)  # the head's analysis embeds most of the whole log's texts again
        sizing, budgets_used = _replay_sizing(records, tokenizer, embedder, budgets, kv, now=now,
                                              block_size=block_size, kv_bytes_per_token=kv_bytes_per_token,
                                              options=options, previous=previous, progress=progress)
    else:
        budgets_used = budgets
    analysis = analyse_traffic(records, tokenizer, embedder, now=now, block_size=block_size,
                               options=options, progress=progress)
    chosen, arbitration = _select(analysis, budgets_used, kv_bytes_per_token, previous)
    horizons = Horizons(options)
    leaves = [(pick.scope, pick.chain[-1], len(pick.chain)) for pick in chosen]
    horizons.prepare(leaves)
    retention = [horizons.of(*leaf) for leaf in leaves]
    items = [_item_json(pick, analysis, kv_bytes_per_token, tokenizer, horizon)
             for pick, horizon in zip(chosen, retention)]
    by_id = {c.cluster: c for c in analysis.clusters}
    warmed_clusters = sorted({c for item in items for c in item["clusters"]},
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
        "changes": _changes(items, previous),
        "arbitration": arbitration,
        "horizons": horizons.summary(retention),
        "replay": sizing,
    }
    cluster_json = [
        {"tenant": c.tenant, "adapter": c.adapter, "cluster": c.cluster, "size": c.size,
         "unique_prompts": c.unique_prompts, "sampled": c.sampled, "heat_per_hour": round(c.heat_per_hour, 4),
         "prefix_tokens": c.prefix.tokens if c.prefix else 0,
         "centroid": [round(float(x), 5) for x in c.centroid]}
        for c in analysis.clusters
    ]
    # NOTE: tuples as lists, as the plan file reads them back.
    settings = {key: list(value) if isinstance(value, tuple) else value
                for key, value in dataclasses.asdict(options).items()} | {"kv_bytes_per_token": kv_bytes_per_token}
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


def _replay_sizing(records: Sequence[RequestRecord | Mapping[str, Any]], tokenizer: Any, embedder: Embedder,
                   budgets: Budgets, kv: KVCacheConfig, *, now: float | None, block_size: int, kv_bytes_per_token: int,
                   options: PlanOptions, previous: Plan | None, progress: bool) -> tuple[dict[str, Any], Budgets]:
    """Size the warm set by replay (:mod:`warmup_tools.planning.replay`); the plan's ``summary.replay`` and the
    budgets the final plan is chosen under (the chosen share's bytes; ``budgets`` when there is no replay).

    The first ``1 - options.replay_tail`` of the log's span plans (heat as of the split), the rest is replayed
    with that plan cut to each warm share (a share ``w`` keeps what the selection takes under ``w *
    kv.budget_bytes``), each item pinned for its reuse horizon learnt from the head.
    """
    rows = [normalise_record(index, record) for index, record in enumerate(records)]
    if kv.budget_bytes <= 0 or block_size != kv.block_size:
        why = ("the target has no KV cache (kv_cache_bytes 0)" if kv.budget_bytes <= 0 else
               f"the plan's block size {block_size} is not the target's {kv.block_size}")
        return {"state": "skipped", "reason": f"{why}: sized by the budgets"}, budgets
    first = min((r.ts for r in rows), default=0.0)
    last = max((r.ts for r in rows), default=0.0)
    split = first + (1.0 - options.replay_tail) * (last - first)
    head = [records[r.index] for r in rows if r.ts < split]
    tail = sorted((r for r in rows if r.ts >= split and r.prompt is not None), key=lambda r: (r.ts, r.index))
    base = {"split_at": _iso(split) if rows else None, "head_records": len(head), "tail_records": len(tail)}
    if len(tail) < options.replay_min_records or not head:
        return base | {"state": "skipped", "reason": f"too little log to split: {len(tail)} tail requests with a "
                       f"prompt (at least {options.replay_min_records} are needed) and {len(head)} head requests; "
                       "sized by the budgets"}, budgets
    analysis = analyse_traffic(head, tokenizer, embedder, now=split, block_size=block_size, options=options,
                               progress=progress)
    encoded: dict[str, list[int]] = {p.text: p.ids for s in analysis.scopes.values() for p in s.prompts.values()}
    requests = []
    for row in tail:
        ids = encoded.get(row.prompt)
        if ids is None:
            ids = encoded[row.prompt] = list(tokenizer.encode(row.prompt, add_special_tokens=True))
        requests.append(ReplayRequest(row.ts, row.tenant, row.adapter, ids))
    fleet = route(requests, options.replay_replicas, block_size)
    base |= {"replicas": options.replay_replicas, "requests_per_replica": [len(share) for share in fleet]}
    cap = min(make_replay_cache(kv, kv_bytes_per_token, lambda: split).warmup_budget, budgets.kv_bytes_total)
    top = cap / kv.budget_bytes
    shares = sorted({0.0, top, *(min(s, top) for s in options.replay_shares)})
    horizons = Horizons(options)
    carriers = _carriers(analysis)
    candidates = {}
    for share in reversed(shares):
        picks, _ = _select(analysis, _cut(budgets, share, kv), kv_bytes_per_token, previous)
        leaves = [(pick.scope, pick.chain[-1], len(pick.chain)) for pick in picks]
        if share == top:
            horizons.prepare(leaves)
        candidates[share] = [
            WarmItem(pick.scope.tenant, pick.scope.adapter,
                     carriers[(pick.scope.key(), pick.chain[-1])].ids[: len(pick.chain) * block_size],
                     horizons.of(*leaf).retention_s)
            for pick, leaf in zip(picks, leaves)]
    served: dict[float, int] = {}
    tried = []
    for share in shares:
        outcome = replay_fleet(kv, kv_bytes_per_token, candidates[share], fleet, start=split)
        served[share] = outcome.served_tokens
        tried.append({"share": round(share, 4), "items": len(candidates[share]),
                      "kv_bytes": outcome.warmed_blocks * block_size * kv_bytes_per_token,
                      "served_tokens": outcome.served_tokens,
                      "served_share": round(outcome.served_tokens / max(outcome.prompt_tokens, 1), 4)})
    chosen = choose_share(served)
    total = sum(len(r.ids) for r in requests)
    gain = served[chosen] - served[0.0]
    summary = base | {
        "state": "sized",
        "tail_prompt_tokens": total,
        "shares": tried,
        "max_share": round(top, 4),
        "chosen_share": round(chosen, 4),
        "chosen_kv_bytes": _cut(budgets, chosen, kv).kv_bytes_total,
        "expected_gain_tokens": gain,
        "expected_gain_share": round(100.0 * gain / max(total, 1), 2),
    }
    if gain <= 0:
        summary["reason"] = ("no warm share served more prompt tokens on the tail than none: the plan warms no KV "
                             "prefix (only what readiness needs)")
    else:
        summary["reason"] = (f"a warm share of {chosen:.0%} of kv_cache_bytes served the most prompt tokens on the "
                             "tail" + (" (ties go to the smaller share)" if list(served.values()).count(served[chosen])
                                       > 1 else ""))
    return summary, _cut(budgets, chosen, kv)


def _cut(budgets: Budgets, share: float, kv: KVCacheConfig) -> Budgets:
    """``budgets`` with the KV bytes cut to ``share`` of the target's ``kv_cache_bytes``."""
    total = min(int(share * kv.budget_bytes), budgets.kv_bytes_total)
    return dataclasses.replace(budgets, kv_bytes_total=total,
                               kv_bytes_per_adapter=min(budgets.kv_bytes_per_adapter, total))


def _carriers(analysis: TrafficAnalysis) -> dict[tuple[tuple[str, str], int], PromptStats]:
    """A prompt that carries each trie node, per scope (any one: a node names its whole token prefix)."""
    out: dict[tuple[tuple[str, str], int], PromptStats] = {}
    for scope in analysis.scopes.values():
        key = scope.key()
        for prompt in scope.prompts.values():
            for node in prompt.chain:
                out.setdefault((key, node), prompt)
    return out


class _MemoEmbedder:
    """An embedder that embeds each distinct text once (the replay's head analysis and the whole log's
    share most texts)."""

    def __init__(self, inner: Embedder) -> None:
        self.inner = inner
        self._vectors: dict[str, Any] = {}

    def embed_batch(self, texts: list[str]) -> Any:
        import numpy as np

        missing = [t for t in dict.fromkeys(texts) if t not in self._vectors]
        if missing:
            for text, vector in zip(missing, np.asarray(self.inner.embed_batch(missing))):
                self._vectors[text] = vector
        return np.stack([self._vectors[t] for t in texts]) if texts else np.zeros((0, 0), dtype=np.float32)


def _changes(items: Sequence[Mapping[str, Any]], previous: Plan | None) -> dict[str, Any]:
    """What a rolling plan added, kept and dropped against ``previous`` (an item is its scope and tokens)."""
    def key(item: Mapping[str, Any]) -> tuple[str, str, tuple[int, ...]]:
        return (item["tenant"], item["adapter"], tuple(item["token_ids"]))

    def brief(item: Mapping[str, Any]) -> dict[str, Any]:
        return {"tenant": item["tenant"], "adapter": item["adapter"], "tokens": len(item["token_ids"]),
                "text": str(item.get("text", ""))[:80]}

    if previous is None:
        return {"previous_plan": None, "added": len(items), "kept": 0, "dropped": 0, "dropped_items": []}
    before = {key(item) for item in previous.items}
    after = {key(item) for item in items}
    dropped = [brief(item) for item in previous.items if key(item) not in after]
    return {"previous_plan": previous.plan_id, "added": len(after - before), "kept": len(after & before),
            "dropped": len(dropped), "dropped_items": dropped}


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
    arbitration = s.get("arbitration") or {}
    if arbitration.get("adapters"):
        lines.append(f"budget split ({arbitration['mode']}): hot sets {_size(arbitration['hot_sets_bytes'])} against "
                     f"{_size(arbitration['budget_bytes'])}" + (", all fit" if arbitration["fits"] else ""))
        lines += [f"  {name}: {a['share']:.0%} ({_size(a['cap_bytes'])}, {_size(a['used_bytes'])} used): {a['reason']}"
                  for name, a in arbitration["adapters"].items()]
    lines += _replay_lines(s.get("replay") or {})
    horizons = s.get("horizons") or {}
    if plan.items and horizons.get("classes"):
        lines.append("pins expire after each item's reuse horizon (p{:g} of its reuse gaps, {:g}-{:g} s): ".format(
            horizons["quantile"] * 100, horizons["min_s"], horizons["max_s"]) + "; ".join(
            f"{name} prefixes {c['items']} items, class horizon "
            + ("n/a" if c["horizon_s"] is None else f"{c['horizon_s']:g} s") + f" ({c['gaps']} gaps)"
            for name, c in horizons["classes"].items()))
    changes = s.get("changes") or {}
    if changes.get("previous_plan"):
        lines.append(f"against plan {changes['previous_plan']}: {changes['added']} items added, {changes['kept']} "
                     f"kept, {changes['dropped']} dropped")
    if not plan.items:
        replayed = s.get("replay") or {}
        lines.append("no KV prefix is warmed: " + (replayed["reason"] if replayed.get("state") == "sized"
                     and replayed.get("expected_gain_tokens", 0) <= 0 else
                     "no cluster shares a full block, or the budgets are zero"))
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


def _replay_lines(replayed: Mapping[str, Any]) -> list[str]:
    """The replay sizing's lines of :func:`format_summary`: each share's tokens served, the choice, the gain."""
    if replayed.get("state") != "sized":
        return [f"replay sizing {replayed.get('state', 'off')}: {replayed.get('reason', 'not recorded')}"]
    tried = ", ".join(f"{t['share']:.0%} {t['served_share']:.1%}" for t in replayed["shares"])
    per_replica = replayed.get("requests_per_replica") or []
    fleet = (f" (split across {replayed['replicas']} replicas as a prefix-affine router would: "
             f"{min(per_replica)}-{max(per_replica)} each)" if len(per_replica) > 1 else "")
    return [f"replay sizing: {replayed['tail_records']} tail requests{fleet} from {replayed['split_at']} "
            f"({replayed['tail_prompt_tokens']:,} prompt tokens) served from cache, by warm share of kv_cache_bytes: "
            f"{tried}",
            f"  chosen share {replayed['chosen_share']:.0%} (the plan's KV budget cut to "
            f"{_size(replayed['chosen_kv_bytes'])}): expected gain {replayed['expected_gain_tokens']:+,} "
            f"prompt tokens ({replayed['expected_gain_share']:+.2f} points) over no plan; {replayed['reason']}"]


@dataclasses.dataclass(slots=True)
class _Pick:
    """One item: the chain from a first block to a chosen leaf of one scope's prefix tree."""

    scope: ScopeTraffic
    chain: list[int]
    new_blocks: int
    saved_per_hour: float
    #: A child of the leaf was worth warming but did not fit the budgets.
    truncated: bool
    #: Index of the earlier item that warms this one's first blocks.
    shared_with: int | None


def _select(analysis: TrafficAnalysis, budgets: Budgets, kv_bytes_per_token: int,
            previous: Plan | None = None) -> tuple[list[_Pick], dict[str, Any]]:
    """The hottest frontier block first, under every budget (module docstring of ``analyse``, step 6),
    each adapter within the cap :mod:`~warmup_tools.planning.arbitrate` gives it; the picks and the
    plan's ``arbitration`` entry.

    Every block costs the same bytes and seconds and a child is never hotter than its parent, so this
    greedy choice is the best prefix-closed set of blocks for the budgets. Blocks of ``previous`` rank
    ``1 + hysteresis`` times hotter (they are kept unless clearly beaten).
    """
    options = analysis.options
    bs = analysis.block_size
    block_bytes = bs * kv_bytes_per_token
    scopes = sorted(analysis.scopes.values(), key=ScopeTraffic.key)
    incumbent: dict[tuple[str, str], set[int]] = collections.defaultdict(set)
    for item in previous.items if previous is not None else ():
        scope = analysis.scopes.get((item["tenant"], item["adapter"]))
        if scope is not None:
            incumbent[scope.key()].update(scope.trie.find(item["token_ids"]))
    children = {scope.key(): scope.trie.children() for scope in scopes}

    def push(heap: list, order: int, scope: ScopeTraffic, node: int) -> None:
        trie = scope.trie
        if trie.count[node] >= options.min_block_requests and trie.rate[node] > 0:
            bonus = 1.0 + options.hysteresis if node in incumbent[scope.key()] else 1.0
            heapq.heappush(heap, (-trie.rate[node] * bonus, order, node))

    heap: list[tuple[float, int, int]] = []
    for order, scope in enumerate(scopes):
        for node in children[scope.key()][len(scope.trie)]:
            push(heap, order, scope, node)
    chosen: dict[tuple[str, str], set[int]] = collections.defaultdict(set)
    short: set[tuple[tuple[str, str], int]] = set()  # (scope, parent) whose child did not fit
    used_adapter: dict[str, int] = collections.defaultdict(int)
    used_total, used_tokens = 0, 0
    max_tokens = int(budgets.warm_seconds * budgets.prefill_tokens_per_s + 1e-6)
    needs = _needs(scopes, options.min_block_requests)
    total_blocks = min(budgets.kv_bytes_total // block_bytes, max_tokens // bs)
    shares = arbitrate(needs, total_blocks, budgets.kv_bytes_per_adapter // block_bytes, options.arbitration)
    cap = {adapter: share.cap_blocks * block_bytes for adapter, share in shares.items()}
    while heap:
        _, order, node = heapq.heappop(heap)
        scope = scopes[order]
        if (used_adapter[scope.adapter] + block_bytes > cap[scope.adapter]
                or used_total + block_bytes > budgets.kv_bytes_total or used_tokens + bs > max_tokens):
            short.add((scope.key(), scope.trie.parent[node]))
            continue
        chosen[scope.key()].add(node)
        used_adapter[scope.adapter] += block_bytes
        used_total += block_bytes
        used_tokens += bs
        for child in children[scope.key()][node]:
            push(heap, order, scope, child)
    if options.warm_one_off_prompts:
        remaining = min((budgets.kv_bytes_total - used_total) // block_bytes, (max_tokens - used_tokens) // bs)
        per_adapter = {a: (budgets.kv_bytes_per_adapter - used) // block_bytes for a, used in used_adapter.items()}
        default = budgets.kv_bytes_per_adapter // block_bytes
        for order, _root, blocks in _one_off_prompts(scopes, children, options.min_block_requests):
            scope = scopes[order]
            if len(blocks) > remaining or len(blocks) > per_adapter.get(scope.adapter, default):
                continue
            chosen[scope.key()].update(blocks)
            remaining -= len(blocks)
            per_adapter[scope.adapter] = per_adapter.get(scope.adapter, default) - len(blocks)

    picks: list[_Pick] = []
    leaves: list[tuple[float, tuple[str, str], list[int]]] = []
    for scope in scopes:
        nodes = chosen[scope.key()]
        kids = children[scope.key()]
        for node in sorted(nodes):
            if any(child in nodes for child in kids[node]):
                continue
            chain = [node]
            while scope.trie.parent[chain[-1]] >= 0:
                chain.append(scope.trie.parent[chain[-1]])
            chain.reverse()
            leaves.append((sum(scope.trie.rate[n] for n in chain), scope.key(), chain))
    # NOTE: the hottest chains first (warm-up runs the items in order), ties by scope and node: deterministic.
    leaves.sort(key=lambda leaf: (-leaf[0], leaf[1], leaf[2]))
    owner: dict[tuple[tuple[str, str], int], int] = {}
    for _, key, chain in leaves:
        scope = analysis.scopes[key]
        start = next((i for i, n in enumerate(chain) if (key, n) not in owner), len(chain))
        new = chain[start:]
        shared_with = owner[(key, chain[start - 1])] if start else None
        for n in new:
            owner[(key, n)] = len(picks)
        picks.append(_Pick(scope, chain, len(new), sum(scope.trie.rate[n] for n in new) * bs,
                           (key, chain[-1]) in short, shared_with))
    used_blocks: dict[str, int] = collections.Counter()
    for key, nodes in chosen.items():
        used_blocks[key[1]] += len(nodes)
    return picks, shares_json(shares, needs, used_blocks, block_bytes, total_blocks, options.arbitration)


def _needs(scopes: Sequence[ScopeTraffic], min_requests: int) -> list[AdapterNeed]:
    """Per adapter, from its scopes' prefix trees: its request rate, the rate through first blocks that
    ``min_requests`` requests carry, those first blocks and its whole hot set (:mod:`.arbitrate`)."""
    rate: dict[str, float] = collections.defaultdict(float)
    cold: dict[str, float] = collections.defaultdict(float)
    first: dict[str, int] = collections.Counter()
    hot: dict[str, int] = collections.Counter()
    for scope in scopes:
        trie, a = scope.trie, scope.adapter
        rate[a] += 0.0
        for node in range(len(trie)):
            root = trie.parent[node] < 0
            rate[a] += trie.rate[node] if root else 0.0
            if trie.count[node] >= min_requests and trie.rate[node] > 0:
                hot[a] += 1
                if root:
                    first[a] += 1
                    cold[a] += trie.rate[node]
    return [AdapterNeed(a, rate[a], cold[a], first[a], hot[a]) for a in sorted(rate)]


def _one_off_prompts(scopes: Sequence[ScopeTraffic], children: Mapping[tuple[str, str], list[list[int]]],
                     min_requests: int) -> list[tuple[int, int, list[int]]]:
    """``(scope index, first block, every block under it)`` for each first block fewer than ``min_requests``
    logged requests carry: prompts that share no block with another prompt of their scope, so a repeat
    of one is a cold request unless the plan warms it. The most likely to recur per block first: the
    decayed rate through the first block over the blocks it takes (ties: scope, then node).

    NOTE: the main selection leaves such blocks out because one request's decayed rate overstates its
    chance to recur against blocks many requests share; here they only take budget that would stay
    unused, and only whole prompts (a repeat reuses every block of it, a first block alone saves 16
    tokens of a cold request but would only make it look warm).
    """
    out = []
    for order, scope in enumerate(scopes):
        trie, kids = scope.trie, children[scope.key()]
        for root in kids[len(trie)]:
            if trie.count[root] >= min_requests or trie.rate[root] <= 0:
                continue
            blocks, stack = [], [root]
            while stack:
                blocks.append(stack.pop())
                stack.extend(kids[blocks[-1]])
            out.append((-trie.rate[root] / len(blocks), order, root, sorted(blocks)))
    out.sort()
    return [(order, root, blocks) for _, order, root, blocks in out]


def _item_json(pick: _Pick, analysis: TrafficAnalysis, kv_bytes_per_token: int, tokenizer: Any,
               horizon: Horizon) -> dict[str, Any]:
    scope, bs = pick.scope, analysis.block_size
    depth = len(pick.chain)
    leaf = pick.chain[-1]
    carriers = [p for p in scope.prompts.values() if len(p.chain) >= depth and p.chain[depth - 1] == leaf]
    by_cluster: collections.Counter[int] = collections.Counter()
    for p in carriers:
        by_cluster[scope.cluster_ids.get(p.label, NOISE)] += p.count
    # The clusters this item serves: those with requests through its first new block.
    first = depth - pick.new_blocks
    served = {scope.cluster_ids.get(p.label, NOISE) for p in scope.prompts.values()
              if len(p.chain) > first and p.chain[first] == pick.chain[first]}
    primary = min(by_cluster.items(), key=lambda kv: (kv[0] == NOISE, -kv[1], kv[0]))[0]
    by_id = {c.cluster: c for c in analysis.clusters}
    members = by_id[primary].size if primary != NOISE else sum(p.count for p in carriers)
    share = by_cluster[primary] / max(members, 1)
    example = min(carriers, key=lambda p: (-p.count, p.text))
    token_ids = [int(t) for t in example.ids[: depth * bs]]
    tokens = len(token_ids)
    heat = scope.trie.rate[leaf]
    kv_bytes = pick.new_blocks * bs * kv_bytes_per_token
    carried = sum(by_cluster.values())
    if primary == NOISE:
        reason = f"{carried} requests of no cluster carry this {tokens}-token prefix"
    else:
        reason = (f"cluster {primary} of {members} requests ({share:.0%} carry this {tokens}-token prefix; "
                  f"{carried} requests in all)")
    reason += (f"; {heat:.1f} req/h carry it (decayed); saves {pick.saved_per_hour:,.0f} prefill tokens/h "
               f"for {_size(kv_bytes)}")
    if pick.shared_with is not None:
        reason += f"; its first {tokens - pick.new_blocks * bs} tokens are warmed by item {pick.shared_with}"
    others = sorted(c for c in served if c not in (primary, NOISE))
    if others:
        reason += f"; also serves cluster(s) {', '.join(map(str, others))}"
    if pick.truncated:
        reason += "; cut to the blocks that fit the budget"
    reason += (f"; pinned {horizon.retention_s:.0f} s ({horizon.klass} prefix, "
               + {"item": f"p{analysis.options.retention_quantile * 100:g} of its {horizon.gaps} reuse gaps",
                  "class": f"its class's horizon: {horizon.gaps} reuse gaps of its own",
                  "all": "all items' horizon: too few reuse gaps in its class",
                  "none": "the shortest pin: no item was asked twice"}[horizon.source] + ")")
    return {
        "kind": "kv_prefix",
        "tenant": scope.tenant,
        "adapter": scope.adapter,
        "cluster": primary,
        "clusters": sorted(c for c in served | {primary} if c != NOISE),
        "token_ids": token_ids,
        "text": _prefix_text(tokenizer, example.text, token_ids),
        "tokens": tokens,
        "new_tokens": pick.new_blocks * bs,
        "kv_bytes": kv_bytes,
        "heat_per_hour": round(heat, 4),
        "expected_saved_tokens_per_hour": round(pick.saved_per_hour, 2),
        "requests": carried,
        "members": members,
        "share": round(share, 4),
        "truncated": pick.truncated,
        "retention_s": round(horizon.retention_s, 1),
        "retention_class": horizon.klass,
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

