"""The warm-up planner on hand-made traffic, with the demo LM tokenizer and the demo embedder."""

from __future__ import annotations

import collections
import datetime
import gzip
import hashlib
import json
import random

import numpy as np
import pytest

from warmup_tools.common.errors import ConfigError
from warmup_tools.common.jsonl import ReadStats
from warmup_tools.common.plan import Budgets, Plan, PlanError
from warmup_tools.common.records import read_request_log
from warmup_tools.embedding_cache.settings import EmbedderConfig
from warmup_tools.lora_adapter.settings import model_kv_shape
from warmup_tools.planning.analyse import NOISE, PlanOptions, analyse_traffic, shared_prefix
from warmup_tools.planning.select import build_plan, format_summary

NOW = 1_700_000_000.0
KV_PER_TOKEN = 6144  # the demo LM: 2 * 6 layers * 2 kv heads * 64 dims * 4 bytes
BLOCK_BYTES = 16 * KV_PER_TOKEN
AMPLE = Budgets(kv_bytes_per_adapter=1 << 30, kv_bytes_total=1 << 30, warm_seconds=3600.0)
CREATED = datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc)

SYSTEMS = {
    "acme": "You are the assistant of Acme Corporation. Be concise, cite internal policy numbers, and never "
            "reveal customer data. Use British spelling and answer in at most five bullet points.",
    "globex": "Globex internal copilot. You help analysts with data questions. Prefer tables over prose, state "
              "assumptions explicitly, and flag any figure you are unsure about with a question mark.",
    "initech": "Initech helpdesk bot: greet the user by name if known, restate the issue, propose a fix in "
               "numbered steps, and offer escalation to a human after two failed attempts.",
}
# Two templates of acme's base model share its system prompt: the hard case for clustering.
TEMPLATES = {
    ("acme", ""): ["Summarise the following support ticket for the weekly report.\nTicket: {u}",
                   "Translate the following customer message into French, keeping product names.\nMessage: {u}"],
    ("acme", "legal"): ["Review this clause and list obligations, deadlines and remedies.\nClause: {u}"],
    ("globex", "sql"): ["Write a PostgreSQL query for the question below using the sales schema.\nQuestion: {u}"],
    ("initech", "support"): ["Customer says: {u}"],
}
USER_WORDS = ("invoice refund outage dashboard login password billing march region revenue order customer product "
              "clause contract party terminate notice indemnify supplier warranty liability renewal quarterly report "
              "export table join index latency timeout error cluster upgrade release deploy rollback alert budget "
              "forecast churn retention signup trial discount shipping delivery tracking warehouse stock").split()


class CachingEmbedder:
    """The demo embedder, remembering texts so every test embeds each distinct prompt once."""

    def __init__(self, inner):
        self.inner = inner
        self.cache: dict[str, np.ndarray] = {}

    def embed_batch(self, texts):
        missing = [t for t in dict.fromkeys(texts) if t not in self.cache]
        if missing:
            for text, vector in zip(missing, self.inner.embed_batch(missing)):
                self.cache[text] = vector
        return np.stack([self.cache[t] for t in texts])


class KeywordEmbedder:
    """Puts every prompt that ends with the same word at the same spot (plus a little noise): the
    clusters are known in advance, so tests of what happens after clustering do not depend on MiniLM.
    With one word, every prompt goes to the same spot."""

    def __init__(self, words):
        self.words = list(words)

    def embed_batch(self, texts):
        out = np.zeros((len(texts), 384), dtype=np.float32)
        for row, text in enumerate(texts):
            out[row, 0 if len(self.words) == 1 else self.words.index(text.rsplit(" ", 1)[-1])] = 1.0
            seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")
            out[row] += np.random.default_rng(seed).normal(0.0, 0.01, 384).astype(np.float32)
        return out


@pytest.fixture(scope="module")
def tokenizer(demo_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_assets.lm_dir)


