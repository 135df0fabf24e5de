"""Tenant identity a client cannot forge: the trust mode.

**Open mode** (the default, no ``deployment_secret_file``): the tenant is the ``tenant_id`` a client
sends. Isolation between tenants then holds only behind a gateway that sets ``tenant_id`` itself and
lets no client reach Triton directly (see SECURITY.md). One name is reserved even there:
:data:`~warmup_tools.common.records.PROBE_TENANT`, the sidecar's readiness probes, which stay out of the
request log and the heat statistics. It is proven like a trust-mode tenant, with a per-start probe secret
the sidecar hands the tritonserver it starts (``probe_secret``, from ``WARMUP_PROBE_SECRET``), so a client
that names it is refused instead of dropping out of the statistics.

**Trust mode** (``deployment_secret_file`` and ``tenant_keys_file`` set on the three composing models):
the first step, ``tokenizer_cache``, verifies the client's ``tenant_key`` against ``tenant_keys_file``
(it holds only SHA-256 hashes of the keys) and hands the later steps a **tenant token**.
``embedding_cache`` and ``lora_adapter`` take the tenant only from a valid token, so a client that calls
them directly cannot choose a tenant either. The models' own warm-up samples, while the model loads
(:mod:`warmup_tools.triton.warmup`), name their tenant in ``tenant_id``, as the operator wrote them.

A token is ``<tenant>:<key version>:<expires>:<audience>:<mac>``: the tenant; a digest of the tenant's
key hash as the keys file holds it now (:func:`key_version`), so rotating the key or removing the
tenant ends every token made before; the Unix second it expires (``tenant_token_ttl_s`` after it was
made, :data:`DEFAULT_TOKEN_TTL_S`); the models it is for (:data:`LATER_STEPS`), and an HMAC over all of
them under the deployment secret. ``:`` and ``,`` are not allowed in a name, so the split is unambiguous.
Every step checks against the keys file as it is now (:class:`TenantKeys` re-reads it when it changes).
Tokens never leave the ensemble (it does not output them), though ``tokenizer_cache`` called directly
hands one to a client that proved its key: that client's own tenant, for at most the TTL.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import re
import secrets
import threading
import time
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from warmup_tools.common.errors import ConfigError, InvalidInputError
from warmup_tools.common.files import stat_key, write_atomic
from warmup_tools.common.records import PROBE_TENANT
from warmup_tools.common.settings import check_settings, read_settings, setting
from warmup_tools.common.wire import ErrorKind
from warmup_tools.triton.inputs import check_identity, parse_identity, parse_optional_string
from warmup_tools.triton.params import ModelParameters

LOGGER = logging.getLogger(__name__)

#: The message for any failed tenant check: the same whether the tenant is unknown or the key is wrong.
_NOT_AUTHENTICATED = ("tenant {tenant!r} is not authenticated on this deployment: send its tenant_key (ask your "
                      "operator for one)")
_NO_TOKEN = ("this deployment verifies tenants: send requests to the 'ensemble' model with tenant_id and "
             "tenant_key")
#: The same for a forged, expired, stale (key rotated, tenant removed) or wrong-audience token.
_BAD_TOKEN = ("this deployment verifies tenants: the tenant token is not valid; send requests to the 'ensemble' "
              "model with tenant_id and tenant_key")
_RESERVED = ("input 'tenant_id' names the tenant reserved for the sidecar's readiness probes: send another "
             "tenant_id")
_MAC_BYTES = 16
_VERSION_BYTES = 8
#: How long a token made by the first step stays valid, in seconds: long enough for the later steps of
#: one ensemble request to start (queueing included), short enough that a token taken away is soon useless.
DEFAULT_TOKEN_TTL_S = 60.0
MAX_TOKEN_TTL_S = 3600.0
#: The models a first-step token is for: the later steps of the ensemble.
LATER_STEPS: tuple[str, ...] = ("embedding_cache", "lora_adapter")
#: The largest tenant keys file read (about 10,000 tenants); a larger one is refused.
MAX_KEYS_FILE_BYTES = 1 << 20
_MAX_TOKEN_BYTES = 256
_MAX_KEY_BYTES = 256
#: A key hash as the keys file holds it.
_KEY_HASH = re.compile(r"sha256:([0-9a-fA-F]{64})")


class TenantAuthError(InvalidInputError):
    """A request's tenant could not be verified (a missing or wrong key, or a forged or stale token); a request
    that names the probes' reserved tenant is ``INVALID``."""

    kind = ErrorKind.UNAUTHENTICATED


