"""The settings of the caches' tiers: the local caches' eviction and the Redis shared tier.

``tokenizer_cache`` and ``embedding_cache`` read their ``redis_*`` parameters of ``config.pbtxt`` into
:class:`SharedTierSettings` and their eviction knobs into
:class:`~warmup_tools.caches.policies.settings.EvictionSettings` (nested in their settings objects, declared beside
the policies they tune); each declares its own ``eviction`` (its default policy differs) with
:func:`eviction_setting`.
Benchmarks and tests build the objects directly. The defaults live here and nowhere else.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from warmup_tools.caches.policies import EVICTION_POLICIES
from warmup_tools.common.errors import ConfigError
from warmup_tools.common.settings import check_settings, setting


def eviction_setting(default: str) -> Any:
    """A cache model's ``eviction`` field: which local entry goes first, one of :data:`EVICTION_POLICIES`."""
    return setting(default, "Which entry of the local cache goes first when cache_bytes is full: lru (least "
                            "recently used), slru (segmented LRU: entries hit again are protected from a burst "
                            "of one-off prompts), decayed_lfu (least frequently used, counts fading over "
                            "lfu_half_life_s).", choices=tuple(EVICTION_POLICIES))


@dataclasses.dataclass(frozen=True, slots=True)
class SharedTierSettings:
    """The shared tier's knobs (``redis_*`` parameters of ``tokenizer_cache`` and ``embedding_cache``)."""

    url: str = setting("", "Where Redis is (password and TLS in the URL: redis://, rediss://); empty: no shared "
                           "tier, or the URL from redis_url_file.", parameter="redis_url")
    url_file: Path | None = setting(None, "A file holding the Redis URL (a mounted secret: the password stays out "
                                          "of the environment and the config); read when redis_url is empty.",
                                    parameter="redis_url_file")
    #: Open mode: the control folder, where the deployment's random Redis MAC key and key salt are kept.
    control_dir: Path | None = setting(None, "Open mode with a shared tier: the control folder, where the "
                                             "deployment's random Redis key salt is kept (required then).")
    namespace: str = setting("wt", "Prefix of every Redis key; holds no ':'.", parameter="")
    timeout_ms: float = setting(20.0, "Bound on one Redis call (connect, send, receive); no client-side retries.",
                                parameter="redis_timeout_ms", gt=0)
    retry_after_s: float = setting(2.0, "After a Redis failure, calls skip Redis this long, then one probe goes "
                                        "through.", parameter="redis_retry_after_s", ge=0)
    ttl_s: float = setting(86400.0, "Lifetime of a value in Redis; 0: values never expire.",
                           parameter="redis_ttl_s", ge=0)
    ttl_jitter: float = setting(0.1, "Each key's TTL is redis_ttl_s times a factor in [1 - j, 1 + j] taken from "
                                     "its name (stable per key), so the values one warm-up wrote at once do not "
                                     "expire at once.", parameter="redis_ttl_jitter", ge=0, lt=1)
    lock_wait_ms: float = setting(100.0, "On a miss, one instance computes the value under a short Redis lock "
                                         "while the others wait for it at most this long, then compute it "
                                         "themselves; 0: no lock, every miss computes.",
                                  parameter="redis_lock_wait_ms", ge=0)
    lock_ms: float = setting(1000.0, "The lock's own lifetime, so a holder that died frees it after this long; at "
                                     "least redis_lock_wait_ms.", parameter="redis_lock_ms", gt=0)
    lock_poll_ms: float = setting(2.0, "How often a waiting instance looks for the value.",
                                  parameter="redis_lock_poll_ms", gt=0)
    max_connections: int = setting(4, "Connections one instance opens to Redis at most.",
                                   parameter="redis_max_connections", ge=1, le=1024)
    pool_timeout_ms: float = setting(20.0, "How long a call waits for a free connection before it reads as a "
                                           "miss.", parameter="redis_pool_timeout_ms", gt=0)

    def __post_init__(self) -> None:
        check_settings(self)
        if not self.namespace or ":" in self.namespace:
            raise ConfigError("shared tier namespace must be non-empty and hold no ':'")
        if self.lock_wait_ms and self.lock_ms < self.lock_wait_ms:
            # NOTE: a lock shorter than the wait would let a second instance compute while the first still is.
            raise ConfigError(f"redis_lock_ms ({self.lock_ms}) must be at least redis_lock_wait_ms "
                              f"({self.lock_wait_ms})")

    @property
    def single_flight(self) -> bool:
        """Whether a miss is computed by one instance at a time (``lock_wait_ms`` > 0)."""
        return self.lock_wait_ms > 0