@pytest.fixture(scope="module")
def embedder(demo_assets):
    from warmup_tools.embedding_cache.embedder import OnnxEmbedder

    return CachingEmbedder(OnnxEmbedder(EmbedderConfig(demo_assets.embedder_dir)))


def record(ts, tenant, adapter, prompt, **extra):
    return {"ts": ts, "tenant": tenant, "adapter": adapter, "prompt": prompt,
            "prompt_digest": hashlib.sha256(prompt.encode()).hexdigest()[:32], "prompt_tokens": 0,
            "cached_tokens": 0, "ttft_ms": 5.0, "output_tokens": 8, "cluster": None, **extra}


def user_part(rng, low=4, high=24):
    return " ".join(rng.choice(USER_WORDS) for _ in range(rng.randint(low, high)))


def template_traffic(embedder, n=360, tail_share=0.12, seed=7):
    """Requests from a few templates with variable user parts, plus unrelated one-off prompts
    (``template`` = the ground-truth label, "tail" for the one-offs)."""
    rng = random.Random(seed)
    vocab = sorted(w for w in embedder.inner.tokenizer.get_vocab() if w.isascii() and w.isalpha() and len(w) >= 4)
    keys = [(scope, i) for scope in TEMPLATES for i in range(len(TEMPLATES[scope]))]
    out = []
    for _ in range(n):
        ts = NOW - rng.random() * 24 * 3600
        if rng.random() < tail_share:
            scope = rng.choice(list(TEMPLATES))
            prompt = " ".join(rng.choice(vocab) for _ in range(rng.randint(8, 40))).capitalize() + "?"
            label = "tail"
        else:
            scope, i = rng.choice(keys)
            prompt = SYSTEMS[scope[0]] + "\n\n" + TEMPLATES[scope][i].format(u=user_part(rng))
            label = f"{scope[0]}/{scope[1]}/{i}"
        out.append(record(ts, scope[0], scope[1], prompt, template=label))
    return out


def purity(records, clusters):
    by_cluster = collections.defaultdict(collections.Counter)
    for rec, cluster in zip(records, clusters):
        if cluster is not None and cluster != NOISE:
            by_cluster[cluster][rec["template"]] += 1
    clustered = sum(sum(c.values()) for c in by_cluster.values())
    return sum(c.most_common(1)[0][1] for c in by_cluster.values()) / clustered


# ------------------------------------------------------------------------------------------- reading
def test_a_log_with_a_torn_last_line_still_plans_and_reports_the_line(tokenizer, embedder, tmp_path):
    rng = random.Random(4)
    rows = [record(NOW - rng.random() * 600, "acme", "", SYSTEMS["acme"] + "\n\n" + user_part(rng)) for _ in range(40)]
    plain = tmp_path / "requests-a.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"ts": 1700000000.0, "tenant": "ac')
    packed = tmp_path / "requests-b.jsonl.gz"
    with gzip.open(packed, "wt") as out:
        out.write(json.dumps(rows[0]) + "\n")
    stats = ReadStats()
    plan = build_plan(read_request_log([plain, packed], stats), tokenizer, embedder, AMPLE, now=NOW,
                      kv_bytes_per_token=KV_PER_TOKEN, progress=False, created=CREATED)
    assert plan.summary["records"] == 41 and plan.items
    assert stats.skipped == 1 and stats.examples[0].line == 41
    assert "torn last line" in stats.examples[0].reason


def test_kv_bytes_per_token_comes_from_the_model_config(demo_assets, tmp_path):
    assert model_kv_shape(demo_assets.lm_dir).bytes_per_token("fp", 4, 16) == KV_PER_TOKEN
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 512}))  # no GQA, no head_dim
    shape = model_kv_shape(tmp_path)
    assert shape.bytes_per_token("fp", 2, 16) == 2 * 4 * 8 * 64 * 2  # bf16
    # int8: one byte a value, plus one fp16 scale per (layer, k/v, head, channel) shared by a block's 16 tokens
    assert shape.bytes_per_token("int8", 2, 16) == 2 * 4 * 8 * 64 * (1 + 2 / 16)


