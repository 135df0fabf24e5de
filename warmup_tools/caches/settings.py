"""Every setting of the Redis shared tier, read once into one typed object.

``tokenizer_cache`` and ``embedding_cache`` read their ``redis_*`` parameters of ``config.pbtxt`` through
:meth:`SharedTierSettings.from_parameters`; benchmarks and tests build the object directly. The defaults
live here and nowhere else.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from warmup_tools.common.errors import ConfigError


class Parameters(Protocol):
    """What :meth:`SharedTierSettings.from_parameters` needs: :class:`warmup_tools.triton.params.ModelParameters`."""

    def get(self, name: str, cast: Any = str, default: Any = ...) -> Any: ...


@dataclasses.dataclass(frozen=True, slots=True)
class SharedTierSettings:
    """The shared tier's knobs (``redis_*`` parameters of the cache models)."""

    #: ``redis_url``: where Redis is (password and TLS in the URL); empty: no shared tier.
    url: str = ""
    #: Prefix of every key; holds no ``:``.
    namespace: str = "wt"
    #: ``redis_timeout_ms``: bound on one Redis call (connect, send, receive); no client-side retries.
    timeout_ms: float = 20.0
    #: ``redis_retry_after_s``: after a failure, calls skip Redis this long, then one probe goes through.
    retry_after_s: float = 2.0
    #: ``redis_ttl_s``: lifetime of a value; 0: values never expire.
    ttl_s: float = 86400.0
    #: ``redis_ttl_jitter``: each key's TTL is ``ttl_s`` times a factor in ``[1 - j, 1 + j]`` taken from its
    #: name (stable per key), so the values one warm-up wrote at once do not expire at once.
    ttl_jitter: float = 0.1
    #: ``redis_lock_wait_ms``: on a miss, one instance computes the value under a short Redis lock while the
    #: others wait for it at most this long, then compute it themselves; 0: no lock, every miss computes.
    lock_wait_ms: float = 100.0
    #: ``redis_lock_ms``: the lock's own lifetime, so a holder that died frees it after this long.
    lock_ms: float = 1000.0
    #: ``redis_lock_poll_ms``: how often a waiting instance looks for the value.
    lock_poll_ms: float = 2.0
    #: ``redis_max_connections``: connections one instance opens to Redis at most.
    max_connections: int = 4
    #: ``redis_pool_timeout_ms``: how long a call waits for a free connection before it reads as a miss.
    pool_timeout_ms: float = 20.0

    def __post_init__(self) -> None:
        if not self.namespace or ":" in self.namespace:
            raise ConfigError("shared tier namespace must be non-empty and hold no ':'")
        positive = {"redis_timeout_ms": self.timeout_ms, "redis_lock_ms": self.lock_ms,
                    "redis_lock_poll_ms": self.lock_poll_ms, "redis_pool_timeout_ms": self.pool_timeout_ms}
        for name, value in positive.items():
            if not value > 0:
                raise ConfigError(f"{name} must be > 0, got {value}")
        if not (self.retry_after_s >= 0 and self.ttl_s >= 0 and self.lock_wait_ms >= 0):
            raise ConfigError(f"redis_retry_after_s, redis_ttl_s and redis_lock_wait_ms must be >= 0, got "
                              f"{self.retry_after_s}, {self.ttl_s}, {self.lock_wait_ms}")
        if not 0.0 <= self.ttl_jitter < 1.0:
            raise ConfigError(f"redis_ttl_jitter must be in [0, 1), got {self.ttl_jitter}")
        if self.max_connections < 1:
            raise ConfigError(f"redis_max_connections must be >= 1, got {self.max_connections}")
        if self.lock_wait_ms and self.lock_ms < self.lock_wait_ms:
            # NOTE: a lock shorter than the wait would let a second instance compute while the first still is.
            raise ConfigError(f"redis_lock_ms ({self.lock_ms}) must be at least redis_lock_wait_ms "
                              f"({self.lock_wait_ms})")

    @classmethod
    def from_parameters(cls, params: Parameters) -> SharedTierSettings:
        """The settings a model's ``redis_*`` parameters give (each one optional)."""
        d = cls()
        return cls(
            url=params.get("redis_url", str, d.url),
            timeout_ms=params.get("redis_timeout_ms", float, d.timeout_ms),
            retry_after_s=params.get("redis_retry_after_s", float, d.retry_after_s),
            ttl_s=params.get("redis_ttl_s", float, d.ttl_s),
            ttl_jitter=params.get("redis_ttl_jitter", float, d.ttl_jitter),
            lock_wait_ms=params.get("redis_lock_wait_ms", float, d.lock_wait_ms),
            lock_ms=params.get("redis_lock_ms", float, d.lock_ms),
            lock_poll_ms=params.get("redis_lock_poll_ms", float, d.lock_poll_ms),
            max_connections=params.get("redis_max_connections", int, d.max_connections),
            pool_timeout_ms=params.get("redis_pool_timeout_ms", float, d.pool_timeout_ms),
        )

    @property
    def single_flight(self) -> bool:
        """Whether a miss is computed by one instance at a time (``lock_wait_ms`` > 0)."""
        return self.lock_wait_ms > 0