def key_version(key_hash: bytes) -> str:
    """The short digest of a tenant's key hash a token carries: it changes when the key does."""
    return hashlib.sha256(b"key-version:" + key_hash).digest()[:_VERSION_BYTES].hex()


def sign_token(signing_key: bytes, tenant: str, key_hash: bytes, *, expires: int,
               audience: Sequence[str] = LATER_STEPS) -> str:
    """A token for ``tenant`` (whose key hash is ``key_hash``), valid until ``expires`` for ``audience``."""
    payload = f"{tenant}:{key_version(key_hash)}:{int(expires)}:{','.join(audience)}"
    return f"{payload}:{_mac(signing_key, payload).hex()}"


def probe_token(secret: bytes, tenant: str, key: str, *, now: float, ttl_s: float = DEFAULT_TOKEN_TTL_S,
                audience: Sequence[str] = LATER_STEPS) -> str:
    """The sidecar's token for its probe tenant, made from the tenant's key (the keys file holds its hash)
    and the deployment secret; the sidecar makes a new one before each probe."""
    return sign_token(secret, tenant, _hash_key(key), expires=int(now + ttl_s), audience=audience)


def probe_secret_token(probe_secret: str, *, now: float, ttl_s: float = DEFAULT_TOKEN_TTL_S) -> str:
    """Open mode: the sidecar's probe token, made from the per-start probe secret."""
    return sign_token(_probe_signing_key(probe_secret.encode("utf-8")), PROBE_TENANT, _hash_key(probe_secret),
                      expires=int(now + ttl_s))