# ------------------------------------------------------------------------------------ prefix chooser
def test_prefix_is_the_shared_system_prompt_cut_down_to_full_blocks(tokenizer):
    rng = random.Random(1)
    prompts = [SYSTEMS["acme"] + "\n\n" + user_part(rng) for _ in range(12)]
    ids = [tokenizer.encode(p, add_special_tokens=True) for p in prompts]
    common = next(i for i in range(min(map(len, ids))) if len({tuple(x[: i + 1]) for x in ids}) > 1)
    system_tokens = len(tokenizer.encode(SYSTEMS["acme"], add_special_tokens=True))

    choice = shared_prefix(ids, block_size=16)

    assert choice.tokens == common // 16 * 16 and choice.tokens % 16 == 0
    assert choice.tokens > system_tokens - 16  # the whole system prompt but its last partial block
    assert list(choice.token_ids) == ids[0][: choice.tokens]
    assert choice.share == 1.0
    assert SYSTEMS["acme"].startswith(tokenizer.decode(list(choice.token_ids), skip_special_tokens=True))


def test_prefix_needs_the_share_of_requests_weighted_by_count():
    shared, other = list(range(100, 112)), list(range(200, 212))  # three 4-token blocks each
    lists = [shared + [1, 2, 3, 4, 5], shared + [6, 7, 8, 9, 10], other + [11, 12]]
    assert shared_prefix(lists, [4, 4, 2], block_size=4, share=0.8).token_ids == tuple(shared)
    # 70% is not 80%: the two groups share no block at all.
    assert shared_prefix(lists, [4, 3, 3], block_size=4, share=0.8).tokens == 0
    # One distinct prompt asked 8 times outweighs two one-offs.
    assert shared_prefix(lists, [8, 1, 1], block_size=4, share=0.8).token_ids == tuple(lists[0][:16])


def test_no_prefix_without_a_shared_full_block():
    assert shared_prefix([[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9]], block_size=4).tokens == 0
    # A request always prefills its last token, so an 8-token prompt can reuse one block, not two.
    assert shared_prefix([[1, 2, 3, 4, 5, 6, 7, 8]] * 3, block_size=4).token_ids == (1, 2, 3, 4)
    assert shared_prefix([[1, 2, 3, 4]] * 5, block_size=4).tokens == 0


# ---------------------------------------------------------------------------------------- clustering
@pytest.mark.parametrize("max_points_per_group", [512, 40], ids=["all-embedded", "sampled"])
def test_clusters_follow_templates_and_leave_one_off_prompts_as_noise(tokenizer, embedder, max_points_per_group):
    records = template_traffic(embedder)
    analysis = analyse_traffic(records, tokenizer, embedder, now=NOW, progress=False,
                               options=PlanOptions(max_points_per_group=max_points_per_group))
    labels = analysis.record_clusters

    assert purity(records, labels) >= 0.9
    tail = [c for r, c in zip(records, labels) if r["template"] == "tail"]
    templated = [c for r, c in zip(records, labels) if r["template"] != "tail"]
    assert sum(c == NOISE for c in tail) / len(tail) >= 0.8
    assert sum(c == NOISE for c in templated) / len(templated) <= 0.1
    # The two acme templates that share a system prompt are told apart.
    acme = {c for r, c in zip(records, labels) if r["tenant"] == "acme" and r["adapter"] == "" and c != NOISE}
    assert len(acme) >= 2
    if max_points_per_group == 40:
        assert analysis.embedded_prompts < analysis.unique_prompts


# ----------------------------------------------------------------------------------------- selection
def three_scopes():
    """Hot, warm and cold templates in three scopes; a and b share adapter "x"."""
    rng = random.Random(3)
    specs = [("a", "x", "acme", 60), ("b", "x", "globex", 30), ("c", "y", "initech", 10)]
    return [record(NOW - rng.random() * 3600, tenant, adapter, SYSTEMS[system] + "\n\n" + user_part(rng))
            for tenant, adapter, system, count in specs for _ in range(count)]


