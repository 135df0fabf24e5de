import os
import shutil
from pathlib import Path

import pytest

from warmup_tools.planning.plan import Plan, PlanError
from warmup_tools.planning.plan_stanzas import check_repository, samples_from_plan, write_plan_stanzas
from warmup_tools.planning.stanzas import BEGIN_MARKER
from warmup_tools.planning.target import PlanTarget

REPO = Path(__file__).resolve().parents[3] / "model_repository"
TOKENIZER = "tok-fingerprint"


def make_plan(block_size=16, items=None, fingerprint=TOKENIZER, kv_bytes=48 * 6144):
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


PLAN = make_plan()


@pytest.fixture()
def target(repo, demo_assets):
    return PlanTarget.from_repository(repo, {**os.environ, "WARMUP_ASSETS_DIR": str(demo_assets.root)})


@pytest.fixture()
def repo(tmp_path):
    target = tmp_path / "repo"
    shutil.copytree(REPO, target)
    return target


def test_plan_becomes_valid_stanzas_idempotently(repo, target):
    counts = write_plan_stanzas(PLAN, repo, target=target, tokenizer_fingerprint=TOKENIZER)
    assert counts == {"tokenizer_cache": 1, "embedding_cache": 1, "lora_adapter": 2}
    assert check_repository(repo) == []
    text = (repo / "lora_adapter" / "config.pbtxt").read_text()
    assert text.count(BEGIN_MARKER) == 1 and "dims: [ 32 ]" in text
    write_plan_stanzas(PLAN, repo, target=target, tokenizer_fingerprint=TOKENIZER)
    assert (repo / "lora_adapter" / "config.pbtxt").read_text() == text
    assert (repo / "embedding_cache" / "warmup" / "wt_centroids.json").exists()
    assert not (repo / "ensemble" / "warmup").exists()


def test_base_model_items_carry_no_adapter():
    kv = samples_from_plan(PLAN)["lora_adapter"]
    assert {i.name for i in kv[0].inputs} >= {"input_ids", "adapter_id", "tenant_id", "warmup_plan"}
    assert "adapter_id" not in {i.name for i in kv[1].inputs}


def test_check_finds_broken_stanzas(repo, target):
    write_plan_stanzas(PLAN, repo, target=target, tokenizer_fingerprint=TOKENIZER)
    data = next((repo / "lora_adapter" / "warmup").glob("*kv_0000__input_ids"))
    data.write_bytes(data.read_bytes()[:-4])
    config = repo / "tokenizer_cache" / "config.pbtxt"
    config.write_text(config.read_text().replace('key: "text_input" value: { data_type: TYPE_STRING',
                                                 'key: "text_input" value: { data_type: TYPE_INT32'))
    problems = check_repository(repo)
    assert any("kv_0000" in p and "does not hold" in p for p in problems)
    assert any("tokenizer_cache" in p and "TYPE_INT32" in p for p in problems)


def test_a_plan_for_another_block_size_is_refused_naming_both(repo, target):
    item = {"kind": "kv_prefix", "tenant": "a", "adapter": "", "token_ids": list(range(32))}
    plan = make_plan(block_size=32, items=[item])
    with pytest.raises(PlanError, match="block size 32, but lora_adapter's kv_block_size is 16"):
        write_plan_stanzas(plan, repo, target=target, tokenizer_fingerprint=TOKENIZER)
    assert not list((repo / "lora_adapter" / "warmup").glob("plan_*"))  # nothing written


def test_a_plan_for_another_tokenizer_or_over_the_budget_is_refused(repo, target):
    with pytest.raises(PlanError, match="tokenizer tok-fingerprint, but lora_adapter's base_model tokenizer is other"):
        write_plan_stanzas(PLAN, repo, target=target, tokenizer_fingerprint="other")
    too_big = make_plan(kv_bytes=target.settings.kv.warmup_budget_bytes + 1)
    with pytest.raises(PlanError, match="warm-up share is 228170137 bytes"):
        write_plan_stanzas(too_big, repo, target=target, tokenizer_fingerprint=TOKENIZER)


def test_the_target_reads_the_repository_settings(target, demo_assets):
    assert target.block_size == 16 and target.kv_bytes_per_token == 6144  # demo LM, fp32, kv_storage fp
    assert target.tokenizer_dir.resolve() == demo_assets.lm_dir.resolve()
    assert target.default_budgets().kv_bytes_total == int((256 << 20) * 0.85)


def test_plan_load_refuses_other_files(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"hello": 1}')
    with pytest.raises(PlanError, match="has format None"):
        Plan.load(path)
