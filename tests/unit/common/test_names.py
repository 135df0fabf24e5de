"""A replica's name is one safe path component wherever it comes from: a setting, a flag or the host name."""

import pytest

from warmup_tools.common.errors import ConfigError
from warmup_tools.common.names import MAX_NAME_BYTES, replica_name


@pytest.mark.parametrize("name", ["r1", "triton-warmup-0", "host.example.com", "A_b-9"])
def test_a_safe_name_is_kept(name):
    assert replica_name(name) == name


@pytest.mark.parametrize("name", [".", "..", "../r1", "r1/..", "/etc", "-r", ".hidden", "a b", "é",
                                  "x" * (MAX_NAME_BYTES + 1)])
def test_a_name_that_is_not_one_safe_path_component_is_refused(name):
    with pytest.raises(ConfigError, match="cannot name a folder or file"):
        replica_name(name)


def test_the_host_name_is_checked_too(monkeypatch):
    monkeypatch.setattr("socket.gethostname", lambda: "..")
    with pytest.raises(ConfigError, match="the host name"):
        replica_name(None)
    monkeypatch.setattr("socket.gethostname", lambda: "pod-7")
    assert replica_name("") == "pod-7"



@pytest.mark.parametrize("name", ["r1.", "r1_", "r1-"])
def test_a_name_ends_with_a_letter_or_digit(name):
    # NOTE: a KV snapshot's file name drops a trailing '.' or '_': "r1." would write "r1"'s files.
    with pytest.raises(ConfigError, match="cannot name a folder or file"):
        replica_name(name)


@pytest.mark.parametrize("name", [".", "..", "a/b"])
def test_the_replica_name_setting_is_checked_where_it_enters(tmp_path, name):
    from warmup_tools.common.settings import load_settings as load_config
    from warmup_tools.lora_adapter.settings import LoraAdapterSettings
    from warmup_tools.server.config import ServeConfig
    from warmup_tools.triton.params import ModelParameters

    with pytest.raises(ConfigError, match="cannot name a folder or file"):  # --replica-name, WARMUP_REPLICA_NAME
        load_config(ServeConfig, env={"WARMUP_REPLICA_NAME": name})
    params = {"base_model": {"string_value": "lm"}, "replica_name": {"string_value": name}}
    with pytest.raises(ConfigError, match="cannot name a folder or file"):  # lora_adapter's parameter
        LoraAdapterSettings.from_parameters(ModelParameters({"name": "lora_adapter", "parameters": params},
                                                            base_dir=tmp_path))
    assert load_config(ServeConfig, env={"WARMUP_REPLICA_NAME": "r7"}).replica_name == "r7"