def test_a_tight_budget_takes_the_best_saving_per_byte_first(tokenizer, embedder):
    records = three_scopes()
    plan = lambda budgets: build_plan(records, tokenizer, embedder, budgets, now=NOW, progress=False,  # noqa: E731
                                      kv_bytes_per_token=KV_PER_TOKEN, options=PlanOptions(arbitration="fixed"))
    full = plan(AMPLE)
    assert [i["tenant"] for i in full.items] == ["a", "b", "c"]
    ratios = [i["expected_saved_tokens_per_hour"] / i["kv_bytes"] for i in full.items]
    assert ratios == sorted(ratios, reverse=True)
    a, b, c = full.items
    assert not any(i["truncated"] for i in full.items)

    only_a = plan(Budgets(kv_bytes_per_adapter=1 << 30, kv_bytes_total=a["kv_bytes"], warm_seconds=3600.0))
    assert [i["tenant"] for i in only_a.items] == ["a"]
    assert only_a.summary["kv_bytes"] <= a["kv_bytes"]

    one_more_block = plan(Budgets(kv_bytes_per_adapter=1 << 30, kv_bytes_total=a["kv_bytes"] + BLOCK_BYTES,
                                  warm_seconds=3600.0))
    assert [(i["tenant"], i["tokens"], i["truncated"]) for i in one_more_block.items] == [
        ("a", a["tokens"], False), ("b", 16, True)]

    per_adapter = plan(Budgets(kv_bytes_per_adapter=a["kv_bytes"], kv_bytes_total=1 << 30, warm_seconds=3600.0))
    assert [i["tenant"] for i in per_adapter.items] == ["a", "c"]  # b would overfill adapter x

    warm_time = plan(Budgets(kv_bytes_per_adapter=1 << 30, kv_bytes_total=1 << 30,
                             warm_seconds=a["tokens"] / 1000.0, prefill_tokens_per_s=1000.0))
    assert [i["tenant"] for i in warm_time.items] == ["a"]
    assert warm_time.summary["expected_warm_seconds"] <= a["tokens"] / 1000.0

    assert plan(Budgets(kv_bytes_per_adapter=0, kv_bytes_total=0)).items == []


def test_measured_arbitration_keeps_a_small_adapter_from_starting_cold_and_states_the_shares(tokenizer, embedder):
    records = three_scopes()
    plan = lambda budgets, mode: build_plan(  # noqa: E731
        records, tokenizer, embedder, budgets, now=NOW, progress=False, kv_bytes_per_token=KV_PER_TOKEN,
        options=PlanOptions(arbitration=mode))
    full = plan(AMPLE, "measured")
    a = full.items[0]
    assert full.summary["arbitration"]["fits"] and [i["tenant"] for i in full.items] == ["a", "b", "c"]
    tight = Budgets(kv_bytes_per_adapter=1 << 30, kv_bytes_total=a["kv_bytes"], warm_seconds=3600.0)
    # Fixed: the hottest blocks anywhere take the budget, and adapter y's requests all start cold.
    assert {i["adapter"] for i in plan(tight, "fixed").items} == {"x"}
    # Measured: first blocks first, by the rate only a warm-up keeps warm, so y gets its first block.
    measured = plan(tight, "measured")
    shares = measured.summary["arbitration"]
    assert not shares["fits"] and shares["mode"] == "measured"
    assert {i["adapter"] for i in measured.items} == {"x", "y"}
    assert shares["adapters"]["y"]["cap_bytes"] >= BLOCK_BYTES and shares["adapters"]["y"]["used_bytes"] >= BLOCK_BYTES
    assert sum(s["cap_bytes"] for s in shares["adapters"].values()) <= a["kv_bytes"]
    assert shares["adapters"]["x"]["share"] > shares["adapters"]["y"]["share"]
    assert "of requests" in shares["adapters"]["y"]["reason"]
    assert "budget split (measured)" in format_summary(measured) and "  y: " in format_summary(measured)


