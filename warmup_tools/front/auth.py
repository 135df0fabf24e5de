"""Who a request is for: the tenant, from the bearer key (trust mode) or a header or ``user`` (open mode).

Trust mode reuses the composing models' keys file (:class:`~warmup_tools.triton.trust.TenantKeys`, hashes
only): the front finds the tenant whose key the bearer key is and sends both on, and ``tokenizer_cache``
checks the key again. A missing, malformed or unknown key gets one and the same 401, whether or not the
tenant exists. Open mode takes any ``Authorization`` (as vLLM without an API key does) and the tenant from
``X-Tenant-Id`` or ``user``. A key never reaches a log or an error message.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from warmup_tools.front.errors import bad_request, unauthorized
from warmup_tools.triton.inputs import IDENTITY_PATTERN, MAX_IDENTITY_BYTES
from warmup_tools.triton.trust import TenantKeys

TENANT_HEADER = "x-tenant-id"


@dataclasses.dataclass(frozen=True, slots=True)
class Caller:
    tenant: str | None
    #: Trust mode: the bearer key, handed to tokenizer_cache as tenant_key.
    key: str | None = dataclasses.field(default=None, repr=False)


class TenantResolver:
    def __init__(self, keys_file: Path | None) -> None:
        self._keys = TenantKeys(keys_file) if keys_file is not None else None

    @property
    def trusted(self) -> bool:
        return self._keys is not None

    def resolve(self, authorization: str | None, tenant_header: str | None, user: str | None) -> Caller:
        if self._keys is not None:
            key = _bearer(authorization)
            tenant = self._keys.tenant_for_key(key) if key else None
            if tenant is None:
                raise unauthorized()
            return Caller(tenant, key)
        if tenant_header is not None:
            return Caller(_identity(tenant_header, "X-Tenant-Id header"))
        if user:
            return Caller(_identity(user, "user"))
        return Caller(None)


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    return key.strip() or None if scheme.lower() == "bearer" else None


def _identity(value: str, where: str) -> str:
    if len(value.encode("utf-8")) > MAX_IDENTITY_BYTES or not IDENTITY_PATTERN.fullmatch(value):
        raise bad_request(f"the {where} names the tenant in open mode: use 1 to {MAX_IDENTITY_BYTES} letters, "
                          "digits, '.', '_' or '-', starting with a letter or digit",
                          param="user" if where == "user" else None, code="invalid_tenant")
    return value
