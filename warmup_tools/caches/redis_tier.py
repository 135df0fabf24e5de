"""An optional shared cache tier on Redis, behind the in-process tokenizer and embedding caches.

Every Triton model instance is its own process and every replica its own machine, so the local
:class:`~warmup_tools.caches.store.LocalCache` of one never sees what another computed or what warm-up filled.
:class:`~warmup_tools.caches.tiered.TieredCache` looks in the local cache first, then in Redis
(:class:`SharedTier`), then computes, and writes what it computed to both.

The shared tier is an optimisation, never a dependency:

- every Redis call is bounded by ``timeout_ms`` (socket timeouts, no client-side retries) and never
  raises; a failure reads as a miss (``get``) or a dropped write (``put``);
- after a failure a circuit breaker marks the tier down for ``retry_after_s``: calls are skipped
  without touching the network, then one probe call goes through and a success closes the circuit;
- a value is stored as one envelope (magic, version, MAC, length, payload) in one ``SET``, so a
  reader sees the old value, the new value or nothing, and a truncated or foreign value is a miss;
- the MAC (blake2b-128) covers the Redis key and the payload, keyed by a per-deployment key in trust mode
  (derived from the deployment secret): a value copied under another key (another tenant's), or written
  by anyone without the key, is a miss. Decoded arrays are checked too (:func:`checked_decoder`);
- the URL carries the password and TLS (``rediss://:password@host:6380/0``); it is never logged;
- one instance opens at most ``max_connections`` to Redis; a call that finds them all busy for
  ``pool_timeout_ms`` is a miss (and leaves the circuit closed).

Under the load a warm-up makes (many keys written at once, so they would all expire at once a TTL later
and every instance of every replica would recompute them at the same moment):

- each key's TTL is ``ttl_s`` spread by ``ttl_jitter`` (a factor taken from the key's name), so they
  expire over a window instead of together;
- a miss is computed once across instances (:meth:`SharedTier.lock_or_wait`): the first instance takes
  the key's lock (redis-py's ``Lock``: ``SET NX PX`` with a token, released by compare-and-delete) and
  computes; the others poll for its value for at most ``lock_wait_ms``, then compute it themselves, so a
  lock holder that died costs a request at most that long.

Every setting comes from :class:`~warmup_tools.caches.settings.SharedTierSettings`.

Keys carry the cache kind, the tokenizer or embedding-model fingerprint, a hash of the tenant and the
text digest, so neither two tenants nor two models ever share an entry, in either tier.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import hashlib
import hmac
import logging
import struct
import threading
import time
from typing import TYPE_CHECKING, Callable, TypeVar
from urllib.parse import urlsplit, urlunsplit

from warmup_tools.caches.settings import SharedTierSettings
from warmup_tools.common.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np


LOGGER = logging.getLogger(__name__)

V = TypeVar("V")


#: First bytes of every value this module writes; anything else under our keys is foreign.
MAGIC = b"WTC"


#: Envelope format version; a reader treats any other version as a miss (2: a keyed MAC over key and payload).
FORMAT_VERSION = 2


#: The text digest must be at least this long (blake2b-128 in :func:`warmup_tools.common.digests.text_digest`).
MIN_DIGEST_BYTES = 16


# magic (3) | version (1) | blake2b-128 MAC of the key and payload (16) | payload length, uint32 LE (4)
_HEADER = struct.Struct("<3sB16sI")


_CHECKSUM_BYTES = 16


_MAX_PAYLOAD_BYTES = (1 << 32) - 1


_ARRAY_HEADER = struct.Struct("<BB")  # dtype-string length, ndim


_ARRAY_DIM = struct.Struct("<Q")


#: The name every connection of the tier gives itself (``CLIENT LIST`` shows who holds what).
CLIENT_NAME = "warmup-tools-cache"


#: Get latencies kept for :meth:`TierStats.p50` / :meth:`TierStats.p99`.
LATENCY_SAMPLES = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class TierKey:
    """Where one cached value lives in the shared tier."""

    kind: str  # which cache: "tok" (token ids) or "emb" (embeddings)
    tenant: str
    fingerprint: str  # tokenizer or embedding-model fingerprint
    digest: bytes  # content digest of the text

    def __post_init__(self) -> None:
        check_key_part("kind", self.kind)
        check_key_part("fingerprint", self.fingerprint)
        if not isinstance(self.digest, bytes) or len(self.digest) < MIN_DIGEST_BYTES:
            raise ValueError(f"digest must be at least {MIN_DIGEST_BYTES} bytes")

    def redis_key(self, namespace: str) -> str:
        """``{namespace}:{kind}:{fingerprint}:{tenant hash}:{digest hex}``.

        NOTE: the tenant goes in hashed, so any tenant string (colons, spaces, unicode) is a safe,
        fixed-length key part; kind and fingerprint are checked to hold no ``:``, so no two distinct
        keys can spell the same string.
        """
        return f"{namespace}:{self.kind}:{self.fingerprint}:{tenant_hash(self.tenant)}:{self.digest.hex()}"


@functools.lru_cache(maxsize=4096)
def tenant_hash(tenant: str) -> str:
    """The tenant's key part: 16 hex digits of sha256 (stable across processes and restarts)."""
    return hashlib.sha256(tenant.encode("utf-8")).hexdigest()[:16]


