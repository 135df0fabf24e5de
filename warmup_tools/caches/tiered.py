"""A local cache with an optional shared tier behind it: local first, then the shared tier, then compute.

Like LMCache's storage backends, the tiers share one small interface: a
:class:`~warmup_tools.caches.store.LocalCache` (any eviction policy) in front, a
:class:`~warmup_tools.caches.redis_tier.SharedTier` (or none) behind.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from typing import Callable, Generic, TypeVar

from warmup_tools.caches.redis_tier import MIN_DIGEST_BYTES, SharedTier, TierKey, check_key_part
from warmup_tools.caches.store import LocalCache

LOGGER = logging.getLogger(__name__)


class CacheSource(str, enum.Enum):
    """Where a cached value came from (a ``str``, so it is also the metric label and the JSON value)."""

    LOCAL = "local"
    SHARED = "shared"
    MISS = "miss"
    COMPUTED = "computed"
    #: Not computed on purpose (the embedding step samples its misses).
    SKIPPED = "skipped"
    #: A sampled miss computed off the request path, after the response (``embedding_cache``).
    DEFERRED = "deferred"


V = TypeVar("V")


@dataclasses.dataclass(slots=True)
class TieredStats:
    """Where :class:`TieredCache` answers came from."""

    local_hits: int = 0
    shared_hits: int = 0
    misses: int = 0  # neither tier had it (get_or_compute then computes)
    computed: int = 0
    undecodable: int = 0  # shared payloads the decode function rejected (read as misses)
    unencodable: int = 0  # values the encode function rejected (kept local only)


class TieredCache(Generic[V]):
    """A :class:`~warmup_tools.caches.store.LocalCache` with an optional SharedTier behind it."""

    def __init__(
        self,
        local: LocalCache,
        shared: SharedTier | None,
        *,
        kind: str,
        fingerprint: str,
        encode: Callable[[V], bytes],
        decode: Callable[[bytes], V],
    ) -> None:
        check_key_part("kind", kind)
        check_key_part("fingerprint", fingerprint)
        self.local = local
        self.shared = shared
        self.kind = kind
        self.fingerprint = fingerprint
        self._encode = encode
        self._decode = decode
        self.stats = TieredStats()

    def get(self, tenant: str, digest: bytes) -> tuple[V | None, str]:
        """``(value, LOCAL | SHARED | MISS)``; a shared hit is copied into the local tier."""
        local_key = self._local_key(tenant, digest)
        value = self.local.get(local_key)
        if value is not None:
            self.stats.local_hits += 1
            return value, CacheSource.LOCAL
        value = self._get_shared(tenant, digest, local_key)
        if value is not None:
            return value, CacheSource.SHARED
        self.stats.misses += 1
        return None, CacheSource.MISS

    def put(self, tenant: str, digest: bytes, value: V) -> None:
        """Store in the local tier, and in the shared tier when there is one (best effort)."""
        self.local.put(self._local_key(tenant, digest), value)
        if self.shared is None:
            return
        try:
            payload = self._encode(value)
        except Exception:
            self.stats.unencodable += 1
            LOGGER.debug("cannot encode a %s value for the shared tier", self.kind, exc_info=True)
            return
        self.shared.put(TierKey(self.kind, tenant, self.fingerprint, digest), payload)

    def get_or_compute(self, tenant: str, digest: bytes, compute: Callable[[], V]) -> tuple[V, str]:
        """``(value, LOCAL | SHARED | COMPUTED)``; a computed value is stored in both tiers.

        On a miss in both tiers, one instance computes the value under the key's lock in the shared tier
        while the others wait for it (at most the tier's ``lock_wait_ms``; see
        :meth:`~warmup_tools.caches.redis_tier.SharedTier.lock_or_wait`). Errors raised by ``compute``
        propagate: they belong to the request, not to the cache (the lock is released).
        """
        value, source = self.get(tenant, digest)
        if value is not None:
            return value, source
        lease = None
        if self.shared is not None:
            local_key = self._local_key(tenant, digest)
            lease, value = self.shared.lock_or_wait(TierKey(self.kind, tenant, self.fingerprint, digest),
                                                    lambda: self._get_shared(tenant, digest, local_key))
            if value is not None:
                return value, CacheSource.SHARED
        try:
            value = compute()
            self.stats.computed += 1
            self.put(tenant, digest, value)  # NOTE: before unlocking, so a waiter that sees the lock gone finds it
        finally:
            if lease is not None:
                self.shared.unlock(lease)
        return value, CacheSource.COMPUTED

    def _get_shared(self, tenant: str, digest: bytes, local_key: tuple[str, str, str, bytes]) -> V | None:
        """The shared tier's value, decoded and copied into the local tier; None on a miss."""
        if self.shared is None:
            return None
        payload = self.shared.get(TierKey(self.kind, tenant, self.fingerprint, digest))
        if payload is None:
            return None
        try:
            value = self._decode(payload)
        except Exception:
            self.stats.undecodable += 1
            LOGGER.debug("undecodable %s value in the shared tier", self.kind, exc_info=True)
            return None
        self.local.put(local_key, value)
        self.stats.shared_hits += 1
        return value

    def _local_key(self, tenant: str, digest: bytes) -> tuple[str, str, str, bytes]:
        # NOTE: the tenant is part of the local key too: tenants never share an entry in either tier.
        if not isinstance(digest, bytes) or len(digest) < MIN_DIGEST_BYTES:
            raise ValueError(f"digest must be at least {MIN_DIGEST_BYTES} bytes")
        return (self.kind, self.fingerprint, tenant, digest)

