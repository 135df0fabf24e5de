"""Trust mode: the first step proves the tenant with its key, later steps take it only from a token that
binds tenant, key version, expiry and audience, checked against the keys file as it is now."""

from __future__ import annotations

import stat

import numpy as np
import pytest

from warmup_tools.common.errors import ConfigError
from warmup_tools.ops.cli import main
from warmup_tools.triton.params import ModelParameters
from warmup_tools.triton.trust import (
    DEFAULT_TOKEN_TTL_S,
    TenantAuthError,
    TenantTrust,
    add_tenant_key,
    read_key_hashes,
    sign_token,
)

#: A fixed clock: every token below is made and checked at this second (or a stated offset from it).
NOW = 1_800_000_000.0
BAD_TOKEN = "the tenant token is not valid; send requests to the 'ensemble' model with tenant_id and tenant_key"


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
    first = TenantTrust.from_parameters(params(deployment_secret_file=secret, tenant_keys_file=keys))
    later = TenantTrust.from_files(secret, keys, model="lora_adapter")
    assert first.first_step_tenant({"tenant_id": s("acme"), "tenant_key": s(acme)}, own_sample=False) == "acme"
    for claim in ({"tenant_id": s("acme"), "tenant_key": s(globex)},  # another tenant's key
                  {"tenant_id": s("acme")},  # no key
                  {"tenant_id": s("nobody"), "tenant_key": s(acme)},  # an unknown tenant: the same message
                  {"tenant_key": s(acme)}):  # no tenant: "default" has no key
        with pytest.raises(TenantAuthError, match="is not authenticated on this deployment: send its tenant_key"):
            first.first_step_tenant(claim, own_sample=False)
    # The model's own warm-up samples name their tenant as the operator wrote them.
    assert first.first_step_tenant({"tenant_id": s("acme")}, own_sample=True) == "acme"
    token = first.token("acme", now=NOW)
    assert later.tenant_of({"tenant_token": s(token), "tenant_id": s("globex")}, own_sample=False, now=NOW) == "acme"


@pytest.mark.parametrize("token", ["", "acme", "acme:", "acme:00", "a b:{rest}", "globex:{rest}", "acme:{rest}x",
                                   "acme:{rest}:x", "acme::{rest}"])
def test_later_steps_refuse_a_missing_or_forged_token(files, token):
    keys, secret, *_ = files
    later = TenantTrust.from_files(secret, keys, model="lora_adapter")
    rest = later.token("acme", now=NOW).split(":", 1)[1]
    inputs = {"tenant_id": s("acme")} | ({"tenant_token": s(token.format(rest=rest))} if token else {})
    with pytest.raises(TenantAuthError) as refused:
        later.tenant_of(inputs, own_sample=False, now=NOW)
    message = str(refused.value)
    assert type(refused.value) is TenantAuthError and refused.value.code == "INVALID_ARG"
    assert message.startswith("this deployment verifies tenants: ") and rest not in message


@pytest.mark.parametrize("field", range(5))
def test_a_token_with_any_field_changed_is_refused_with_the_same_error(files, field):
    keys, secret, *_ = files
    trust = TenantTrust.from_files(secret, keys, model="lora_adapter")
    parts = trust.token("acme", now=NOW).split(":")
    parts[field] = {0: "globex", 1: "0" * 16, 2: str(int(NOW) + 10**6), 3: "lora_adapter,other", 4: "0" * 32}[field]
    with pytest.raises(TenantAuthError) as refused:
        trust.tenant_of({"tenant_token": s(":".join(parts))}, own_sample=False, now=NOW)
    assert str(refused.value).endswith(BAD_TOKEN)


def test_a_token_expires_after_its_ttl(files):
    keys, secret, *_ = files
    first = TenantTrust.from_files(secret, keys, model="tokenizer_cache", token_ttl_s=30)
    later = TenantTrust.from_files(secret, keys, model="embedding_cache")
    token = {"tenant_token": s(first.token("acme", now=NOW))}
    assert later.tenant_of(token, own_sample=False, now=NOW + 29) == "acme"
    for when in (NOW + 30, NOW + 10**6):
        with pytest.raises(TenantAuthError, match=BAD_TOKEN):
            later.tenant_of(token, own_sample=False, now=when)
    assert TenantTrust().token_ttl_s == DEFAULT_TOKEN_TTL_S == 60
    with pytest.raises(ConfigError, match="tenant_token_ttl_s must lie in"):
        TenantTrust.from_files(secret, keys, token_ttl_s=0)


