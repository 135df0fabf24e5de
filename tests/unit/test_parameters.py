"""Every parameter is defined once, in a settings object, and documented from it: docs/parameters.md is
generated from the settings objects, and every model's config.pbtxt names only parameters they define,
leaving a default empty rather than restating it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from warmup_tools.common.errors import ConfigError
from warmup_tools.common.settings import read_settings
from warmup_tools.embedding_cache.settings import EmbeddingCacheSettings
from warmup_tools.lora_adapter.settings import LoraAdapterSettings, SchedulerConfig
from warmup_tools.ops.parameters import MODEL_SETTINGS, model_rows, parameters_markdown, shipped_values
from warmup_tools.tokenizer_cache.settings import TokenizerCacheSettings
from warmup_tools.triton.params import ModelParameters

ROOT = Path(__file__).resolve().parents[2]


def test_docs_parameters_md_is_generated_from_the_settings_objects():
    assert (ROOT / "docs" / "parameters.md").read_text(encoding="utf-8") == parameters_markdown(), (
        "docs/parameters.md is stale: run `python -m warmup_tools parameters > docs/parameters.md`")


def test_every_parameter_has_a_doc_and_one_definition_per_model():
    for model in MODEL_SETTINGS:
        names = [row.parameter for row in model_rows(model)]
        assert len(names) == len(set(names)), f"{model}: a parameter is defined twice"
        assert all(row.doc for row in model_rows(model))


@pytest.mark.parametrize("model", sorted(MODEL_SETTINGS))
def test_a_shipped_config_names_only_known_parameters_and_restates_no_default(model):
    rows = {row.parameter: row for row in model_rows(model)}
    found = list(shipped_values(ROOT / "model_repository", model).items())
    assert found and {name for name, _ in found} <= set(rows)
    for name, value in found:
        fallback = re.fullmatch(r"\$\{[A-Z_0-9]+:-(.*)\}", value)
        given = fallback.group(1) if fallback else value
        default = rows[name].spelled_default
        assert not (given and default and given == default), (
            f"{model}/config.pbtxt restates the default of {name} ({default}): leave it empty")


def params(model, **values):
    return ModelParameters({"name": model, "parameters": {k: {"string_value": str(v)} for k, v in values.items()}})


def test_an_empty_or_absent_parameter_is_its_default_and_a_set_one_is_cast_by_its_type(tmp_path):
    empty = LoraAdapterSettings.from_parameters(params("lora_adapter", base_model=tmp_path, kv_block_size="",
                                                       max_num_seqs=""))
    assert empty.engine.kv.block_size == 16 and empty.batching == SchedulerConfig()
    assert empty.engine.base_model == tmp_path and empty.engine.adapters is None and empty.snapshots.folder is None
    given = LoraAdapterSettings.from_parameters(params(
        "lora_adapter", base_model="lm", adapters=" a, ,b ", kv_block_size=32, serve_cold="yes", warm_share="0.5",
        snapshot_dir="snaps", max_tokens_limit=64))
    assert given.engine.adapters == ("a", "b") and given.engine.kv.block_size == 32 and given.service.serve_cold
    assert given.batching.warm_share == 0.5 and given.limits.max_tokens_limit == 64
    assert given.engine.base_model == Path("lm") and given.snapshots.folder == Path("snaps")


@pytest.mark.parametrize(("values", "message"), [
    ({"kv_block_size": 0}, "model 'lora_adapter': parameter kv_block_size must be >= 1 and <= 4096, not 0"),
    ({"warm_share": 0}, "model 'lora_adapter': parameter warm_share must be > 0 and <= 1, not 0.0"),
    ({"warm_share": "nan"}, "model 'lora_adapter': parameter warm_share must be > 0 and <= 1, not nan"),
    ({"kv_storage": "fp8"}, "model 'lora_adapter': parameter kv_storage must be one of fp, int8, not 'fp8'"),
    ({"max_num_seqs": 9, "max_num_batched_tokens": 8},
     "model 'lora_adapter': parameter max_num_batched_tokens (8) must be at least max_num_seqs (9)"),
    ({"max_num_seqs": "many"}, "model 'lora_adapter': parameter 'max_num_seqs'='many': invalid literal for int() "
                               "with base 10: 'many'"),
    ({"serve_cold": "maybe"}, "model 'lora_adapter': parameter 'serve_cold'='maybe': 'maybe' is not a boolean "
                              "(use true or false)"),
])
def test_a_value_outside_its_bound_fails_the_load_naming_the_model_parameter_and_bound(tmp_path, values, message):
    with pytest.raises(ConfigError) as refused:
        LoraAdapterSettings.from_parameters(params("lora_adapter", base_model=tmp_path, **values))
    assert str(refused.value) == message


def test_a_required_parameter_and_an_unknown_one_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="parameter 'tokenizer_path' is required"):
        TokenizerCacheSettings.from_parameters(params("tokenizer_cache"))
    with pytest.raises(ConfigError, match=r"unknown parameter\(s\) admit_treshold"):
        EmbeddingCacheSettings.from_parameters(params("embedding_cache", embedder_path=tmp_path, admit_treshold=1))
    with pytest.raises(ConfigError, match=r"unknown parameter\(s\) scheduler"):  # one serving path: no choice left
        LoraAdapterSettings.from_parameters(params("lora_adapter", base_model=tmp_path, scheduler="serial"))


def test_the_three_shipped_configs_read_through_their_settings_objects():
    from warmup_tools.triton.params import repository_parameters

    repository = ROOT / "model_repository"
    for model, cls in MODEL_SETTINGS.items():
        read_settings(cls, repository_parameters(repository, model, environ={}))
