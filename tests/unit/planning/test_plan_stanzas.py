import shutil
from pathlib import Path

import pytest

from warmup_tools.common.errors import ConfigError
from warmup_tools.planning.plan_stanzas import check_repository, load_plan, samples_from_plan, write_plan_stanzas
from warmup_tools.planning.stanzas import BEGIN_MARKER

REPO = Path(__file__).resolve().parents[3] / "model_repository"

PLAN = {
    "format": 1, "plan_id": "0123456789abcdef", "block_size": 16,
    "items": [
        {"kind": "kv_prefix", "tenant": "acme", "adapter": "legal", "token_ids": list(range(5, 37))},
        {"kind": "kv_prefix", "tenant": "globex", "adapter": "", "token_ids": list(range(40, 56))},
    ],
    "tokenizer_templates": [{"text": "You are a contracts assistant.", "tenant": "acme", "adapter": "legal"}],
    "embedding_items": [{"text": "You are a contracts assistant. Clause 1?", "cluster": 3, "tenant": "acme"}],
    "clusters": [{"tenant": "acme", "adapter": "legal", "cluster": 3, "centroid": [0.1] * 384}],
}


@pytest.fixture()
def repo(tmp_path):
    target = tmp_path / "repo"
    shutil.copytree(REPO, target)
    return target


def test_plan_becomes_valid_stanzas_idempotently(repo):
    counts = write_plan_stanzas(PLAN, repo)
    assert counts == {"tokenizer_cache": 1, "embedding_cache": 1, "lora_adapter": 2}
    assert check_repository(repo) == []
    text = (repo / "lora_adapter" / "config.pbtxt").read_text()
    assert text.count(BEGIN_MARKER) == 1 and "dims: [ 32 ]" in text
    write_plan_stanzas(PLAN, repo)
    assert (repo / "lora_adapter" / "config.pbtxt").read_text() == text
    assert (repo / "embedding_cache" / "warmup" / "wt_centroids.json").exists()
    assert not (repo / "ensemble" / "warmup").exists()


def test_base_model_items_carry_no_adapter():
    kv = samples_from_plan(PLAN)["lora_adapter"]
    assert {i.name for i in kv[0].inputs} >= {"input_ids", "adapter_id", "tenant_id", "warmup_plan"}
    assert "adapter_id" not in {i.name for i in kv[1].inputs}


def test_check_finds_broken_stanzas(repo):
    write_plan_stanzas(PLAN, repo)
    data = next((repo / "lora_adapter" / "warmup").glob("*kv_0000__input_ids"))
    data.write_bytes(data.read_bytes()[:-4])
    config = repo / "tokenizer_cache" / "config.pbtxt"
    config.write_text(config.read_text().replace('key: "text_input" value: { data_type: TYPE_STRING',
                                                 'key: "text_input" value: { data_type: TYPE_INT32'))
    problems = check_repository(repo)
    assert any("kv_0000" in p and "does not hold" in p for p in problems)
    assert any("tokenizer_cache" in p and "TYPE_INT32" in p for p in problems)


def test_load_plan_refuses_other_files(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"hello": 1}')
    with pytest.raises(ConfigError, match="not a warm-up plan"):
        load_plan(path)