def test_a_shared_prefix_is_one_item_and_an_extension_pays_only_its_extra_blocks(tokenizer):
    rng = random.Random(5)
    system = SYSTEMS["globex"] + "\n\n"
    translate = "Translate the following text into French, keeping names and figures unchanged:\n"
    summarise = "Summarise the following report in three short bullet points for a busy executive:\n"
    records = []
    for word, head, count in (("cooking", "", 40), ("french", translate, 30), ("summary", summarise, 20)):
        for _ in range(count):
            records.append(record(NOW - rng.random() * 3600, "acme", "", system + head + user_part(rng) + " " + word))
    # The user parts draw from a small vocabulary, so a few of them share a block by chance: only
    # blocks 5 requests carry count here.
    # The keyword sits at the end of each prompt: embed whole texts.
    plan = build_plan(records, tokenizer, KeywordEmbedder(["cooking", "french", "summary"]), AMPLE, now=NOW,
                      progress=False, kv_bytes_per_token=KV_PER_TOKEN,
                      options=PlanOptions(min_block_requests=5, embed_chars=1 << 20, split_chars=1 << 20))

    assert len(plan.clusters) == 3
    assert len({tuple(i["token_ids"]) for i in plan.items}) == len(plan.items) == 2
    first, second = plan.items
    system_tokens = len(tokenizer.encode(system, add_special_tokens=True)) // 16 * 16
    assert first["cluster"] != second["cluster"]
    assert len(first["clusters"]) == 3  # the system prompt's blocks serve every cluster, cooking included
    assert second["token_ids"][: second["tokens"] - second["new_tokens"]] == first["token_ids"][
        : second["tokens"] - second["new_tokens"]]
    assert second["tokens"] - second["new_tokens"] >= system_tokens - 16
    assert second["kv_bytes"] == second["new_tokens"] * KV_PER_TOKEN
    assert plan.summary["kv_bytes"] == (first["tokens"] + second["new_tokens"]) * KV_PER_TOKEN
    assert "warmed by item 0" in second["reason"]
    # Requests through the shared blocks are counted once, on the item that warms them.
    assert first["expected_saved_tokens_per_hour"] > second["expected_saved_tokens_per_hour"]


