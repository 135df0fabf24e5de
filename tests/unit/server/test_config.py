import json
from pathlib import Path

import pytest

from warmup_tools.common.errors import ConfigError
from warmup_tools.common.settings import load_settings as load_config
from warmup_tools.server.config import ServeConfig
from warmup_tools.triton.params import ModelParameters, expand_path


def test_precedence_file_env_flags(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"http_port": 9000, "grpc_port": 9001}))
    cfg = load_config(ServeConfig, path, {"grpc_port": 9100}, env={"WARMUP_HTTP_PORT": "9200"})
    assert cfg.http_port == 9200 and cfg.grpc_port == 9100 and cfg.metrics_port == 8002


def test_unknown_file_key_and_bad_values_are_errors(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"htp_port": 9000}))
    with pytest.raises(ConfigError, match="htp_port"):
        load_config(ServeConfig, path, env={})
    with pytest.raises(ConfigError, match="must differ"):
        load_config(ServeConfig, None, {"http_port": 1, "grpc_port": 1}, env={})


def test_model_parameters_cast_default_and_unknown():
    params = ModelParameters({"name": "m", "parameters": {
        "n": {"string_value": "3"}, "typo": {"string_value": "x"}}})
    assert params.get("n", int, 1) == 3
    assert params.get("absent", int, 7) == 7
    with pytest.raises(ConfigError, match="typo"):
        params.check_unknown()


def test_expand_path_env_and_default(monkeypatch, tmp_path):
    monkeypatch.delenv("WT_TEST_DIR", raising=False)
    assert expand_path("${WT_TEST_DIR:-rel}/lm", tmp_path) == tmp_path / "rel" / "lm"
    monkeypatch.setenv("WT_TEST_DIR", "/abs")
    assert expand_path("${WT_TEST_DIR:-rel}/lm", tmp_path) == Path("/abs/lm")
    monkeypatch.delenv("WT_TEST_DIR")
    with pytest.raises(ValueError, match="WT_TEST_DIR"):
        expand_path("${WT_TEST_DIR}/lm")


def test_an_empty_control_dir_disables_operator_control():
    config = load_config(ServeConfig, env={"WARMUP_CONTROL_DIR": ""})
    assert config.control_dir is None and config.server_env()["WARMUP_CONTROL_DIR"] == ""