def _mac(payload: bytes, mac_key: bytes, bound_to: bytes) -> bytes:
    h = hashlib.blake2b(key=mac_key[:64], digest_size=_CHECKSUM_BYTES)
    h.update(len(bound_to).to_bytes(4, "little") + bound_to)
    h.update(payload)
    return h.digest()


def encode_value(payload: bytes, *, mac_key: bytes = b"", bound_to: bytes = b"") -> bytes:
    """Wrap ``payload`` in the envelope: magic, version, MAC (of ``bound_to`` and the payload, keyed by
    ``mac_key``), length, payload."""
    if len(payload) > _MAX_PAYLOAD_BYTES:
        raise ValueError(f"payload of {len(payload)} bytes does not fit the envelope")
    return _HEADER.pack(MAGIC, FORMAT_VERSION, _mac(payload, mac_key, bound_to), len(payload)) + bytes(payload)


def decode_value(blob: bytes, *, mac_key: bytes = b"", bound_to: bytes = b"") -> bytes | None:
    """The payload of an envelope, or None for anything else (never raises).

    A wrong magic or version, a length that disagrees with the blob (truncated or padded) or a MAC
    mismatch (another key, another ``bound_to``, a flipped byte) all read as a miss: a partial, moved or
    foreign value is never returned.
    """
    if not isinstance(blob, (bytes, bytearray, memoryview)) or len(blob) < _HEADER.size:
        return None
    magic, version, checksum, length = _HEADER.unpack_from(blob)
    if magic != MAGIC or version != FORMAT_VERSION or length != len(blob) - _HEADER.size:
        return None
    payload = bytes(blob[_HEADER.size :])
    if not hmac.compare_digest(_mac(payload, mac_key, bound_to), checksum):
        return None
    return payload


def encode_array(a: np.ndarray) -> bytes:
    """A numpy array as bytes: dtype string, shape, raw C-order data (see :func:`decode_array`)."""
    import numpy as np  # only the array codecs need numpy

    a = np.asarray(a)
    if a.dtype.hasobject:
        raise ValueError("arrays of Python objects cannot be stored in the shared tier")
    dtype = a.dtype.str.encode("ascii")  # carries the byte order, e.g. "<i4"
    dims = b"".join(_ARRAY_DIM.pack(d) for d in a.shape)
    return _ARRAY_HEADER.pack(len(dtype), a.ndim) + dtype + dims + a.tobytes(order="C")