def test_a_token_is_only_for_the_models_it_names(files):
    keys, secret, *_ = files
    hashes = read_key_hashes(keys)
    only_embedding = sign_token(secret.read_bytes().strip(), "acme", hashes["acme"], expires=int(NOW) + 60,
                                audience=("embedding_cache",))
    inputs = {"tenant_token": s(only_embedding)}
    assert TenantTrust.from_files(secret, keys, model="embedding_cache").tenant_of(inputs, False, now=NOW) == "acme"
    with pytest.raises(TenantAuthError, match=BAD_TOKEN):
        TenantTrust.from_files(secret, keys, model="lora_adapter").tenant_of(inputs, False, now=NOW)


def test_rotating_a_key_or_removing_a_tenant_ends_its_tokens_without_a_restart(files):
    import json

    keys, secret, acme, globex = files
    first = TenantTrust.from_files(secret, keys, model="tokenizer_cache")
    later = TenantTrust.from_files(secret, keys, model="lora_adapter")
    old = {"tenant_token": s(first.token("acme", now=NOW))}
    assert later.tenant_of(old, own_sample=False, now=NOW) == "acme"

    new_key = add_tenant_key(keys, secret, "acme")  # rotated in the file; both objects keep running
    with pytest.raises(TenantAuthError, match=BAD_TOKEN):
        later.tenant_of(old, own_sample=False, now=NOW)
    with pytest.raises(TenantAuthError, match="not authenticated"):
        first.verify_key("acme", acme)
    first.verify_key("acme", new_key)
    assert later.tenant_of({"tenant_token": s(first.token("acme", now=NOW))}, False, now=NOW) == "acme"

    globex_token = {"tenant_token": s(first.token("globex", now=NOW))}
    assert later.tenant_of(globex_token, False, now=NOW) == "globex"
    data = json.loads(keys.read_text())
    del data["tenants"]["globex"]
    keys.write_text(json.dumps(data))  # the tenant removed, the file rewritten in place
    with pytest.raises(TenantAuthError, match=BAD_TOKEN):
        later.tenant_of(globex_token, False, now=NOW)


def test_the_keys_file_is_parsed_once_per_change_and_bounded(files, monkeypatch, caplog):
    import warmup_tools.triton.trust as trust_module

    keys, secret, acme, _ = files
    trust = TenantTrust.from_files(secret, keys)
    reads = []
    real = trust_module.read_key_hashes
    monkeypatch.setattr(trust_module, "read_key_hashes", lambda path: reads.append(path) or real(path))
    for _ in range(100):
        trust.verify_key("acme", acme)
    assert reads == []  # unchanged: only its stat key was looked at
    add_tenant_key(keys, secret, "initech")
    reads.clear()  # (the CLI's own read)
    for _ in range(100):
        trust.verify_key("acme", acme)
    assert reads == [keys]

    # A keys file past the bound is refused at start, and authenticates no one once it grows so later.
    keys.write_text('{"tenants": {}, "pad": "' + "x" * (1 << 20) + '"}')
    with pytest.raises(TenantAuthError):
        trust.verify_key("acme", acme)
    assert "larger than 1048576 bytes" in caplog.text
    with pytest.raises(ConfigError, match="larger than 1048576 bytes"):
        TenantTrust.from_files(secret, keys)


def test_another_deployment_s_token_is_refused(files, tmp_path):
    keys, secret, *_ = files
    other_secret = tmp_path / "other"
    add_tenant_key(tmp_path / "other-keys.json", other_secret, "acme")
    token = sign_token(other_secret.read_bytes().strip(), "acme", read_key_hashes(keys)["acme"],
                       expires=int(NOW) + 60)
    with pytest.raises(TenantAuthError, match="token is not valid"):
        TenantTrust.from_files(secret, keys, model="lora_adapter").tenant_of({"tenant_token": s(token)}, False,
                                                                             now=NOW)


def test_open_mode_takes_tenant_id_and_half_configured_trust_is_refused(files):
    keys, secret, *_ = files
    assert TenantTrust.from_parameters(params()).first_step_tenant({"tenant_id": s("x")}, False) == "x"
    assert TenantTrust().tenant_of({"tenant_id": s("x")}, own_sample=False) == "x"
    with pytest.raises(ConfigError, match="needs deployment_secret_file"):
        TenantTrust.from_parameters(params(tenant_keys_file=keys))
    with pytest.raises(ConfigError, match="needs tenant_keys_file"):
        TenantTrust.from_parameters(params(deployment_secret_file=secret))
    short = secret.parent / "short"
    short.write_text("abc")
    with pytest.raises(ConfigError, match="too short"):
        TenantTrust.from_files(short)


