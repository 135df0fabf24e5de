"""Tenant identity a client cannot forge: the trust mode.

**Open mode** (the default, no ``deployment_secret_file``): the tenant is the ``tenant_id`` a client
sends. Isolation between tenants then holds only behind a gateway that sets ``tenant_id`` itself and
lets no client reach Triton directly (see SECURITY.md).

**Trust mode** (``deployment_secret_file`` set on the three composing models): the first step,
``tokenizer_cache``, verifies the client's ``tenant_key`` against ``tenant_keys_file`` (it holds only
SHA-256 hashes of the keys) and hands the later steps a **tenant token**, the tenant's name with an
HMAC under the deployment secret. ``embedding_cache`` and ``lora_adapter`` take the tenant only from a
valid token, so a client that calls them directly cannot choose a tenant either: it has no token and
cannot make one. The models' own warm-up samples (recognised byte for byte,
:mod:`warmup_tools.triton.warmup`) name their tenant in ``tenant_id``, as the operator wrote them.

Tokens are ``<tenant>:<mac>``; ``:`` is not allowed in a tenant name, so the split is unambiguous. They
never leave the ensemble (it does not output them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Mapping

import numpy as np

from warmup_tools.common.errors import ConfigError, InvalidInputError
from warmup_tools.common.files import write_atomic
from warmup_tools.triton.inputs import MAX_IDENTITY_BYTES, check_identity, parse_identity, parse_optional_string
from warmup_tools.triton.params import ModelParameters

#: The message for any failed tenant check: the same whether the tenant is unknown or the key is wrong.
_NOT_AUTHENTICATED = ("tenant {tenant!r} is not authenticated on this deployment: send its tenant_key (ask your "
                      "operator for one)")
_MAC_BYTES = 16


class TenantAuthError(InvalidInputError):
    """A request's tenant could not be verified (a missing or wrong key, or a forged token)."""


@dataclasses.dataclass(frozen=True, slots=True)
class TenantTrust:
    """What one model checks tenant identity with; ``secret`` None is open mode."""

    secret: bytes | None = None
    #: tenant -> SHA-256 of its key (tokenizer_cache only).
    key_hashes: Mapping[str, bytes] = dataclasses.field(default_factory=dict)

    @property
    def trusted(self) -> bool:
        return self.secret is not None

    @classmethod
    def from_parameters(cls, params: ModelParameters, *, keys: bool = False) -> TenantTrust:
        """From ``deployment_secret_file`` (and, with ``keys``, ``tenant_keys_file``); empty is open mode."""
        secret = params.path("deployment_secret_file") if params.get("deployment_secret_file", str, "") else None
        keys_file = None
        if keys and params.get("tenant_keys_file", str, ""):
            keys_file = params.path("tenant_keys_file")
        return cls.from_files(secret, keys_file, model=params.model_name, keys=keys)

    @classmethod
    def from_files(cls, secret_file: Path | None, keys_file: Path | None = None, *, model: str = "?",
                   keys: bool = False) -> TenantTrust:
        if secret_file is None:
            if keys_file is not None:
                raise ConfigError(f"model '{model}': tenant_keys_file needs deployment_secret_file (trust mode); "
                                  "set both or neither")
            return cls()
        secret = read_secret(secret_file)
        if not keys:
            return cls(secret)
        if keys_file is None:
            raise ConfigError(f"model '{model}': trust mode (deployment_secret_file) needs tenant_keys_file, the "
                              "hashed tenant keys")
        return cls(secret, read_key_hashes(keys_file))

    # ----------------------------------------------------------------------------------- first step
    def verify_key(self, tenant: str, key: str | None) -> None:
        """Raise :class:`TenantAuthError` unless ``key`` is ``tenant``'s (constant time)."""
        expected = self.key_hashes.get(tenant)
        given = hashlib.sha256((key or "").encode("utf-8")).digest()
        # NOTE: compare even for an unknown tenant, so the time taken does not tell which tenants exist.
        if not hmac.compare_digest(given, expected if expected is not None else b"\0" * 32) or expected is None:
            raise TenantAuthError(_NOT_AUTHENTICATED.format(tenant=tenant))

    def token(self, tenant: str, *, verified: bool = True) -> str:
        """The token later steps take the tenant from. Signed only in trust mode and for a tenant whose key
        was verified: a warm-up sample (which needs no key) gets an unsigned one, which later steps refuse,
        so replaying a sample never yields a usable token."""
        return f"{tenant}:{self._mac(tenant).hex()}" if self.secret is not None and verified else f"{tenant}:"

    def first_step_tenant(self, inputs: Mapping[str, np.ndarray | None], own_sample: bool) -> str:
        """The tenant of a request to the first step: claimed in ``tenant_id``, proven by ``tenant_key``."""
        tenant = parse_identity(inputs, "tenant_id", "default")
        if self.trusted and not own_sample:
            self.verify_key(tenant, parse_optional_string(inputs, "tenant_key", "", 256) or None)
        return tenant

    # ----------------------------------------------------------------------------------- later steps
    def tenant_of(self, inputs: Mapping[str, np.ndarray | None], own_sample: bool) -> str:
        """The tenant of a request to a later step: open mode or an own sample, ``tenant_id``; trust mode,
        only from a valid ``tenant_token``."""
        if not self.trusted or own_sample:
            return parse_identity(inputs, "tenant_id", "default")
        token = parse_optional_string(inputs, "tenant_token", "", MAX_IDENTITY_BYTES + 2 * _MAC_BYTES + 1)
        tenant, sep, mac = token.rpartition(":")
        if not sep or not tenant:
            raise TenantAuthError("this deployment verifies tenants: send requests to the 'ensemble' model with "
                                  "tenant_id and tenant_key")
        check_identity("tenant_token", tenant)
        try:
            given = bytes.fromhex(mac)
        except ValueError:
            given = b""
        if not hmac.compare_digest(given, self._mac(tenant)):
            raise TenantAuthError("this deployment verifies tenants: the tenant token is not valid; send requests "
                                  "to the 'ensemble' model with tenant_id and tenant_key")
        return tenant

    def derived_key(self, purpose: bytes) -> bytes:
        """A key for ``purpose`` derived from the deployment secret; empty in open mode."""
        if self.secret is None:
            return b""
        return hmac.new(self.secret, b"derive:" + purpose, hashlib.sha256).digest()

    def cache_salt(self) -> str:
        """The per-deployment salt of every cache key (hex; empty in open mode)."""
        return self.derived_key(b"cache-salt").hex()[:32]

    def _mac(self, tenant: str) -> bytes:
        return hmac.new(self.secret or b"", b"tenant:" + tenant.encode("utf-8"), hashlib.sha256).digest()[:_MAC_BYTES]


