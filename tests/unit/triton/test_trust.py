"""Trust mode: the first step proves the tenant with its key, later steps take it only from a token."""

from __future__ import annotations

import stat

import numpy as np
import pytest

from warmup_tools.common.errors import ConfigError, InvalidInputError
from warmup_tools.ops.cli import main
from warmup_tools.triton.params import ModelParameters
from warmup_tools.triton.trust import TenantAuthError, TenantTrust, add_tenant_key, read_key_hashes


def s(value):
    return np.array([value.encode()], dtype=object)


@pytest.fixture()
def files(tmp_path):
    keys, secret = tmp_path / "keys.json", tmp_path / "secret"
    return keys, secret, add_tenant_key(keys, secret, "acme"), add_tenant_key(keys, secret, "globex")


def params(**values):
    return ModelParameters({"name": "m", "parameters": {k: {"string_value": str(v)} for k, v in values.items()}})


def test_keys_are_stored_as_hashes_in_owner_only_files(files):
    keys, secret, acme, globex = files
    assert acme != globex and acme not in keys.read_text() and set(read_key_hashes(keys)) == {"acme", "globex"}
    for path in (keys, secret):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_the_first_step_verifies_the_key_and_signs_the_tenant(files):
    keys, secret, acme, globex = files
    first = TenantTrust.from_parameters(params(deployment_secret_file=secret, tenant_keys_file=keys), keys=True)
    later = TenantTrust.from_parameters(params(deployment_secret_file=secret))
    assert first.first_step_tenant({"tenant_id": s("acme"), "tenant_key": s(acme)}, own_sample=False) == "acme"
    for claim in ({"tenant_id": s("acme"), "tenant_key": s(globex)},  # another tenant's key
                  {"tenant_id": s("acme")},  # no key
                  {"tenant_id": s("nobody"), "tenant_key": s(acme)},  # an unknown tenant: the same message
                  {"tenant_key": s(acme)}):  # no tenant: "default" has no key
        with pytest.raises(TenantAuthError, match="is not authenticated on this deployment: send its tenant_key"):
            first.first_step_tenant(claim, own_sample=False)
    # The model's own warm-up samples name their tenant as the operator wrote them.
    assert first.first_step_tenant({"tenant_id": s("acme")}, own_sample=True) == "acme"
    token = first.token("acme")
    assert later.tenant_of({"tenant_token": s(token), "tenant_id": s("globex")}, own_sample=False) == "acme"


NO_TOKEN = "this deployment verifies tenants: send requests to the 'ensemble' model with tenant_id and tenant_key"
BAD_TOKEN = ("this deployment verifies tenants: the tenant token is not valid; send requests to the 'ensemble' "
             "model with tenant_id and tenant_key")


@pytest.mark.parametrize(("token", "error", "message"), [
    ("", TenantAuthError, NO_TOKEN), ("acme", TenantAuthError, NO_TOKEN), ("acme:", TenantAuthError, BAD_TOKEN),
    ("acme:00", TenantAuthError, BAD_TOKEN), ("globex:{mac}", TenantAuthError, BAD_TOKEN),
    ("acme:{mac}x", TenantAuthError, BAD_TOKEN),
    ("a b:{mac}", InvalidInputError, "input 'tenant_token' is not a valid name: use "),
])
def test_later_steps_refuse_a_missing_or_forged_token(files, token, error, message):
    keys, secret, *_ = files
    later = TenantTrust.from_parameters(params(deployment_secret_file=secret))
    mac = later.token("acme").split(":")[1]
    inputs = {"tenant_id": s("acme")} | ({"tenant_token": s(token.format(mac=mac))} if token else {})
    with pytest.raises(error) as refused:
        later.tenant_of(inputs, own_sample=False)
    assert type(refused.value) is error and refused.value.code == "INVALID_ARG"
    assert str(refused.value).startswith(message) and mac not in str(refused.value)


def test_another_deployment_s_token_is_refused(files, tmp_path):
    keys, secret, *_ = files
    other_secret = tmp_path / "other"
    add_tenant_key(tmp_path / "other-keys.json", other_secret, "acme")
    token = TenantTrust.from_files(other_secret).token("acme")
    with pytest.raises(TenantAuthError, match="token is not valid"):
        TenantTrust.from_files(secret).tenant_of({"tenant_token": s(token)}, own_sample=False)


def test_open_mode_takes_tenant_id_and_half_configured_trust_is_refused(files):
    keys, secret, *_ = files
    assert TenantTrust.from_parameters(params(), keys=True).first_step_tenant({"tenant_id": s("x")}, False) == "x"
    assert TenantTrust().tenant_of({"tenant_id": s("x")}, own_sample=False) == "x"
    with pytest.raises(ConfigError, match="needs deployment_secret_file"):
        TenantTrust.from_parameters(params(tenant_keys_file=keys), keys=True)
    with pytest.raises(ConfigError, match="needs tenant_keys_file"):
        TenantTrust.from_parameters(params(deployment_secret_file=secret), keys=True)
    short = secret.parent / "short"
    short.write_text("abc")
    with pytest.raises(ConfigError, match="too short"):
        TenantTrust.from_files(short)


def test_the_cli_adds_a_key_and_prints_it_once(tmp_path, capsys):
    keys, secret = tmp_path / "k.json", tmp_path / "s"
    assert main(["tenant-key", "acme", "--keys-file", str(keys), "--secret-file", str(secret)]) == 0
    key = capsys.readouterr().out.strip()
    TenantTrust.from_files(secret, keys, keys=True).verify_key("acme", key)
    assert main(["tenant-key", "bad name", "--keys-file", str(keys), "--secret-file", str(secret)]) == 2


def test_a_warm_up_sample_s_token_is_unsigned_and_refused_downstream(files):
    keys, secret, *_ = files
    trust = TenantTrust.from_files(secret, keys, keys=True)
    unsigned = trust.token("acme", verified=False)
    assert unsigned == "acme:"
    with pytest.raises(TenantAuthError):
        trust.tenant_of({"tenant_token": s(unsigned)}, own_sample=False)