def test_the_cli_adds_a_key_and_prints_it_once(tmp_path, capsys):
    keys, secret = tmp_path / "k.json", tmp_path / "s"
    assert main(["tenant-key", "acme", "--keys-file", str(keys), "--secret-file", str(secret)]) == 0
    key = capsys.readouterr().out.strip()
    TenantTrust.from_files(secret, keys).verify_key("acme", key)
    assert main(["tenant-key", "bad name", "--keys-file", str(keys), "--secret-file", str(secret)]) == 2


def test_a_warm_up_sample_s_token_is_unsigned_and_refused_downstream(files):
    keys, secret, *_ = files
    trust = TenantTrust.from_files(secret, keys, model="lora_adapter")
    unsigned = trust.token("acme", now=NOW, verified=False)
    assert unsigned == "acme:"
    with pytest.raises(TenantAuthError, match="this deployment verifies tenants"):
        trust.tenant_of({"tenant_token": s(unsigned)}, own_sample=False, now=NOW)


# ------------------------------------------------------------------------------------ the probe tenant
def test_in_open_mode_a_client_cannot_name_the_probe_tenant(files):
    from warmup_tools.common.records import PROBE_TENANT

    probe = "a-per-start-probe-secret-0123456789"
    claim = {"tenant_id": s(PROBE_TENANT)}
    with pytest.raises(TenantAuthError, match="reserved for the sidecar's readiness probes"):
        TenantTrust().first_step_tenant(claim, own_sample=False)  # no sidecar: no one is the probe tenant
    from warmup_tools.triton.trust import probe_secret_token

    for first, later in ((TenantTrust(), TenantTrust(model="lora_adapter")),
                         (TenantTrust.from_files(None, probe_secret=probe),
                          TenantTrust.from_files(None, model="lora_adapter", probe_secret=probe))):
        for inputs in (claim, {**claim, "tenant_key": s("guess")}):
            with pytest.raises(TenantAuthError, match="reserved for the sidecar's readiness probes"):
                first.first_step_tenant(inputs, own_sample=False)
        forged = sign_token(b"", PROBE_TENANT, b"\0" * 32, expires=int(NOW) + 60)
        for inputs in (claim, {**claim, "tenant_token": s(forged)}, {**claim, "tenant_token": s(PROBE_TENANT + ":")}):
            with pytest.raises(TenantAuthError, match="reserved for the sidecar's readiness probes"):
                later.tenant_of(inputs, own_sample=False, now=NOW)
        # Every other tenant is still the tenant_id a client sends (open mode).
        assert first.first_step_tenant({"tenant_id": s("acme")}, False) == "acme"
        assert later.tenant_of({"tenant_id": s("acme")}, False, now=NOW) == "acme"

    # The sidecar holds the per-start secret: its key and its tokens prove the probe tenant.
    first.first_step_tenant({**claim, "tenant_key": s(probe)}, own_sample=False)
    for token in (first.token(PROBE_TENANT, now=NOW), probe_secret_token(probe, now=NOW)):
        assert later.tenant_of({**claim, "tenant_token": s(token)}, False, now=NOW) == PROBE_TENANT
    with pytest.raises(TenantAuthError):
        later.tenant_of({**claim, "tenant_token": s(probe_secret_token(probe, now=NOW - 61))}, False, now=NOW)
    assert first.token("acme", now=NOW) == "acme:"  # open mode signs nothing else


def test_a_bearer_key_names_its_tenant_and_nothing_else_does(tmp_path):
    from warmup_tools.triton.trust import TenantKeys, add_tenant_key

    keys_file, secret = tmp_path / "keys.json", tmp_path / "secret"
    acme = add_tenant_key(keys_file, secret, "acme")
    globex = add_tenant_key(keys_file, secret, "globex")
    keys = TenantKeys(keys_file)
    assert keys.tenant_for_key(acme) == "acme" and keys.tenant_for_key(globex) == "globex"
    for wrong in ("", acme[:-1], acme + "x", "acme", "k" * 300, globex.upper()):
        assert keys.tenant_for_key(wrong) is None, wrong
    rotated = add_tenant_key(keys_file, secret, "acme")
    assert keys.tenant_for_key(acme) is None and keys.tenant_for_key(rotated) == "acme"


def test_a_bearer_key_of_up_to_256_bytes_is_looked_up_and_a_longer_one_never(tmp_path):
    import hashlib
    import json

    from warmup_tools.triton.trust import TenantKeys

    keys_file = tmp_path / "keys.json"
    hashes = {"longest": "k" * 256, "too-long": "k" * 257}
    keys_file.write_text(json.dumps({"tenants": {t: "sha256:" + hashlib.sha256(k.encode()).hexdigest()
                                                 for t, k in hashes.items()}}))
    keys = TenantKeys(keys_file)
    assert keys.tenant_for_key("k" * 256) == "longest" and keys.tenant_for_key("k" * 257) is None