# ------------------------------------------------------------------------------------------- files
def read_secret(path: Path) -> bytes:
    try:
        data = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"deployment secret {path} is not readable ({exc.strerror}); create it with "
                          "`python -m warmup_tools tenant-key --secret-file PATH ...`") from None
    if len(data) < 32:
        raise ConfigError(f"deployment secret {path} is too short: use at least 32 random bytes")
    return data


def read_key_hashes(path: Path) -> dict[str, bytes]:
    """``{"tenants": {"acme": "sha256:<hex>", ...}}``: hashes only, never the keys."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        tenants = data["tenants"]
        out = {}
        for tenant, value in tenants.items():
            check_identity("tenant", tenant)
            algorithm, _, digest = str(value).partition(":")
            if algorithm != "sha256" or len(digest) != 64:
                raise ValueError(f"tenant {tenant!r}: expected 'sha256:<64 hex digits>'")
            out[tenant] = bytes.fromhex(digest)
        return out
    except (OSError, ValueError, KeyError, TypeError, AttributeError, InvalidInputError) as exc:
        raise ConfigError(f"tenant keys file {path} is not usable ({exc}); write it with "
                          "`python -m warmup_tools tenant-key`") from None


def add_tenant_key(keys_file: Path, secret_file: Path, tenant: str) -> str:
    """Create the deployment secret if missing, give ``tenant`` a new random key, store only its hash
    (both files 0600); returns the key, which is shown once."""
    check_identity("tenant", tenant)
    secret_file, keys_file = Path(secret_file), Path(keys_file)
    if not secret_file.exists():
        write_atomic(secret_file, secrets.token_hex(32) + "\n", mode=0o600)
    tenants: dict[str, str] = {}
    if keys_file.exists():
        tenants = {t: "sha256:" + h.hex() for t, h in read_key_hashes(keys_file).items()}
    key = secrets.token_urlsafe(32)
    tenants[tenant] = "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()
    write_atomic(keys_file, json.dumps({"tenants": dict(sorted(tenants.items()))}, indent=2) + "\n", mode=0o600)
    os.chmod(keys_file, 0o600)
    return key