class TenantKeys:
    """The tenant keys file as it is now: its stat key (inode, size, mtime) is checked on every use and
    the file re-read, at most :data:`MAX_KEYS_FILE_BYTES`, only when that changed (parsed once per change).

    A file that becomes unreadable or malformed after the start authenticates no one until it is fixed
    (logged once per change): a rotation that half failed must not leave the old keys valid.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._key = stat_key(self.path)
        self._hashes = read_key_hashes(self.path)  # strict at start: a bad file fails the load

    def current(self) -> Mapping[str, bytes]:
        key = stat_key(self.path)
        with self._lock:
            if key != self._key:
                self._key = key  # NOTE: stat before read: a file replaced meanwhile is read again next time
                try:
                    self._hashes = read_key_hashes(self.path)
                except ConfigError as exc:
                    LOGGER.error("%s; no tenant is authenticated until it is fixed", exc)
                    self._hashes = {}
            return self._hashes

    def tenant_for_key(self, key: str) -> str | None:
        """The tenant whose key ``key`` is, or None: what an HTTP front learns from a bearer key alone.

        NOTE: every stored hash is compared, in constant time, whether or not one matched before, so the time
        taken says nothing about which tenants exist or where a key's tenant sits in the file. An empty key
        or one over the size limit matches no tenant."""
        found = None
        given = _hash_key(key) if key and len(key.encode("utf-8")) <= _MAX_KEY_BYTES else b"\0" * 33
        for tenant, expected in self.current().items():
            if hmac.compare_digest(given, expected):
                found = tenant
        return found


@dataclasses.dataclass(frozen=True, slots=True)
class TrustSettings:
    """The trust parameters, the same on every composing model (both files empty: open mode)."""

    deployment_secret_file: Path | None = setting(None, "Trust mode: the deployment secret (64 hex digits, 0600) "
                                                        "tenant tokens, derived keys and the cache salt come from; "
                                                        "empty: open mode.")
    tenant_keys_file: Path | None = setting(None, "Trust mode: the hashed tenant keys (tokens are checked against "
                                                  "the file as it is now); needs deployment_secret_file.")
    token_ttl_s: float = setting(DEFAULT_TOKEN_TTL_S, "Seconds a tenant token made by the first step stays valid.",
                                 parameter="tenant_token_ttl_s", ge=1, le=MAX_TOKEN_TTL_S)
    probe_secret: str = setting("", "The sidecar's per-start probe secret (WARMUP_PROBE_SECRET; at least 16 "
                                    "characters), the only proof of the probe tenant; empty: no probe tenant.")

    def __post_init__(self) -> None:
        check_settings(self)


@dataclasses.dataclass(frozen=True, slots=True)
class TenantTrust:
    """What one model checks tenant identity with; ``secret`` None is open mode."""

    secret: bytes | None = None
    #: The tenant keys file (trust mode).
    keys: TenantKeys | None = None
    #: This model's name: a token must name it in its audience.
    model: str = ""
    #: How long the tokens this model makes are valid (the first step makes them).
    token_ttl_s: float = DEFAULT_TOKEN_TTL_S
    #: Open mode: the sidecar's per-start probe secret, the only proof of :data:`PROBE_TENANT`.
    probe_secret: bytes | None = None

    @property
    def trusted(self) -> bool:
        return self.secret is not None

    @classmethod
    def from_parameters(cls, params: ModelParameters) -> TenantTrust:
        """From a model's trust parameters (:class:`TrustSettings`)."""
        return cls.from_settings(read_settings(TrustSettings, params), model=params.model_name)

    @classmethod
    def from_settings(cls, settings: TrustSettings, *, model: str) -> TenantTrust:
        return cls.from_files(settings.deployment_secret_file, settings.tenant_keys_file, model=model,
                              token_ttl_s=settings.token_ttl_s, probe_secret=settings.probe_secret or None)

    @classmethod
    def from_files(cls, secret_file: Path | None, keys_file: Path | None = None, *, model: str = "?",
                   token_ttl_s: float = DEFAULT_TOKEN_TTL_S, probe_secret: str | None = None) -> TenantTrust:
        if not 1.0 <= token_ttl_s <= MAX_TOKEN_TTL_S:
            raise ConfigError(f"model '{model}': tenant_token_ttl_s must lie in [1, {MAX_TOKEN_TTL_S:g}] seconds")
        probe = probe_secret.encode("utf-8") if probe_secret else None
        if probe is not None and len(probe) < 16:
            raise ConfigError(f"model '{model}': probe_secret is too short: use at least 16 random characters")
        if secret_file is None:
            if keys_file is not None:
                raise ConfigError(f"model '{model}': tenant_keys_file needs deployment_secret_file (trust mode); "
                                  "set both or neither")
            return cls(model=model, token_ttl_s=token_ttl_s, probe_secret=probe)
        secret = read_secret(secret_file)
        if keys_file is None:
            raise ConfigError(f"model '{model}': trust mode (deployment_secret_file) needs tenant_keys_file, the "
                              "hashed tenant keys")
        # NOTE: no probe_secret in trust mode: the probe tenant is a tenant of the keys file there.
        return cls(secret, TenantKeys(keys_file), model=model, token_ttl_s=token_ttl_s)

    # ----------------------------------------------------------------------------------- first step
    def verify_key(self, tenant: str, key: str | None) -> None:
        """Raise :class:`TenantAuthError` unless ``key`` is ``tenant``'s (constant time). No key (None or
        empty) proves no tenant, even one whose stored hash is that of the empty key."""
        expected = self._key_hashes().get(tenant)
        given = _hash_key(key or "")
        # NOTE: compare even for an unknown tenant or no key, so the time taken does not tell which tenants exist.
        matches = hmac.compare_digest(given, expected if expected is not None else b"\0" * 32)
        if not matches or expected is None or not key:
            if not self.trusted:
                raise TenantAuthError(_RESERVED, kind=ErrorKind.INVALID)
            raise TenantAuthError(_NOT_AUTHENTICATED.format(tenant=tenant))

    def token(self, tenant: str, *, now: float | None = None, verified: bool = True) -> str:
        """The token later steps take the tenant from, valid for ``token_ttl_s`` from ``now``. Signed only
        for a tenant whose key was verified: a warm-up sample (which needs no key) gets an unsigned one,
        which later steps refuse, so a sample never yields a usable token."""
        key_hash = self._key_hashes().get(tenant) if verified else None
        if key_hash is None or (not self.trusted and tenant != PROBE_TENANT):
            return f"{tenant}:"
        now = time.time() if now is None else now
        return sign_token(self._signing_key(), tenant, key_hash, expires=int(now + self.token_ttl_s))

    def first_step_tenant(self, inputs: Mapping[str, np.ndarray | None], own_sample: bool) -> str:
        """The tenant of a request to the first step: claimed in ``tenant_id``, proven by ``tenant_key``
        (in open mode only the probe tenant needs proof)."""
        tenant = parse_identity(inputs, "tenant_id", "default")
        if (self.trusted or tenant == PROBE_TENANT) and not own_sample:
            self.verify_key(tenant, parse_optional_string(inputs, "tenant_key", max_bytes=_MAX_KEY_BYTES))
        return tenant

    # ----------------------------------------------------------------------------------- later steps
    def tenant_of(self, inputs: Mapping[str, np.ndarray | None], own_sample: bool, *,
                  now: float | None = None) -> str:
        """The tenant of a request to a later step: an own sample, ``tenant_id``; open mode, ``tenant_id``
        (the probe tenant only with its token); trust mode, only from a valid ``tenant_token``."""
        if own_sample:
            return parse_identity(inputs, "tenant_id", "default")
        if not self.trusted:
            tenant = parse_identity(inputs, "tenant_id", "default")
            if tenant == PROBE_TENANT and self._token_tenant(inputs, now) != PROBE_TENANT:
                raise TenantAuthError(_RESERVED, kind=ErrorKind.INVALID)
            return tenant
        tenant = self._token_tenant(inputs, now)
        if tenant is None:
            raise TenantAuthError(_BAD_TOKEN)
        return tenant

    def derived_key(self, purpose: bytes) -> bytes:
        """A key for ``purpose`` derived from the deployment secret; empty in open mode."""
        if self.secret is None:
            return b""
        return hmac.new(self.secret, b"derive:" + purpose, hashlib.sha256).digest()

    def cache_salt(self) -> str:
        """The per-deployment salt of every cache key (hex; empty in open mode)."""
        return self.derived_key(b"cache-salt").hex()[:32]

    # ----------------------------------------------------------------------------------- helpers
    def _key_hashes(self) -> Mapping[str, bytes]:
        if self.keys is not None:
            return self.keys.current()
        if self.probe_secret is not None:
            return {PROBE_TENANT: hashlib.sha256(self.probe_secret).digest()}
        return {}

    def _signing_key(self) -> bytes:
        if self.secret is not None:
            return self.secret
        return _probe_signing_key(self.probe_secret or b"")

    def _token_tenant(self, inputs: Mapping[str, np.ndarray | None], now: float | None) -> str | None:
        """The tenant of a valid ``tenant_token``; None for a forged, expired, stale or wrong-audience one;
        :class:`TenantAuthError` when there is none."""
        token = parse_optional_string(inputs, "tenant_token", max_bytes=_MAX_TOKEN_BYTES)
        parts = token.split(":")
        if len(parts) != 5 or not parts[0]:
            if self.trusted:
                raise TenantAuthError(_NO_TOKEN)
            return None
        tenant, version, expires, audience, mac = parts
        try:
            given = bytes.fromhex(mac)
        except ValueError:
            given = b""
        expected = _mac(self._signing_key(), ":".join(parts[:4]))
        key_hash = self._key_hashes().get(tenant)
        current = key_version(key_hash) if key_hash is not None else "-" * (2 * _VERSION_BYTES)
        now = time.time() if now is None else now
        # NOTE: every check runs, and the MAC and the key version are compared in constant time, so
        # neither the time taken nor the error says which part of a token was wrong.
        valid = hmac.compare_digest(given, expected)
        valid &= hmac.compare_digest(version.encode(), current.encode()) and key_hash is not None
        valid &= expires.isdigit() and len(expires) <= 12 and now < int(expires)
        valid &= self.model in audience.split(",")
        return tenant if valid else None


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
    """``{"tenants": {"acme": "sha256:<hex>", ...}}``: hashes only, never the keys (at most
    :data:`MAX_KEYS_FILE_BYTES`)."""
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_KEYS_FILE_BYTES + 1)
        if len(raw) > MAX_KEYS_FILE_BYTES:
            raise ValueError(f"larger than {MAX_KEYS_FILE_BYTES} bytes")
        data = json.loads(raw.decode("utf-8"))
        tenants = data["tenants"]
        out = {}
        for tenant, value in tenants.items():
            check_identity("tenant", tenant)
            match = _KEY_HASH.fullmatch(str(value))
            if match is None:
                raise ValueError(f"tenant {tenant!r}: expected 'sha256:<64 hex digits>'")
            out[tenant] = bytes.fromhex(match.group(1))
        return out
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError,
            InvalidInputError) as exc:
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
    tenants[tenant] = "sha256:" + _hash_key(key).hex()
    write_atomic(keys_file, json.dumps({"tenants": dict(sorted(tenants.items()))}, indent=2) + "\n", mode=0o600)
    return key


def _hash_key(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _probe_signing_key(probe_secret: bytes) -> bytes:
    return hmac.new(probe_secret, b"derive:probe-token", hashlib.sha256).digest()


def _mac(signing_key: bytes, payload: str) -> bytes:
    return hmac.new(signing_key, b"tenant-token:" + payload.encode("utf-8"), hashlib.sha256).digest()[:_MAC_BYTES]
