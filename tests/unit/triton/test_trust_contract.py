"""The exact contract of trust mode: fixed known answers for tokens and derived keys, the bounds at their
boundary values, the files' layout and modes, and every error message an operator or client reads."""

from __future__ import annotations

import hashlib
import json
import re
import stat
import time

import numpy as np
import pytest

import warmup_tools.triton.trust as trust_module
from warmup_tools.common.errors import ConfigError, InvalidInputError
from warmup_tools.common.records import PROBE_TENANT
from warmup_tools.triton.params import ModelParameters
from warmup_tools.triton.trust import (
    MAX_KEYS_FILE_BYTES,
    TenantAuthError,
    TenantTrust,
    add_tenant_key,
    key_version,
    probe_secret_token,
    probe_token,
    read_key_hashes,
    read_secret,
    sign_token,
)

NOW = 1_800_000_000.0
SECRET = b"s" * 32
NO_TOKEN = ("this deployment verifies tenants: send requests to the 'ensemble' model with tenant_id and "
            "tenant_key")
BAD_TOKEN = ("this deployment verifies tenants: the tenant token is not valid; send requests to the 'ensemble' "
             "model with tenant_id and tenant_key")
RESERVED = "input 'tenant_id' names the tenant reserved for the sidecar's readiness probes: send another tenant_id"
BAD_NAME = ("is not a valid name: use 1 to 64 characters, letters, digits, '.', '_' and '-', starting with a letter "
            "or digit")


def s(value):
    return np.array([value.encode() if isinstance(value, str) else value], dtype=object)


def params(**values):
    return ModelParameters({"name": "m", "parameters": {k: {"string_value": str(v)} for k, v in values.items()}})


@pytest.fixture()
def deployment(tmp_path):
    keys, secret = tmp_path / "keys.json", tmp_path / "secret"
    secret.write_bytes(SECRET + b"\n")
    key = add_tenant_key(keys, secret, "acme")
    return keys, secret, key


def _keys_file(path, tenants):
    path.write_text(json.dumps({"tenants": tenants}))
    return path


# ------------------------------------------------------------------------------- known answers
def test_a_token_is_a_fixed_known_answer_for_a_fixed_secret():
    assert key_version(b"\1" * 32) == "972e10eedfb0d9c9"
    assert sign_token(SECRET, "acme", b"\1" * 32, expires=1_800_000_060) == (
        "acme:972e10eedfb0d9c9:1800000060:embedding_cache,lora_adapter:790dd4cb774f29e8776e8e46f9861462")
    # The sidecar's probe tokens: from the probe tenant's key (trust mode) or the per-start secret (open mode).
    assert probe_token(SECRET, "warmup-probe", "k" * 16, now=NOW) == (
        "warmup-probe:511a38d5da9b8761:1800000060:embedding_cache,lora_adapter:03308f0ef8bb5ff0ba0f220cbc704cea")
    assert probe_secret_token("p" * 16, now=NOW) == (
        f"{PROBE_TENANT}:f7b97be55ca53d9a:1800000060:embedding_cache,lora_adapter:c9622dcffc4ffebac6913fac0ad0362d")


def test_derived_keys_are_known_answers_distinct_per_purpose_and_empty_in_open_mode():
    trust = TenantTrust(secret=SECRET)
    salt = "2ff98dc1b23066c1f141172c9f43ab17b84f4989716a44c7c0e18b697fb0d0cd"
    assert trust.derived_key(b"cache-salt").hex() == salt
    assert trust.derived_key(b"other").hex() == "ab5712e82d4b0faaf2c6ddbff3f41d6990902fd6fd75d94da947564ef7312120"
    assert trust.cache_salt() == salt[:32]
    assert TenantTrust(secret=b"t" * 32).cache_salt() != trust.cache_salt()  # another deployment, another salt
    assert TenantTrust().derived_key(b"cache-salt") == b"" and TenantTrust().cache_salt() == ""
    probe_only = TenantTrust.from_files(None, probe_secret="p" * 16)  # open mode, even with a probe secret
    assert probe_only.derived_key(b"cache-salt") == b"" and probe_only.cache_salt() == ""


