"""Replay sizing and reuse horizons (planning/replay.py, planning/horizons.py, build_plan(kv=)) on crafted logs, with
the demo LM tokenizer and the real PrefixCache."""

from __future__ import annotations

import hashlib
import json
import random

import numpy as np
import pytest

from warmup_tools.common.plan import Budgets, Plan, PlanError
from warmup_tools.kv.config import KVCacheConfig
from warmup_tools.planning.analyse import BlockTrie, PlanOptions, PromptStats, ScopeTraffic
from warmup_tools.planning.horizons import Horizons
from warmup_tools.planning.replay import ReplayRequest, WarmItem, choose_share, replay
from warmup_tools.planning.select import build_plan, format_summary

NOW = 1_700_000_000.0
KV_PER_TOKEN = 6144
AMPLE = Budgets(kv_bytes_per_adapter=1 << 30, kv_bytes_total=1 << 30, warm_seconds=3600.0)
#: 400 blocks of 16 tokens; warm-up may hold half (kv_warm_share 0.5).
KV = KVCacheConfig(budget_bytes=400 * 16 * KV_PER_TOKEN, block_size=16)
SYSTEM = ("You are the assistant of Acme Corporation. Be concise, cite internal policy numbers, and never reveal "
          "customer data. Use British spelling and answer in at most five bullet points, each one short.\n\n")
WORDS = ("invoice refund outage dashboard login password billing march region revenue order customer product clause "
         "contract party terminate notice supplier warranty liability renewal quarterly report export table join "
         "index latency timeout error cluster upgrade release deploy rollback alert budget forecast churn").split()


class HashEmbedder:
    """A unit vector per text from its digest: the clusters do not matter to which KV blocks are chosen."""

    def embed_batch(self, texts):
        out = np.zeros((len(texts), 32), dtype=np.float32)
        for row, text in enumerate(texts):
            seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")
            out[row] = np.random.default_rng(seed).normal(size=32)
        return out


@pytest.fixture(scope="module")
def tokenizer(demo_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_assets.lm_dir)


def record(ts, prompt, tenant="acme"):
    return {"ts": ts, "tenant": tenant, "adapter": "", "prompt": prompt}


def words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def plan_of(records, tokenizer, **options):
    return build_plan(records, tokenizer, HashEmbedder(), AMPLE, now=NOW, progress=False,
                      kv_bytes_per_token=KV_PER_TOKEN, kv=KV, options=PlanOptions(**options))


# ------------------------------------------------------------------------------------------ the choice
def test_the_share_that_served_most_wins_and_ties_go_to_the_smaller():
    assert choose_share({0.0: 10, 0.05: 12, 0.1: 15, 0.2: 15, 0.5: 14}) == 0.1
    assert choose_share({0.0: 10, 0.05: 10, 0.5: 10}) == 0.0
    assert choose_share({0.0: 10, 0.05: 9}) == 0.0


