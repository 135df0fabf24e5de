"""The shared tier's keys and MACs are per deployment in open mode too (a random seed in the control folder)."""

import stat

import pytest

from warmup_tools.caches.redis_tier import TierKey
from warmup_tools.caches.settings import SharedTierSettings
from warmup_tools.common.errors import ConfigError
from warmup_tools.common.settings import read_settings
from warmup_tools.triton.io import OPEN_MODE_SEED_FILE, shared_tier
from warmup_tools.triton.params import ModelParameters
from warmup_tools.triton.trust import TenantTrust

KEY = TierKey("tok", "acme", "fp", b"\x01" * 16)


def redis_tier_from_params(params):
    """The tier a model's parameters describe, read as the models read them."""
    return shared_tier(read_settings(SharedTierSettings, params), TenantTrust.from_parameters(params),
                       model=params.model_name)


def tier(control_dir, url="redis://127.0.0.1:1/0"):
    params = ModelParameters({"name": "tokenizer_cache", "parameters": {
        "redis_url": {"string_value": url}, "control_dir": {"string_value": str(control_dir)}}})
    shared = redis_tier_from_params(params)
    params.check_unknown()  # control_dir is a declared parameter, with or without Redis
    return shared


def test_open_mode_keys_are_salted_and_macd_per_deployment(tmp_path):
    one, same, other = tier(tmp_path / "a"), tier(tmp_path / "a"), tier(tmp_path / "b")
    assert one._mac_key and one._salt  # never the empty key of an unkeyed MAC
    assert one.redis_key(KEY) == same.redis_key(KEY) and one._mac_key == same._mac_key  # instances agree
    assert one.redis_key(KEY) != other.redis_key(KEY) and one._mac_key != other._mac_key  # deployments differ
    assert "acme" not in one.redis_key(KEY) and KEY.digest.hex() not in one.redis_key(KEY)
    seed = tmp_path / "a" / OPEN_MODE_SEED_FILE
    assert stat.S_IMODE(seed.stat().st_mode) == 0o600


def test_a_shared_tier_in_open_mode_needs_the_control_folder(tmp_path):
    with pytest.raises(ConfigError, match="needs control_dir"):
        tier("")
    assert tier(tmp_path, url="") is None


@pytest.mark.parametrize("model", ["tokenizer_cache", "embedding_cache"])
def test_every_shared_tier_parameter_a_shipped_config_declares_is_known(model, tmp_path):
    """config.pbtxt declares redis_url_file beside redis_url: a model whose URL comes from redis_url (the
    environment) must still know the other, or it refuses to load (unknown parameter)."""
    import re
    from pathlib import Path

    config = (Path(__file__).resolve().parents[3] / "model_repository" / model / "config.pbtxt").read_text()
    declared = {name for name in re.findall(r'key:\s*"([a-z_]+)"', config) if name.startswith("redis_")}
    assert "redis_url_file" in declared
    for url in ("redis://127.0.0.1:1/0", ""):
        parameters = {name: {"string_value": ""} for name in declared} | {
            "redis_url": {"string_value": url}, "control_dir": {"string_value": str(tmp_path)}}
        params = ModelParameters({"name": model, "parameters": parameters})
        redis_tier_from_params(params)
        params.check_unknown()