def test_probe_token_is_valid_for_its_ttl_and_audience_in_trust_mode(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    keys = _keys_file(tmp_path / "keys.json", {"warmup-probe": "sha256:" + hashlib.sha256(b"k" * 16).hexdigest()})
    later = TenantTrust.from_files(secret, keys, model="lora_adapter")
    token = {"tenant_token": s(probe_token(SECRET, "warmup-probe", "k" * 16, now=NOW, ttl_s=30))}
    assert later.tenant_of(token, False, now=NOW + 29) == "warmup-probe"
    with pytest.raises(TenantAuthError, match=re.escape(BAD_TOKEN)):
        later.tenant_of(token, False, now=NOW + 30)
    only = {"tenant_token": s(probe_token(SECRET, "warmup-probe", "k" * 16, now=NOW, audience=("embedding_cache",)))}
    with pytest.raises(TenantAuthError, match=re.escape(BAD_TOKEN)):
        later.tenant_of(only, False, now=NOW)


# ------------------------------------------------------------------------------- files
def test_add_tenant_key_writes_owner_only_files_of_a_fixed_layout(tmp_path):
    keys, secret = tmp_path / "keys.json", tmp_path / "secret"
    zeta = add_tenant_key(keys, secret, "zeta")
    acme = add_tenant_key(keys, secret, "acme")
    assert re.fullmatch(r"[0-9a-f]{64}\n", secret.read_text())  # 32 random bytes, hex, one line
    for key in (zeta, acme):
        assert re.fullmatch(r"[A-Za-z0-9_-]{43}", key)  # 32 random bytes, URL-safe base64
    digest = {name: hashlib.sha256(key.encode()).hexdigest() for name, key in (("acme", acme), ("zeta", zeta))}
    assert keys.read_text() == ('{\n  "tenants": {\n    "acme": "sha256:%s",\n    "zeta": "sha256:%s"\n  }\n}\n'
                                % (digest["acme"], digest["zeta"]))
    for path in (keys, secret):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    before = secret.read_bytes()
    add_tenant_key(keys, secret, "acme")  # an existing secret is kept
    assert secret.read_bytes() == before


def test_add_tenant_key_refuses_a_bad_tenant_name(tmp_path):
    with pytest.raises(InvalidInputError) as refused:
        add_tenant_key(tmp_path / "keys.json", tmp_path / "secret", "bad name")
    assert str(refused.value) == f"input 'tenant' {BAD_NAME}"
    assert not (tmp_path / "secret").exists()


def test_read_secret_messages_and_its_32_byte_bound(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(ConfigError) as refused:
        read_secret(missing)
    assert str(refused.value) == (f"deployment secret {missing} is not readable (No such file or directory); create "
                                  "it with `python -m warmup_tools tenant-key --secret-file PATH ...`")
    path = tmp_path / "secret"
    path.write_bytes(b"x" * 32 + b"\n")
    assert read_secret(path) == b"x" * 32  # exactly 32 bytes, the newline stripped
    path.write_bytes(b"x" * 31 + b"\n")
    with pytest.raises(ConfigError) as refused:
        read_secret(path)
    assert str(refused.value) == f"deployment secret {path} is too short: use at least 32 random bytes"


def test_read_key_hashes_refuses_a_malformed_entry_with_a_message_naming_the_tenant(tmp_path):
    good = hashlib.sha256(b"key").hexdigest()
    path = tmp_path / "keys.json"
    assert read_key_hashes(_keys_file(path, {"acme": "sha256:" + good.upper()})) == {"acme": bytes.fromhex(good)}
    # NOTE: "<62 hex digits>  " was read as a 31-byte hash no key matches (bytes.fromhex skips spaces), and a
    # non-hex digest was refused with a message that named no tenant.
    for value in ("sha1:" + good, "sha256:" + good[:63], "sha256:" + good + "0", "sha256:" + good[:62] + "  ",
                  "sha256:" + good[:62] + " 0",
                  "sha256:" + good[:30] + ":" + good[31:], "sha256:" + "g" * 64, "sha256:" + good + "\n", good, 1):
        _keys_file(path, {"acme": value})
        with pytest.raises(ConfigError) as refused:
            read_key_hashes(path)
        assert str(refused.value) == (f"tenant keys file {path} is not usable (tenant 'acme': expected "
                                      "'sha256:<64 hex digits>'); write it with `python -m warmup_tools tenant-key`")
    _keys_file(path, {"bad name": "sha256:" + good})
    with pytest.raises(ConfigError) as refused:
        read_key_hashes(path)
    assert str(refused.value) == (f"tenant keys file {path} is not usable (input 'tenant' {BAD_NAME}); write it "
                                  "with `python -m warmup_tools tenant-key`")


def test_the_keys_file_bound_is_exactly_1_mib(tmp_path):
    path = tmp_path / "keys.json"
    text = '{"tenants": {}, "pad": "'
    path.write_text(text + "x" * (MAX_KEYS_FILE_BYTES - len(text) - 2) + '"}')
    assert path.stat().st_size == MAX_KEYS_FILE_BYTES and read_key_hashes(path) == {}
    path.write_text(text + "x" * (MAX_KEYS_FILE_BYTES - len(text) - 1) + '"}')
    with pytest.raises(ConfigError, match=f"larger than {MAX_KEYS_FILE_BYTES} bytes"):
        read_key_hashes(path)


def test_an_endless_keys_file_is_read_only_up_to_its_bound(tmp_path, monkeypatch):
    """Bounded memory: of a file that never ends (a device, a pipe) at most the bound and one byte are read.
    The file is a stand-in here; the bound itself is checked on real files above."""
    asked = []

    class Endless:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self, size=-1):
            asked.append(size)
            if size is None or size < 0:
                raise AssertionError("the keys file was read without a bound")
            return b" " * size

    monkeypatch.setattr(trust_module, "open", lambda path, mode: Endless(), raising=False)
    with pytest.raises(ConfigError, match=f"larger than {MAX_KEYS_FILE_BYTES} bytes"):
        read_key_hashes(tmp_path / "endless")
    assert asked == [MAX_KEYS_FILE_BYTES + 1]


def test_a_keys_file_broken_after_the_start_is_logged_once_and_authenticates_no_one(deployment, caplog):
    keys, secret, key = deployment
    trust = TenantTrust.from_files(secret, keys)
    keys.write_text("not json")
    with pytest.raises(TenantAuthError):
        trust.verify_key("acme", key)
    [record] = [r for r in caplog.records if r.name == trust_module.__name__]
    assert record.levelname == "ERROR" and record.getMessage().startswith(f"tenant keys file {keys} is not usable (")
    assert record.getMessage().endswith("; write it with `python -m warmup_tools tenant-key`; no tenant is "
                                        "authenticated until it is fixed")


# ------------------------------------------------------------------------------- configuration
def test_the_configuration_errors_name_the_model_and_what_to_set(deployment):
    keys, secret, _ = deployment
    cases = [
        (dict(token_ttl_s=0), "model '?': tenant_token_ttl_s must lie in [1, 3600] seconds"),
        (dict(model="m", probe_secret="p" * 15),
         "model 'm': probe_secret is too short: use at least 16 random characters"),
        (dict(model="m", keys_file=keys),
         "model 'm': tenant_keys_file needs deployment_secret_file (trust mode); set both or neither"),
        (dict(model="m", secret_file=secret),
         "model 'm': trust mode (deployment_secret_file) needs tenant_keys_file, the hashed tenant keys"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError) as refused:
            TenantTrust.from_files(kwargs.pop("secret_file", None), **kwargs)
        assert str(refused.value) == message


@pytest.mark.parametrize(("ttl", "valid"), [(0.999, False), (1, True), (3600, True), (3600.001, False)])
def test_the_token_ttl_bounds_are_inclusive(deployment, ttl, valid):
    keys, secret, key = deployment
    for secret_file, keys_file in ((secret, keys), (None, None)):
        if not valid:
            with pytest.raises(ConfigError, match="tenant_token_ttl_s must lie in"):
                TenantTrust.from_files(secret_file, keys_file, token_ttl_s=ttl)
            continue
        trust = TenantTrust.from_files(secret_file, keys_file, token_ttl_s=ttl, probe_secret="p" * 16)
        tenant = "acme" if secret_file else PROBE_TENANT
        assert trust.token(tenant, now=NOW).split(":")[2] == str(int(NOW + ttl))


def test_the_probe_secret_is_at_least_16_characters():
    trust = TenantTrust.from_files(None, probe_secret="p" * 16)
    trust.verify_key(PROBE_TENANT, "p" * 16)
    with pytest.raises(ConfigError, match="probe_secret is too short"):
        TenantTrust.from_files(None, probe_secret="p" * 15)


def test_from_parameters_reads_the_model_name_ttl_and_probe_secret(deployment):
    keys, secret, key = deployment
    trusted = TenantTrust.from_parameters(params(deployment_secret_file=secret, tenant_keys_file=keys,
                                                 tenant_token_ttl_s=30))
    token = trusted.token("acme", now=NOW)
    assert token.split(":")[2] == str(int(NOW) + 30)
    # The model's own name ("m") is the audience it takes tokens for.
    mine = sign_token(SECRET, "acme", read_key_hashes(keys)["acme"], expires=int(NOW) + 60, audience=("m",))
    assert trusted.tenant_of({"tenant_token": s(mine)}, False, now=NOW) == "acme"
    with pytest.raises(ConfigError) as refused:
        TenantTrust.from_parameters(params(tenant_token_ttl_s=0))
    assert str(refused.value) == "model 'm': parameter tenant_token_ttl_s must be >= 1 and <= 3600, not 0.0"

    opened = TenantTrust.from_parameters(params(probe_secret="p" * 16))
    assert opened.first_step_tenant({"tenant_id": s(PROBE_TENANT), "tenant_key": s("p" * 16)}, False) == PROBE_TENANT
    with pytest.raises(TenantAuthError, match=re.escape(RESERVED)):
        TenantTrust.from_parameters(params()).first_step_tenant({"tenant_id": s(PROBE_TENANT),
                                                                  "tenant_key": s("p" * 16)}, False)


# ------------------------------------------------------------------------------- the first step
def test_a_missing_or_empty_key_proves_no_tenant_even_against_the_empty_key_s_hash(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    keys = _keys_file(tmp_path / "keys.json", {"acme": "sha256:" + hashlib.sha256(b"").hexdigest()})
    trust = TenantTrust.from_files(secret, keys)
    for claim in ({"tenant_id": s("acme")}, {"tenant_id": s("acme"), "tenant_key": s("")},
                  {"tenant_id": s("acme"), "tenant_key": s("  ")}):
        with pytest.raises(TenantAuthError):
            trust.first_step_tenant(claim, own_sample=False)
    for key in (None, ""):
        with pytest.raises(TenantAuthError):
            trust.verify_key("acme", key)


def test_the_first_step_s_messages_and_its_default_tenant(deployment):
    keys, secret, key = deployment
    trust = TenantTrust.from_files(secret, keys)
    with pytest.raises(TenantAuthError) as refused:
        trust.first_step_tenant({"tenant_id": s("acme"), "tenant_key": s("wrong")}, False)
    assert str(refused.value) == ("tenant 'acme' is not authenticated on this deployment: send its tenant_key (ask "
                                  "your operator for one)")
    with pytest.raises(TenantAuthError) as refused:
        TenantTrust().verify_key(PROBE_TENANT, "guess")
    assert str(refused.value) == RESERVED
    assert TenantTrust().first_step_tenant({}, own_sample=False) == "default"
    assert trust.first_step_tenant({}, own_sample=True) == "default"


def test_a_tenant_key_is_at_most_256_bytes(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    longest = "k" * 256
    keys = _keys_file(tmp_path / "keys.json", {"acme": "sha256:" + hashlib.sha256(longest.encode()).hexdigest()})
    trust = TenantTrust.from_files(secret, keys)
    assert trust.first_step_tenant({"tenant_id": s("acme"), "tenant_key": s(longest)}, False) == "acme"
    with pytest.raises(InvalidInputError) as refused:
        trust.first_step_tenant({"tenant_id": s("acme"), "tenant_key": s(longest + "k")}, False)
    assert type(refused.value) is InvalidInputError
    assert str(refused.value) == "input 'tenant_key' is longer than 256 bytes: send a shorter text"


# ------------------------------------------------------------------------------- later steps
def test_later_steps_take_an_own_sample_s_tenant_id_and_default_to_default(deployment):
    keys, secret, _ = deployment
    later = TenantTrust.from_files(secret, keys, model="lora_adapter")
    assert later.tenant_of({"tenant_id": s("acme")}, own_sample=True) == "acme"
    assert later.tenant_of({}, own_sample=True) == "default"
    with pytest.raises(InvalidInputError, match=re.escape(f"input 'tenant_id' {BAD_NAME}")):
        later.tenant_of({"tenant_id": s("bad name")}, own_sample=True)
    assert TenantTrust(model="lora_adapter").tenant_of({}, own_sample=False) == "default"


@pytest.mark.parametrize(("token", "message"), [
    ("", NO_TOKEN), ("acme:", NO_TOKEN), ("a:b:c:d", NO_TOKEN), ("a:b:c:d:e:f", NO_TOKEN),
    (":{version}:{expires}:lora_adapter:{mac}", NO_TOKEN),  # no tenant
    ("acme::{expires}:lora_adapter:{mac}", BAD_TOKEN),  # five fields, one empty: a wrong token
    ("acme:{version}:{expires}:lora_adapter:not-hex", BAD_TOKEN),
])
def test_a_missing_token_and_a_wrong_one_get_their_own_message(deployment, token, message):
    keys, secret, _ = deployment
    later = TenantTrust.from_files(secret, keys, model="lora_adapter")
    _, version, expires, _, mac = later.token("acme", now=NOW).split(":")
    inputs = {"tenant_token": s(token.format(version=version, expires=expires, mac=mac))} if token else {}
    with pytest.raises(TenantAuthError) as refused:
        later.tenant_of(inputs, own_sample=False, now=NOW)
    assert str(refused.value) == message


@pytest.mark.parametrize(("expires", "valid"), [(999_999_999_999, True), (1_000_000_000_000, False)])
def test_a_token_s_expiry_is_at_most_12_digits(deployment, expires, valid):
    keys, secret, _ = deployment
    later = TenantTrust.from_files(secret, keys, model="lora_adapter")
    token = {"tenant_token": s(sign_token(SECRET, "acme", read_key_hashes(keys)["acme"], expires=expires))}
    if valid:
        assert later.tenant_of(token, False, now=NOW) == "acme"
    else:
        with pytest.raises(TenantAuthError, match=re.escape(BAD_TOKEN)):
            later.tenant_of(token, False, now=NOW)


def test_a_token_is_at_most_256_bytes(deployment):
    keys, secret, _ = deployment
    later = TenantTrust.from_files(secret, keys, model="lora_adapter")
    for size in (256, 257):
        token = "acme:" + "0" * (size - 5)
        with pytest.raises(InvalidInputError) as refused:
            later.tenant_of({"tenant_token": s(token)}, False, now=NOW)
        if size == 256:
            assert str(refused.value) == NO_TOKEN  # read and found malformed
        else:
            assert type(refused.value) is InvalidInputError
            assert str(refused.value) == "input 'tenant_token' is longer than 256 bytes: send a shorter text"


def test_without_an_explicit_now_tokens_are_made_and_checked_against_the_clock(deployment):
    keys, secret, _ = deployment
    first = TenantTrust.from_files(secret, keys, model="tokenizer_cache")
    later = TenantTrust.from_files(secret, keys, model="lora_adapter")
    before = time.time()
    token = first.token("acme")
    after = time.time()
    assert int(before + 60) <= int(token.split(":")[2]) <= int(after + 60)
    hashes = read_key_hashes(keys)
    future = sign_token(SECRET, "acme", hashes["acme"], expires=999_999_999_999)
    assert later.tenant_of({"tenant_token": s(future)}, False) == "acme"
    past = sign_token(SECRET, "acme", hashes["acme"], expires=1)
    with pytest.raises(TenantAuthError, match=re.escape(BAD_TOKEN)):
        later.tenant_of({"tenant_token": s(past)}, False)
