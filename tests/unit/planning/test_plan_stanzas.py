import os
import shutil
from pathlib import Path

import pytest

from warmup_tools.common.digests import tokenizer_fingerprint
from warmup_tools.common.plan import Plan, PlanError
from warmup_tools.planning.plan_stanzas import check_repository, samples_from_plan, write_plan_stanzas
from warmup_tools.planning.stanzas import BEGIN_MARKER
from warmup_tools.planning.target import PlanTarget

REPO = Path(__file__).resolve().parents[3] / "model_repository"


@pytest.fixture(scope="module")
def tokenizer(demo_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_assets.lm_dir)


@pytest.fixture(scope="module")
def fingerprint(tokenizer):
    return tokenizer_fingerprint(tokenizer)


def make_plan(fingerprint, block_size=16, items=None, kv_bytes=48 * 6144):
    items = items if items is not None else [
        {"kind": "kv_prefix", "tenant": "acme", "adapter": "legal", "token_ids": list(range(5, 37))},
        {"kind": "kv_prefix", "tenant": "globex", "adapter": "", "token_ids": list(range(40, 56))},
    ]
    return Plan(
        plan_id=Plan.content_id(items, block_size, fingerprint), created="2024-01-01T00:00:00+00:00",
        block_size=block_size, tokenizer_fingerprint=fingerprint, budgets={}, settings={"kv_bytes_per_token": 6144},
        summary={"kv_bytes": kv_bytes}, items=items,
        tokenizer_templates=[{"text": "You are a contracts assistant.", "tenant": "acme", "adapter": "legal"}],
        embedding_items=[{"text": "You are a contracts assistant. Clause 1?", "cluster": 3, "tenant": "acme"}],
        clusters=[{"tenant": "acme", "adapter": "legal", "cluster": 3, "centroid": [0.1] * 384}],
    )


@pytest.fixture()
def plan(fingerprint):
    return make_plan(fingerprint)


@pytest.fixture()
def target(repo, demo_assets):
    return PlanTarget.from_repository(repo, {**os.environ, "WARMUP_ASSETS_DIR": str(demo_assets.root)})


@pytest.fixture()
def repo(tmp_path):
    target = tmp_path / "repo"
    shutil.copytree(REPO, target)
    return target


def test_plan_becomes_valid_stanzas_idempotently(repo, target, plan, tokenizer):
    counts = write_plan_stanzas(plan, repo, target=target, tokenizer=tokenizer)
    assert counts == {"tokenizer_cache": 1, "embedding_cache": 1, "lora_adapter": 2}
    assert check_repository(repo) == []
    text = (repo / "lora_adapter" / "config.pbtxt").read_text()
    assert text.count(BEGIN_MARKER) == 1 and "dims: [ 32 ]" in text
    write_plan_stanzas(plan, repo, target=target, tokenizer=tokenizer)
    assert (repo / "lora_adapter" / "config.pbtxt").read_text() == text
    assert (repo / "embedding_cache" / "warmup" / "wt_centroids.json").exists()
    assert not (repo / "ensemble" / "warmup").exists()


def test_base_model_items_carry_no_adapter(plan):
    kv = samples_from_plan(plan)["lora_adapter"]
    assert {i.name for i in kv[0].inputs} >= {"input_ids", "adapter_id", "tenant_id", "warmup_plan"}
    assert "adapter_id" not in {i.name for i in kv[1].inputs}


def test_check_finds_broken_stanzas(repo, target, plan, tokenizer):
    write_plan_stanzas(plan, repo, target=target, tokenizer=tokenizer)
    data = next((repo / "lora_adapter" / "warmup").glob("*kv_0000__*__input_ids"))
    data.write_bytes(data.read_bytes()[:-4])
    config = repo / "tokenizer_cache" / "config.pbtxt"
    config.write_text(config.read_text().replace('key: "text_input" value: { data_type: TYPE_STRING',
                                                 'key: "text_input" value: { data_type: TYPE_INT32'))
    problems = check_repository(repo)
    assert any("kv_0000" in p and "does not hold" in p for p in problems)
    assert any("tokenizer_cache" in p and "TYPE_INT32" in p for p in problems)


def test_a_plan_for_another_block_size_is_refused_naming_both(repo, target, fingerprint, tokenizer):
    item = {"kind": "kv_prefix", "tenant": "a", "adapter": "", "token_ids": list(range(32))}
    plan = make_plan(fingerprint, block_size=32, items=[item])
    with pytest.raises(PlanError, match="block size 32, but lora_adapter's kv_block_size is 16"):
        write_plan_stanzas(plan, repo, target=target, tokenizer=tokenizer)
    assert not list((repo / "lora_adapter" / "warmup").glob("plan_*"))  # nothing written


def test_a_plan_for_another_tokenizer_or_over_the_budget_is_refused(repo, target, fingerprint, tokenizer):
    other = make_plan("other-tokenizer")
    with pytest.raises(PlanError, match=f"tokenizer other-tokenizer, but lora_adapter's base_model tokenizer is "
                                        f"{fingerprint}"):
        write_plan_stanzas(other, repo, target=target, tokenizer=tokenizer)
    too_big = make_plan(fingerprint, kv_bytes=target.settings.engine.kv.warmup_budget_bytes + 1)
    with pytest.raises(PlanError, match=f"warm-up share is {target.settings.engine.kv.warmup_budget_bytes} bytes"):
        write_plan_stanzas(too_big, repo, target=target, tokenizer=tokenizer)