def test_distinct_prompts_that_open_alike_each_get_their_own_prefix(tokenizer):
    """Real prompt collections open the same way ("I want you to act as"): one embedding cluster, but
    each prompt's own tokens are what a request reuses, so each gets its own prefix past the opening."""
    rng = random.Random(3)
    roles = ["a travel guide for a small coastal town, suggesting walks, food and museums",
             "a patient maths tutor who explains every step of a proof with a simple example",
             "a strict English grammar teacher who corrects spelling and explains each rule",
             "a senior Linux system administrator answering questions about shell commands"]
    records = []
    for index, role in enumerate(roles):
        prompt = f"I want you to act as {role}. Keep answers short and friendly.\n"
        for _ in range(25 - index * 4):
            records.append(record(NOW - rng.random() * 3600, "acme", "", prompt + user_part(rng) + " act"))
    # One cluster for all of them, as a semantic embedder puts prompts that open alike together.
    plan = build_plan(records, tokenizer, KeywordEmbedder(["act"]), AMPLE, now=NOW, progress=False,
                      kv_bytes_per_token=KV_PER_TOKEN)
    assert len(plan.clusters) == 1
    assert len(plan.items) == len(roles)
    for role in roles:
        ids = tokenizer.encode(f"I want you to act as {role}. Keep answers short and friendly.\n",
                               add_special_tokens=True)
        item = next(i for i in plan.items if role[:20] in tokenizer.decode(i["token_ids"]))
        assert item["tokens"] == (len(ids) // 16) * 16  # every full block of the role prompt
    assert sorted(i["requests"] for i in plan.items) == [13, 17, 21, 25]
    saved = [i["expected_saved_tokens_per_hour"] for i in plan.items]
    assert saved == sorted(saved, reverse=True)  # the biggest saving is warmed first


def test_blocks_seen_once_only_take_budget_left_over_and_only_as_whole_one_off_prompts(tokenizer):
    rng = random.Random(4)
    records = [record(NOW - rng.random() * 3600, "acme", "", SYSTEMS["acme"] + "\n\n" + user_part(rng) + " x")
               for _ in range(10)]
    one_off = "An unrelated one-off prompt that nobody else sends, long enough to fill several blocks. " * 3 + "x"
    records.append(record(NOW, "acme", "", one_off))
    plan = lambda recs, budgets=AMPLE, **options: build_plan(  # noqa: E731
        recs, tokenizer, KeywordEmbedder(["x"]), budgets, now=NOW, progress=False, kv_bytes_per_token=KV_PER_TOKEN,
        options=PlanOptions(**options))
    one_off_blocks = (len(tokenizer.encode(one_off, add_special_tokens=True)) - 1) // 16

    # Blocks many requests share first; then, with budget left, the one-off prompt whole (a repeat of it
    # would start cold); never the one-off user parts behind the shared system prompt.
    shared, whole = plan(records).items
    assert shared["requests"] == 10 and whole["requests"] == 1
    assert whole["tokens"] == whole["new_tokens"] == one_off_blocks * 16
    assert plan(records, warm_one_off_prompts=False).items == [shared]
    # Only what is left over: a budget that holds the shared prefix and less than the whole one-off has no room.
    tight = Budgets(kv_bytes_per_adapter=1 << 30,
                    kv_bytes_total=shared["kv_bytes"] + (one_off_blocks - 1) * BLOCK_BYTES)
    assert [i["requests"] for i in plan(records, tight).items] == [10]

    two = plan(records + [record(NOW, "acme", "", one_off)])
    assert [i["requests"] for i in two.items] == [10, 2]  # sent twice, it competes with shared blocks


# -------------------------------------------------------------------------------------- heat, redaction
def test_recent_requests_count_more(tokenizer, embedder):
    rng = random.Random(9)
    records = [record(NOW - age_h * 3600, tenant, "", SYSTEMS[system] + "\n\n" + user_part(rng))
               for tenant, system, age_h in (("fresh", "acme", 1.0), ("stale", "globex", 19.0)) for _ in range(20)]
    plan = build_plan(records, tokenizer, embedder, AMPLE, now=NOW, progress=False, kv_bytes_per_token=KV_PER_TOKEN,
                      options=PlanOptions(half_life_s=6 * 3600.0))
    heat = {c["tenant"]: c["heat_per_hour"] for c in plan.clusters}
    assert heat["fresh"] / heat["stale"] == pytest.approx(2 ** (18 / 6), rel=1e-3)
    assert [i["tenant"] for i in plan.items] == ["fresh", "stale"]


def test_redacted_records_count_for_heat_but_are_not_planned(tokenizer, embedder):
    rng = random.Random(11)
    clear = [record(NOW - rng.random() * 3600, "acme", "", SYSTEMS["acme"] + "\n\n" + user_part(rng))
             for _ in range(20)]
    repeated = {k: v for k, v in clear[0].items() if k != "prompt"}  # same digest, prompt redacted
    secret = [{k: v for k, v in record(NOW, "secret", "", SYSTEMS["initech"] + user_part(rng)).items() if k != "prompt"}
              for _ in range(15)]
    baseline = build_plan(clear, tokenizer, embedder, AMPLE, now=NOW, progress=False, kv_bytes_per_token=KV_PER_TOKEN)
    plan = build_plan(clear + [repeated] * 10 + secret, tokenizer, embedder, AMPLE, now=NOW, progress=False,
                      kv_bytes_per_token=KV_PER_TOKEN)

    assert plan.summary["records"] == 45
    assert plan.summary["planned_records"] == 20 and plan.summary["redacted_records"] == 25
    assert {c["tenant"] for c in plan.clusters} == {i["tenant"] for i in plan.items} == {"acme"}
    # The redacted repeats are attributed through their digest (and, asked 11 times, that prompt may be a
    # cluster of its own).
    assert sum(c["size"] for c in plan.clusters) == 30
    heat = lambda p: sum(c["heat_per_hour"] for c in p.clusters)  # noqa: E731
    assert heat(plan) == pytest.approx(heat(baseline) * 30 / 20, rel=0.2)


# ------------------------------------------------------------------------------------ plan file, report
def test_plan_round_trips_and_its_id_hashes_what_is_warmed(tokenizer, embedder, tmp_path):
    records = three_scopes()
    make = lambda budgets: build_plan(records, tokenizer, embedder, budgets, now=NOW, progress=False,  # noqa: E731
                                      kv_bytes_per_token=KV_PER_TOKEN, created=CREATED)
    plan = make(AMPLE)
    again = make(AMPLE)
    assert again.plan_id == plan.plan_id and again.to_json() == plan.to_json()
    assert len(plan.plan_id) == 16 and plan.format == 1
    assert json.loads(plan.to_json())["items"][0]["token_ids"] == plan.items[0]["token_ids"]

    path = tmp_path / "plans" / "plan.json"
    plan.save(path)
    assert Plan.load(path).to_dict() == plan.to_dict()

    tighter = make(Budgets(kv_bytes_per_adapter=1 << 30, kv_bytes_total=plan.items[0]["kv_bytes"], warm_seconds=3600.0))
    assert tighter.plan_id != plan.plan_id

    data = json.loads(path.read_text())
    data["items"][0]["token_ids"] = data["items"][0]["token_ids"][:16]
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="edited after it was built"):
        Plan.load(path)
    data["format"] = 2
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="format 2.*reads format 1"):
        Plan.load(path)
    with pytest.raises(PlanError, match="does not exist"):
        Plan.load(tmp_path / "missing.json")