def test_a_warmed_prefix_serves_its_first_request_and_a_pin_on_traffic_that_never_comes_serves_nothing(tokenizer):
    system = tokenizer.encode(SYSTEM + "Question: where is my invoice?", add_special_tokens=True)
    other = tokenizer.encode("Completely different request about shipping and delivery tracking today.",
                             add_special_tokens=True)
    tail = [ReplayRequest(NOW + 10 * i, "acme", "", system) for i in range(3)]
    cold = replay(KV, KV_PER_TOKEN, [], tail, start=NOW)
    warm = replay(KV, KV_PER_TOKEN, [WarmItem("acme", "", system[: (len(system) - 1) // 16 * 16], 60.0)], tail,
                  start=NOW)
    usable = (len(system) - 1) // 16 * 16
    assert cold.served_tokens == 2 * usable  # the server's own cache: from the second request on
    assert warm.served_tokens == 3 * usable and warm.warmed_blocks == usable // 16
    assert warm.prompt_tokens == cold.prompt_tokens == 3 * len(system)
    elsewhere = replay(KV, KV_PER_TOKEN, [WarmItem("globex", "", system[:usable], 60.0)],
                       [ReplayRequest(NOW + 1, "acme", "", other)] * 2, start=NOW)
    assert elsewhere.served_tokens == (len(other) - 1) // 16 * 16  # another tenant's pin serves no one here


# ------------------------------------------------------------------------------------ sizing the plan
def hot_then_gone(rng, span=3000.0, n=200):
    """A hot system prompt in the first 70% of the span, then only one-off prompts that share nothing."""
    out = []
    for i in range(n):
        ts = NOW - span + span * i / n
        if ts < NOW - 0.3 * span:
            out.append(record(ts, SYSTEM + "Question: " + words(rng, 8)))
        else:
            out.append(record(ts, f"Request {i}: " + words(rng, 20)))
    return out


def test_a_plan_whose_hot_prefixes_never_recur_in_the_tail_warms_nothing_and_says_why(tokenizer):
    rng = random.Random(1)
    plan = plan_of(hot_then_gone(rng), tokenizer)
    replay_summary = plan.summary["replay"]
    assert replay_summary["state"] == "sized"
    assert replay_summary["chosen_share"] == 0.0 and replay_summary["expected_gain_tokens"] <= 0
    shares = [s["share"] for s in replay_summary["shares"]]
    assert shares[0] == 0.0 and shares[-1] == replay_summary["max_share"] == 0.5 and len(shares) >= 4
    assert any(s["items"] > 0 for s in replay_summary["shares"])  # the head's plan did warm the system prompt
    assert plan.items == [] and plan.summary["kv_bytes"] == 0
    assert plan.embedding_items == [] and plan.tokenizer_templates == []
    text = format_summary(plan)
    assert "no KV prefix is warmed: no warm share served more prompt tokens on the tail than none" in text
    assert "chosen share 0% (the plan's KV budget cut to 0 B): expected gain +0 prompt tokens (+0.00 points)" in text


def recurring(rng, span=3000.0, n=200):
    """The same system prompt all along, each request with its own question, and a burst of unrelated one-off
    prompts right after the split that evicts what the first tail requests cached (the cache holds 400 blocks)."""
    out = [record(NOW - span + span * i / n, SYSTEM + "Question: " + words(rng, 8)) for i in range(n)]
    split = NOW - 0.3 * span
    out += [record(split + 1 + i * 0.01, f"Report {i}: " + words(rng, 60)) for i in range(40)]
    return sorted(out, key=lambda r: r["ts"])


def test_a_plan_whose_hot_prefix_recurs_takes_the_smallest_share_that_serves_most(tokenizer):
    rng = random.Random(2)
    plan = plan_of(recurring(rng), tokenizer)
    r = plan.summary["replay"]
    served = {s["share"]: s["served_tokens"] for s in r["shares"]}
    assert r["chosen_share"] > 0 and r["expected_gain_tokens"] > 0 and r["expected_gain_share"] > 0
    assert r["expected_gain_tokens"] == served[r["chosen_share"]] - served[0.0]
    best = max(served.values())
    assert r["chosen_share"] == min(s for s, v in served.items() if v == best)  # ties: the smaller share
    assert plan.items and plan.summary["kv_bytes"] <= r["chosen_share"] * KV.budget_bytes
    assert all(isinstance(item["retention_s"], float) and 30.0 <= item["retention_s"] <= 3600.0 for item in plan.items)
    text = format_summary(plan)
    assert r["chosen_kv_bytes"] == int(r["chosen_share"] * KV.budget_bytes)
    assert f"expected gain +{r['expected_gain_tokens']:,} prompt tokens" in text
    assert f"chosen share {r['chosen_share']:.0%} (the plan's KV budget cut to " in text
    assert "pins expire after each item's reuse horizon" in text


def test_too_little_log_to_split_sizes_the_plan_by_the_budgets_and_says_so(tokenizer):
    rng = random.Random(3)
    records = [record(NOW - 3000 + 30 * i, SYSTEM + "Question: " + words(rng, 8)) for i in range(100)]
    plan = plan_of(records, tokenizer, replay_min_records=31)  # 30 in the tail
    assert plan.summary["replay"]["state"] == "skipped"
    assert "too little log to split: 30 tail requests" in plan.summary["replay"]["reason"]
    assert plan.items  # as without replay sizing
    assert "replay sizing skipped: too little log to split" in format_summary(plan)
    unsized = build_plan(records, tokenizer, HashEmbedder(), AMPLE, now=NOW, progress=False,
                         kv_bytes_per_token=KV_PER_TOKEN)
    assert unsized.summary["replay"]["state"] == "off"
    assert [i["token_ids"] for i in unsized.items] == [i["token_ids"] for i in plan.items]


# ------------------------------------------------------------------------------------------- horizons
def scope_of(prompts, tenant="acme"):
    """A scope whose prompts are ``(ids, times)``; its trie built as the analysis builds it (4-token blocks)."""
    scope = ScopeTraffic(tenant, "", BlockTrie(4))
    for n, (ids, times) in enumerate(prompts):
        p = PromptStats(f"p{n}", count=len(times), times=list(times), ids=list(ids))
        p.chain = scope.trie.chain(ids)
        scope.prompts[p.text] = p
    return scope


def test_a_horizon_is_the_quantile_of_the_gaps_between_requests_carrying_the_prefix_bounded():
    options = PlanOptions(retention_quantile=0.9, min_retention_s=30.0, max_retention_s=600.0, min_retention_gaps=3)
    template = [1, 2, 3, 4, 5, 6, 7, 8]
    # A shared template: two prompts diverge after its two blocks; requests at 0, 100, 150, 350, 400, 1000 s.
    shared = scope_of([(template + [9, 9, 9, 9, 1], [NOW, NOW + 150, NOW + 400]),
                       (template + [7, 7, 7, 7, 2], [NOW + 100, NOW + 350, NOW + 1000])])
    # One conversation: each turn's tokens open the next's; turns 40 s apart.
    session = scope_of([([21, 22, 23, 24, 25], [NOW]), ([21, 22, 23, 24, 25, 26, 27, 28, 29], [NOW + 40]),
                        ([21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33], [NOW + 80])], tenant="globex")
    horizons = Horizons(options)
    leaf = shared.trie.find(template)[-1]
    first_turn = session.trie.find([21, 22, 23, 24])[-1]
    horizons.prepare([(shared, leaf, 2), (session, first_turn, 1)])
    h = horizons.of(shared, leaf, 2)
    gaps = np.array([100, 50, 200, 50, 600], dtype=float)
    assert (h.klass, h.source, h.gaps) == ("shared", "item", 5)
    assert h.retention_s == pytest.approx(min(max(float(np.quantile(gaps, 0.9)), 30.0), 600.0))  # 440 s
    # The conversation's first turn has 2 gaps (< 3), and so has its class: all items' pooled gaps.
    s = horizons.of(session, first_turn, 1)
    assert (s.klass, s.gaps, s.source) == ("session", 2, "all")
    assert s.retention_s == pytest.approx(float(np.quantile(np.r_[gaps, 40, 40], 0.9)))
    # A deeper turn has one gap of its own: too few, and its class has 2 (< 3): all items' pooled gaps.
    deeper = session.trie.find([21, 22, 23, 24, 25, 26, 27, 28])[-1]
    assert horizons.of(session, deeper, 2).source == "all"
    summary = horizons.summary([h, s])
    assert summary["classes"]["shared"]["horizon_s"] == pytest.approx(440.0)
    assert summary["classes"]["session"]["horizon_s"] is None and summary["from"]["item"] == 1
    # Bounds: a prefix asked every second gets the shortest pin; with no reuse at all, too.
    busy = scope_of([(template + [1], [NOW + i for i in range(10)])])
    alone = Horizons(options)
    busy_leaf = busy.trie.find(template)[-1]
    alone.prepare([(busy, busy_leaf, 2)])
    assert alone.of(busy, busy_leaf, 2).retention_s == 30.0
    never = scope_of([(template + [1], [NOW])])
    nothing = Horizons(options)
    nothing.prepare([(never, never.trie.find(template)[-1], 2)])
    assert nothing.of(never, never.trie.find(template)[-1], 2) == \
        type(h)(30.0, "session", 0, "none")


def test_horizon_and_replay_options_are_checked():
    from warmup_tools.common.errors import ConfigError

    for bad in ({"retention_quantile": 0.0}, {"min_retention_s": 0.0},
                {"min_retention_s": 10.0, "max_retention_s": 5.0}, {"max_retention_s": float("inf")},
                {"min_retention_gaps": 0}, {"replay_tail": 1.0}, {"replay_tail": 0.0}, {"replay_min_records": 0},
                {"replay_shares": ()}, {"replay_shares": (1.5,)}):
        with pytest.raises(ConfigError):
            PlanOptions(**bad)


# ------------------------------------------------------------------------------------------ the file
@pytest.mark.parametrize("retention", [0, -5.0, 31 * 86400.0, "600", True])
def test_plan_load_refuses_an_item_retention_the_server_would_refuse(tmp_path, retention):
    items = [{"kind": "kv_prefix", "tenant": "acme", "adapter": "", "token_ids": list(range(16)),
              "retention_s": retention}]
    plan = Plan(plan_id=Plan.content_id(items, 16, "tok"), created="2024-01-01T00:00:00+00:00", block_size=16,
                tokenizer_fingerprint="tok", budgets=AMPLE.to_dict(), settings={}, summary={}, items=items,
                embedding_items=[], tokenizer_templates=[], clusters=[])
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_dict()))
    with pytest.raises(PlanError, match="item 0: retention_s must be"):
        Plan.load(path)
    items[0]["retention_s"] = 120.5
    plan.plan_id = Plan.content_id(items, 16, "tok")
    path.write_text(json.dumps(plan.to_dict()))
    assert Plan.load(path).items[0]["retention_s"] == 120.5


def test_a_prefix_is_a_sessions_prefix_when_its_requests_are_one_growing_chain_of_blocks_else_shared():
    options = PlanOptions()
    opening = [1, 2, 3, 4, 5, 6, 7, 8]
    # Two requests of a template whose user parts fit in the last, partial block: the same blocks, other text.
    template = scope_of([(opening + [50], [NOW]), (opening + [51], [NOW + 60])])
    # Two turns of a conversation: the second completes the first's partial block differently, then goes on.
    turns = scope_of([([21, 22, 23, 24, 25], [NOW]), ([21, 22, 23, 24, 26, 27, 28, 29, 30], [NOW + 60])],
                     tenant="globex")
    horizons = Horizons(options)
    template_leaf = template.trie.find(opening)[-1]
    turn_leaf = turns.trie.find([21, 22, 23, 24])[-1]
    horizons.prepare([(template, template_leaf, 2), (turns, turn_leaf, 1)])
    assert horizons.of(template, template_leaf, 2).klass == "shared"
    assert horizons.of(turns, turn_leaf, 1).klass == "session"


def test_a_plans_items_carry_the_horizon_their_logged_gaps_give(tokenizer):
    rng = random.Random(5)
    # One system prompt asked every 100 s, each time with another question: gaps of exactly 100 s.
    records = [record(NOW - 100 * i, SYSTEM + "Question: " + words(rng, 8)) for i in range(40)]
    plan = build_plan(records, tokenizer, HashEmbedder(), AMPLE, now=NOW, progress=False,
                      kv_bytes_per_token=KV_PER_TOKEN)
    shared = [item for item in plan.items if item["retention_class"] == "shared"]
    assert shared and all(item["retention_s"] == 100.0 for item in shared)
    assert plan.summary["horizons"]["classes"]["shared"]["horizon_s"] == 100.0
    assert "pinned 100 s (shared prefix, p90 of its 39 reuse gaps)" in shared[0]["reason"]
    capped = build_plan(records, tokenizer, HashEmbedder(), AMPLE, now=NOW, progress=False,
                        kv_bytes_per_token=KV_PER_TOKEN, options=PlanOptions(max_retention_s=60.0))
    assert {item["retention_s"] for item in capped.items if item["retention_class"] == "shared"} == {60.0}


def test_route_splits_the_tail_as_a_prefix_affine_router_would():
    from warmup_tools.planning.replay import replay_fleet, route

    def request(ts, *blocks):
        return ReplayRequest(float(ts), "t", "", [tok for b in blocks for tok in range(b * 16, b * 16 + 16)] + [1])

    session_a = [request(0, 1), request(1, 1, 2), request(4, 1, 2, 3)]
    session_b = [request(2, 7), request(3, 7, 8)]
    lone = request(5, 9)
    requests = sorted([*session_a, *session_b, lone], key=lambda r: r.ts)
    assert route(requests, 1, 16) == [requests]
    # session a starts on replica 0 and stays there (its turns carry its blocks); b goes to the emptier replica 1
    # and stays; the lone request goes to the replica with fewer requests then (1: 2 against a's 3)
    assert route(requests, 2, 16) == [session_a, [*session_b, lone]]
    assert route(requests, 3, 16) == [session_a, session_b, [lone]]
    with pytest.raises(Exception, match="replay_replicas"):
        PlanOptions(replay_replicas=0)
    # each replica's share against a cache of its own: a turn's blocks are served where its session went
    kv = KVCacheConfig(budget_bytes=64 * 16 * KV_PER_TOKEN, block_size=16)
    fleet = replay_fleet(kv, KV_PER_TOKEN, [], route(requests, 2, 16), start=0.0)
    assert (fleet.requests, fleet.served_tokens) == (6, (1 + 2 + 1) * 16)