def decode_array(b: bytes) -> np.ndarray:
    """The array written by :func:`encode_array`, read-only; ValueError if ``b`` is not one."""
    import numpy as np

    try:
        dtype_len, ndim = _ARRAY_HEADER.unpack_from(b)
        offset = _ARRAY_HEADER.size
        dtype = np.dtype(bytes(b[offset : offset + dtype_len]).decode("ascii"))
        offset += dtype_len
        shape = tuple(_ARRAY_DIM.unpack_from(b, offset + i * _ARRAY_DIM.size)[0] for i in range(ndim))
        offset += ndim * _ARRAY_DIM.size
    except (struct.error, TypeError, UnicodeDecodeError) as exc:
        raise ValueError(f"not an encoded array: {exc}") from exc
    if dtype.hasobject:
        raise ValueError("encoded array has an object dtype")
    count = 1
    for d in shape:
        count *= d
    if count * dtype.itemsize != len(b) - offset:
        raise ValueError(
            f"encoded array data is {len(b) - offset} bytes, shape {shape} of {dtype} needs "
            f"{count * dtype.itemsize}"
        )
    # NOTE: frombuffer over immutable bytes gives a read-only array; cached arrays are shared by
    # every request that hits them, so nobody may modify one in place.
    return np.frombuffer(bytes(b), dtype=dtype, count=count, offset=offset).reshape(shape)