def test_summary_reports_heat_errors_and_lists_the_items(tokenizer, embedder):
    plan = build_plan(three_scopes(), tokenizer, embedder, AMPLE, now=NOW, progress=False,
                      kv_bytes_per_token=KV_PER_TOKEN)
    summary = plan.summary
    assert summary["heat_model"] == "decayed_frequency"
    assert summary["heat_error_baseline"] >= 0.0
    assert summary["heat_error_learnt"] is None or summary["heat_error_learnt"] >= summary["heat_error_baseline"]
    assert summary["expected_saved_tokens_per_hour"] == pytest.approx(
        sum(i["expected_saved_tokens_per_hour"] for i in plan.items), abs=0.5)
    assert [t["text"] for t in plan.tokenizer_templates] == [i["text"] for i in plan.items]
    assert {e["cluster"] for e in plan.embedding_items} == {c for i in plan.items for c in i["clusters"]}
    assert all(len(c["centroid"]) == 384 for c in plan.clusters)
    for item in plan.items:
        assert tokenizer.encode(item["text"], add_special_tokens=True)[: item["tokens"]] == item["token_ids"]

    text = format_summary(plan)
    assert plan.plan_id in text and "held-out error" in text and "learnt" in text
    assert len([line for line in text.splitlines() if line.lstrip().startswith(("0 ", "1 ", "2 "))]) == 3


def test_budgets_are_validated():
    with pytest.raises(ConfigError, match="kv_bytes_total must be >= 0"):
        Budgets(kv_bytes_per_adapter=1, kv_bytes_total=-1)
    with pytest.raises(ConfigError, match="unknown budget key"):
        Budgets.from_dict({"kv_bytes_per_adapter": 1, "kv_bytes_total": 1, "kv_bytes": 3})
    assert Budgets.from_dict(AMPLE.to_dict()) == AMPLE