def _item(tokenizer, text, adapter="legal", blocks=None):
    ids = tokenizer.encode(text, add_special_tokens=True)
    keep = (len(ids) // 16 if blocks is None else blocks) * 16
    return {"kind": "kv_prefix", "tenant": "acme", "adapter": adapter, "token_ids": ids[:keep],
            "text": tokenizer.decode(ids[:keep]) if keep else text}


TEXT = "You are a careful contracts assistant. Answer with the clause number and quote it exactly. " * 2


def test_items_the_server_cannot_warm_are_refused_naming_the_item(repo, target, fingerprint, tokenizer):
    good = _item(tokenizer, TEXT)
    assert write_plan_stanzas(make_plan(fingerprint, items=[good]), repo, target=target, tokenizer=tokenizer)
    context = target.settings.engine.base_model / "config.json"
    import json

    limit = json.loads(context.read_text())["max_position_embeddings"]
    cases = [
        ({**good, "token_ids": (good["token_ids"] * (limit // len(good["token_ids"]) + 1))[: limit // 16 * 16],
          "text": ""}, f"item 1 .*has {limit // 16 * 16} tokens, but the base model's context is {limit} tokens"),
        (_item(tokenizer, TEXT, adapter="poetry"), "item 1 .*adapter 'poetry'.*does not load .*legal"),
        ({**good, "token_ids": [t + 1 for t in good["token_ids"]]}, "item 1 .*not what lora_adapter's tokenizer"),
        ({**good, "token_ids": [len(tokenizer) + 5] * 16, "text": ""}, "item 1 .*not what lora_adapter's tokenizer"),
    ]
    before = (repo / "lora_adapter" / "config.pbtxt").read_text()
    for bad, message in cases:
        with pytest.raises(PlanError, match=message):
            write_plan_stanzas(make_plan(fingerprint, items=[good, bad]), repo, target=target, tokenizer=tokenizer)
        assert (repo / "lora_adapter" / "config.pbtxt").read_text() == before  # nothing written


def test_the_target_reads_the_repository_settings(target, demo_assets):
    assert target.block_size == 16 and target.kv_bytes_per_token == 6144  # demo LM, fp32, kv_storage fp
    assert target.tokenizer_dir.resolve() == demo_assets.lm_dir.resolve()
    # kv_warm_share 0.5 caps warm-up below 1 - kv_live_reserve (0.85)
    assert target.default_budgets().kv_bytes_total == int((256 << 20) * 0.5)


def test_plan_load_refuses_other_files(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"hello": 1}')
    with pytest.raises(PlanError, match="has format None"):
        Plan.load(path)


def _retained_items(retention):
    return [{"kind": "kv_prefix", "tenant": "acme", "adapter": "legal", "token_ids": list(range(5, 37)),
             "retention_s": retention},
            {"kind": "kv_prefix", "tenant": "globex", "adapter": "", "token_ids": list(range(40, 56))}]


def test_an_items_retention_becomes_the_samples_warmup_retention_s_and_the_stanzas_check(repo, target, fingerprint,
                                                                                         tokenizer):
    import numpy as np

    from warmup_tools.planning.stanzas import deserialize_tensor

    plan = make_plan(fingerprint, items=_retained_items(900.0))
    kv = samples_from_plan(plan)["lora_adapter"]
    retained = {i.name: i for i in kv[0].inputs}["warmup_retention_s"]
    assert (retained.data_type, retained.array.dtype, retained.array.tolist()) == ("TYPE_FP32", np.float32, [900.0])
    assert "warmup_retention_s" not in {i.name for i in kv[1].inputs}  # none: the model's kv_pin_retention_s
    write_plan_stanzas(plan, repo, target=target, tokenizer=tokenizer)
    assert check_repository(repo) == []  # lora_adapter's config declares the input
    data = next((repo / "lora_adapter" / "warmup").glob("*kv_0000__*__warmup_retention_s"))
    assert deserialize_tensor(data.read_bytes(), "TYPE_FP32", [1]).tolist() == [900.0]


@pytest.mark.parametrize("retention", [0, -1.0, 1e-50, 31 * 86400.0, float("inf"), float("nan"), "600", True])
def test_an_item_whose_retention_lora_adapter_would_refuse_is_refused_before_anything_is_written(
        repo, target, fingerprint, tokenizer, retention):
    import dataclasses
    import math

    if isinstance(retention, float) and not math.isfinite(retention):  # JSON reads them; content_id cannot hash them
        plan = dataclasses.replace(make_plan(fingerprint), items=_retained_items(retention))
    else:
        plan = make_plan(fingerprint, items=_retained_items(retention))
    with pytest.raises(PlanError, match=r"plan item 0: retention_s must be a number of seconds above 0 and at most "
                                        r"2592000 \(30 days\)"):
        write_plan_stanzas(plan, repo, target=target, tokenizer=tokenizer)
    assert not list((repo / "lora_adapter" / "warmup").glob("plan_*"))