@dataclasses.dataclass(slots=True)
class TierStats:
    """What the shared tier did; read by metrics and tests."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0  # values present but not a valid envelope (read as misses)
    errors: int = 0  # get calls that failed or timed out
    skipped: int = 0  # get/put calls not sent because the tier was marked down
    puts: int = 0
    put_errors: int = 0
    pool_exhausted: int = 0  # calls that found every connection busy for pool_timeout_ms (also errors)
    locks: int = 0  # misses this instance computed under the key's lock
    lock_busy: int = 0  # misses that found another instance computing the value
    lock_waited: int = 0  # ... and got it from the tier while waiting
    lock_timeouts: int = 0  # ... and computed it themselves after lock_wait_ms
    lock_lost: int = 0  # locks that expired (lock_ms) before their holder released them
    get_latency_s: collections.deque[float] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=LATENCY_SAMPLES)
    )

    def latency_quantile(self, q: float) -> float:
        """The ``q`` quantile (0..1) of recent get latencies in seconds; 0.0 before any get."""
        samples = sorted(self.get_latency_s)
        if not samples:
            return 0.0
        return samples[min(len(samples) - 1, int(q * len(samples)))]

    def p50(self) -> float:
        return self.latency_quantile(0.50)

    def p99(self) -> float:
        return self.latency_quantile(0.99)


class LockState(enum.Enum):
    """What :meth:`SharedTier.try_lock` found."""

    HELD = "held"  # this caller holds the lock: it computes the value
    BUSY = "busy"  # another instance holds it: that one is computing the value
    UNAVAILABLE = "unavailable"  # the tier is down, closed or out of connections: compute without the lock


class SharedTier:
    """Redis behind the local caches. Every call is bounded by timeout_ms and never raises."""

    def __init__(
        self,
        settings: SharedTierSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        mac_key: bytes = b"",
        salt: str = "",
    ) -> None:
        try:
            import redis  # optional: only a configured shared tier needs it
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise ConfigError("a shared cache tier needs the redis package: pip install 'redis>=5'") from exc

        self.settings = settings
        self.namespace = settings.namespace
        self._mac_key = mac_key
        self._salt = salt.encode("utf-8")
        self.timeout_s = settings.timeout_ms / 1000.0
        self.retry_after_s = settings.retry_after_s
        self._clock = clock
        self._sleep = sleep
        self.where = _redact(settings.url)  # for logs: the URL without its password
        self.stats = TierStats()
        # NOTE: redis-py >= 6 retries timeouts and connection errors by default (10 times, with
        # backoff up to 1 s), which would turn a 20 ms bound into seconds: one attempt, no retries.
        # ``retry_on_timeout=False`` alone no longer does this (deprecated, and the default Retry
        # still applies). driver_info=None skips the two CLIENT SETINFO round trips on each connect.
        # The blocking pool holds at most max_connections and a call waits pool_timeout_ms for one
        # (redis-py's default pool opens a connection per concurrent call, without a bound).
        # from_url does not connect: a server that starts while Redis is down still starts.
        try:
            pool = redis.BlockingConnectionPool.from_url(
                settings.url,
                max_connections=settings.max_connections,
                timeout=settings.pool_timeout_ms / 1000.0,
                socket_timeout=self.timeout_s,
                socket_connect_timeout=self.timeout_s,
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
                driver_info=None,
                client_name=CLIENT_NAME,
            )
        except ValueError as exc:
            raise ConfigError(f"shared tier URL {self.where!r} is not usable: {exc}") from exc
        self._client = redis.Redis.from_pool(pool)
        self._lock = threading.Lock()
        self._down_until: float | None = None  # None: circuit closed
        self._probing = False  # half-open: one call is testing whether Redis is back
        self._closed = False

    def redis_key(self, key: TierKey) -> str:
        """The Redis key of ``key``. With a salt (trust mode) the tenant and text digest are keyed hashes,
        so someone who can read Redis cannot test whether a tenant or a known prompt is cached."""
        if not self._salt:
            return key.redis_key(self.namespace)
        tenant = hmac.new(self._salt, b"tenant:" + key.tenant.encode("utf-8"), hashlib.sha256).hexdigest()[:16]
        digest = hmac.new(self._salt, b"text:" + key.digest, hashlib.sha256).hexdigest()[:32]
        return f"{self.namespace}:{key.kind}:{key.fingerprint}:{tenant}:{digest}"

    def ttl_ms(self, redis_key: str) -> int | None:
        """The TTL a value under ``redis_key`` gets: ``ttl_s`` spread by ``ttl_jitter``; None: no expiry.

        NOTE: the factor comes from the key's name, so every instance that writes a key gives it the same
        TTL and a run is reproducible, while the keys one warm-up wrote in the same second expire over
        a window of 2 * ttl_jitter * ttl_s instead of in the same second, a TTL later.
        """
        if not self.settings.ttl_s:
            return None
        ttl_ms = self.settings.ttl_s * 1000.0
        if self.settings.ttl_jitter:
            u = int.from_bytes(hashlib.blake2b(redis_key.encode(), digest_size=8, person=b"wt-ttl").digest(),
                               "little") / 2.0**64
            ttl_ms *= 1.0 + self.settings.ttl_jitter * (2.0 * u - 1.0)
        return max(1, round(ttl_ms))

    def get(self, key: TierKey) -> bytes | None:
        """The payload stored under ``key``, or None on a miss, a corrupt value or any failure."""
        if not self._admit():
            return None
        name = self.redis_key(key)
        start = time.perf_counter()
        ok, blob = self._call(self._client.get, name)
        self.stats.get_latency_s.append(time.perf_counter() - start)
        if not ok:
            self.stats.errors += 1
            return None
        if blob is None:
            self.stats.misses += 1
            return None
        payload = decode_value(blob, mac_key=self._mac_key, bound_to=name.encode())
        if payload is None:
            self.stats.corrupt += 1
            return None
        self.stats.hits += 1
        return payload

    def put(self, key: TierKey, payload: bytes) -> bool:
        """Store ``payload`` under ``key`` (with its TTL); False if it was not (certainly) stored.

        NOTE: the whole envelope goes in one SET, which Redis applies atomically, so a concurrent
        reader sees the old value, the new one or nothing. A write that times out may still land;
        that is harmless because values are a pure function of their key.
        """
        name = self.redis_key(key)
        try:
            blob = encode_value(payload, mac_key=self._mac_key, bound_to=name.encode())
        except ValueError:
            self.stats.put_errors += 1
            LOGGER.debug("value for %s too large for the shared tier", key.kind, exc_info=True)
            return False
        if not self._admit():
            return False
        ok, _ = self._call(self._client.set, name, blob, px=self.ttl_ms(name))
        if not ok:
            self.stats.put_errors += 1
            return False
        self.stats.puts += 1
        return True

    # -- one computation per key across instances -----------------------------------------------------

    def lock_or_wait(self, key: TierKey, poll: Callable[[], V | None]) -> tuple[object | None, V | None]:
        """Single flight for a miss of ``key``; ``poll`` reads the value from this tier (None: not there).

        - ``(lease, None)``: this caller holds the key's lock and computes the value; it puts the value,
          then passes the lease to :meth:`unlock`;
        - ``(None, value)``: another instance computed it and ``poll`` found it;
        - ``(None, None)``: compute without the lock: single flight is off, the tier is unavailable, or
          the holder did not publish the value within ``lock_wait_ms`` (it may have died: its lock
          expires by itself after ``lock_ms``, and no request waits for it longer than ``lock_wait_ms``).
        """
        if not self.settings.single_flight:
            return None, None
        deadline = self._clock() + self.settings.lock_wait_ms / 1000.0
        poll_s = self.settings.lock_poll_ms / 1000.0
        waited = False
        while True:
            state, lease = self.try_lock(key)
            if state is LockState.HELD:
                # NOTE: the value may have landed between the caller's miss and the lock (its holder
                # put it and unlocked): look once more, or this instance would compute it a second time.
                value = poll()
                if value is None:
                    return lease, None
                self.unlock(lease)
                return None, value
            if state is LockState.UNAVAILABLE:
                return None, None
            if not waited:
                self.stats.lock_busy += 1
                waited = True
            now = self._clock()
            if now >= deadline:
                self.stats.lock_timeouts += 1
                return None, None
            self._sleep(min(poll_s, deadline - now))
            value = poll()
            if value is not None:
                self.stats.lock_waited += 1
                return None, value

    def try_lock(self, key: TierKey) -> tuple[LockState, object | None]:
        """Take ``key``'s lock without waiting: ``(HELD, lease)``, ``(BUSY, None)`` or ``(UNAVAILABLE, None)``.

        The lock is redis-py's :class:`redis.lock.Lock`: ``SET name token NX PX lock_ms`` with a random
        token, released by a Lua compare-and-delete, so a holder whose lock expired never frees the lock
        another instance took since.
        """
        if not self._admit():
            return LockState.UNAVAILABLE, None
        lock = self._client.lock(f"{self.redis_key(key)}:lock", timeout=self.settings.lock_ms / 1000.0,
                                 blocking=False, thread_local=False)
        ok, held = self._call(lock.acquire, blocking=False)
        if not ok:
            self.stats.errors += 1
            return LockState.UNAVAILABLE, None
        if not held:
            return LockState.BUSY, None
        self.stats.locks += 1
        return LockState.HELD, lock

    def unlock(self, lease: object) -> None:
        """Release a lock :meth:`try_lock` took; one that expired meanwhile is counted, never raised."""
        from redis.exceptions import LockNotOwnedError

        try:
            lease.release()  # type: ignore[attr-defined]
        except LockNotOwnedError:
            self.stats.lock_lost += 1  # it expired (lock_ms) before the value was ready
        except Exception as exc:  # noqa: BLE001  (the lock expires by itself after lock_ms)
            self.stats.errors += 1
            self._on_error(exc)

    @property
    def available(self) -> bool:
        """False while the tier is marked down, until a call succeeds again (and after close)."""
        return self._down_until is None and not self._closed

    def close(self) -> None:
        """Drop the connections; later calls return None / False without touching the network."""
        self._closed = True
        try:
            self._client.close()
        except Exception:
            LOGGER.debug("closing the shared cache tier at %s failed", self.where, exc_info=True)

    # -- circuit breaker ----------------------------------------------------------------------------

    def _call(self, fn: Callable[..., object], *args: object, **kwargs: object) -> tuple[bool, object]:
        """``(True, fn's result)``, or ``(False, None)`` after any failure (never raises)."""
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001  (never raise: a failure is a miss or a dropped write)
            self._on_error(exc)
            return False, None
        self._succeeded()
        return True, result

    def _on_error(self, exc: Exception) -> None:
        if _pool_exhausted(exc):
            # NOTE: every connection is busy in this process: Redis itself may be fine, so the call is a
            # miss but the circuit stays closed.
            self.stats.pool_exhausted += 1
            LOGGER.debug("shared cache tier at %s: no free connection within the pool timeout", self.where)
            return
        self._failed(exc)

    def _admit(self) -> bool:
        """Whether this call may go to Redis: yes when closed; one probe at a time once retry_after_s passed."""
        if self._closed:
            return False
        if self._down_until is None:
            return True
        with self._lock:
            if self._down_until is None:
                return True
            if self._probing or self._clock() < self._down_until:
                self.stats.skipped += 1
                return False
            self._probing = True
            return True

    def _succeeded(self) -> None:
        if self._down_until is None:
            return
        with self._lock:
            if self._down_until is not None:
                self._down_until = None
                self._probing = False
                LOGGER.info("shared cache tier at %s is reachable again", self.where)

    def _failed(self, exc: Exception) -> None:
        with self._lock:
            was_up = self._down_until is None
            self._down_until = self._clock() + self.retry_after_s
            self._probing = False
        if was_up:
            LOGGER.warning(
                "shared cache tier at %s failed (%s: %s); serving from the local tier and computing, "
                "retrying every %.1fs",
                self.where, type(exc).__name__, exc, self.retry_after_s,
            )
        else:
            LOGGER.debug("shared cache tier at %s still down: %s", self.where, exc)


def _pool_exhausted(exc: Exception) -> bool:
    """Whether ``exc`` is redis-py's blocking pool finding no free connection within its timeout.

    NOTE: redis-py raises a plain ConnectionError with this message (redis/connection.py,
    BlockingConnectionPool.get_connection); test_pool_is_bounded_and_a_full_pool_is_a_miss pins it.
    """
    import redis

    return isinstance(exc, redis.ConnectionError) and str(exc) == "No connection available."


def check_key_part(name: str, value: str) -> None:
    """A key component must be non-empty and free of the ':' separator."""
    if not isinstance(value, str) or not value or ":" in value:
        raise ValueError(f"{name} {value!r} must be a non-empty string without ':'")


def _redact(url: str) -> str:
    """``url`` without a password, for logs and error messages."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
        user = f"{parts.username}:***@" if parts.username else ":***@"
        return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))
    except ValueError:
        return "<unparsable redis URL>"


def checked_decoder(dtype: str, *, length: int | None = None, max_length: int | None = None,
                    finite: bool = False) -> Callable[[bytes], np.ndarray]:
    """A :func:`decode_array` that also refuses any array but a 1-D one of ``dtype`` (exactly ``length``
    or at most ``max_length`` long, all finite with ``finite``): a value from the shared tier is not
    trusted to be what this model wrote (another version, another model, or someone with Redis access)."""

    def decode(b: bytes) -> np.ndarray:
        import numpy as np

        array = decode_array(b)
        if array.dtype != np.dtype(dtype) or array.ndim != 1:
            raise ValueError(f"expected a 1-D {dtype} array, got {array.ndim}-D {array.dtype}")
        n = array.shape[0]
        if (length is not None and n != length) or (max_length is not None and n > max_length):
            raise ValueError(f"array of {array.shape[0]} values; expected {length or f'at most {max_length}'}")
        if finite and not np.isfinite(array).all():
            raise ValueError("array holds values that are not finite")
        return array

    return decode