def test_clusters_follow_templates_on_generated_traffic(tokenizer, embedder):
    """Purity on the traffic generator's logs: templates sharing a tenant's system prompt are told apart."""
    import collections

    from warmup_tools.sim.traffic import TrafficConfig, generate

    config = TrafficConfig(seed=5, days=1, requests_per_day=1500)
    records = list(generate(config))
    analysis = analyse_traffic(records, tokenizer, embedder, now=config.start + 86400, progress=False)
    groups = collections.defaultdict(collections.Counter)
    for r, c in zip(records, analysis.record_clusters):
        if r["template"] is not None and c is not None and c != NOISE:
            groups[c][r["template"]] += 1
    clustered = sum(sum(g.values()) for g in groups.values())
    purity = sum(g.most_common(1)[0][1] for g in groups.values()) / clustered
    print(f"purity on generated traffic: {purity:.3f} over {clustered} records, {len(analysis.clusters)} clusters")
    assert purity >= 0.75
    assert clustered >= 0.9 * sum(1 for r in records if r["template"] is not None)


# -------------------------------------------------------------------------------------- rolling plans
def _two_roles(rng, hot_a, hot_b):
    records = []
    for role, count in (("a travel guide for a small coastal town, suggesting walks and museums", hot_a),
                        ("a patient maths tutor who explains every step of a proof with an example", hot_b)):
        prompt = f"I want you to act as {role}. Keep answers short and friendly.\n"
        records += [record(NOW - rng.random() * 3600, "acme", "", prompt + user_part(rng) + " act")
                    for _ in range(count)]
    return records


def test_a_rolling_plan_keeps_its_items_unless_clearly_beaten(tokenizer):
    rng = random.Random(8)
    embedder = KeywordEmbedder(["act"])
    make = lambda records, budgets, previous=None: build_plan(  # noqa: E731
        records, tokenizer, embedder, budgets, now=NOW, progress=False, kv_bytes_per_token=KV_PER_TOKEN,
        previous=previous, options=PlanOptions(min_block_requests=5))  # user parts share blocks by chance
    first = make(_two_roles(rng, 12, 20), AMPLE)
    assert len(first.items) == 2
    tutor = next(i for i in first.items if "tutor" in i["text"])
    one_item = Budgets(kv_bytes_per_adapter=1 << 30, kv_bytes_total=tutor["kv_bytes"], warm_seconds=3600.0)
    before = make(_two_roles(rng, 12, 20), one_item)
    assert [("tutor" in i["text"]) for i in before.items] == [True]
    assert before.summary["changes"] == {"previous_plan": None, "added": 1, "kept": 0, "dropped": 0,
                                         "dropped_items": []}

    # The guide is now a little hotter (22 against 20 requests): within the hysteresis, the tutor stays.
    slightly = make(_two_roles(rng, 22, 20), one_item, previous=before)
    assert [("tutor" in i["text"]) for i in slightly.items] == [True]
    assert slightly.summary["changes"]["kept"] == 1 and slightly.summary["changes"]["dropped"] == 0
    # Without the previous plan the same traffic picks the guide: the plan would have flapped.
    assert ["guide" in i["text"] for i in make(_two_roles(rng, 22, 20), one_item).items] == [True]

    # Clearly hotter (40 against 20): the guide replaces it, and the plan says so.
    clearly = make(_two_roles(rng, 40, 20), one_item, previous=before)
    assert ["guide" in i["text"] for i in clearly.items] == [True]
    changes = clearly.summary["changes"]
    assert (changes["previous_plan"], changes["added"], changes["kept"], changes["dropped"]) == (
        before.plan_id, 1, 0, 1)
    assert "tutor" in changes["dropped_items"][0]["text"]
    assert f"against plan {before.plan_id}: 1 items added, 0 kept, 1 dropped" in format_summary(clearly)
