"""An optional shared cache tier on Redis, behind the in-process tokenizer and embedding caches.

Every Triton model instance is its own process and every replica its own machine, so the local
:class:`~warmup_tools.caches.policies.LRUCache` of one never sees what another computed or what warm-up filled.
:class:`~warmup_tools.caches.tiered.TieredCache` looks in the local cache first, then in Redis
(:class:`SharedTier`), then
computes, and writes what it computed to both.

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
- the URL carries the password and TLS (``rediss://:password@host:6380/0``); it is never logged.

Keys carry the cache kind, the tokenizer or embedding-model fingerprint, a hash of the tenant and the
text digest, so neither two tenants nor two models ever share an entry, in either tier.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import hmac
import logging
import struct
import threading
import time
from typing import TYPE_CHECKING, Callable
from urllib.parse import urlsplit, urlunsplit

from warmup_tools.common.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np


LOGGER = logging.getLogger(__name__)


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


class SharedTier:
    """Redis behind the local caches. Every call is bounded by timeout_ms and never raises."""

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "wt",
        timeout_ms: float = 20.0,
        retry_after_s: float = 2.0,
        ttl_s: float | None = 86400,
        clock: Callable[[], float] = time.monotonic,
        mac_key: bytes = b"",
        salt: str = "",
    ) -> None:
        if not namespace or ":" in namespace:
            raise ConfigError(f"shared tier namespace {namespace!r} must be non-empty and hold no ':'")
        if timeout_ms <= 0:
            raise ConfigError(f"shared tier timeout_ms must be > 0, got {timeout_ms}")
        if retry_after_s < 0:
            raise ConfigError(f"shared tier retry_after_s must be >= 0, got {retry_after_s}")
        if ttl_s is not None and ttl_s <= 0:
            raise ConfigError(f"shared tier ttl_s must be > 0 or None, got {ttl_s}")
        try:
            import redis  # optional: only a configured shared tier needs it
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise ConfigError("a shared cache tier needs the redis package: pip install 'redis>=5'") from exc

        self.namespace = namespace
        self._mac_key = mac_key
        self._salt = salt.encode("utf-8")
        self.timeout_s = timeout_ms / 1000.0
        self.retry_after_s = retry_after_s
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._clock = clock
        self.where = _redact(url)  # for logs: the URL without its password
        self.stats = TierStats()
        # NOTE: redis-py >= 6 retries timeouts and connection errors by default (10 times, with
        # backoff up to 1 s), which would turn a 20 ms bound into seconds: one attempt, no retries.
        # ``retry_on_timeout=False`` alone no longer does this (deprecated, and the default Retry
        # still applies). driver_info=None skips the two CLIENT SETINFO round trips on each connect.
        # from_url does not connect: a server that starts while Redis is down still starts.
        try:
            self._client = redis.Redis.from_url(
                url,
                socket_timeout=self.timeout_s,
                socket_connect_timeout=self.timeout_s,
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
                driver_info=None,
            )
        except ValueError as exc:
            raise ConfigError(f"shared tier URL {self.where!r} is not usable: {exc}") from exc
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

    def get(self, key: TierKey) -> bytes | None:
        """The payload stored under ``key``, or None on a miss, a corrupt value or any failure."""
        if not self._admit():
            return None
        start = time.perf_counter()
        try:
            blob = self._client.get(self.redis_key(key))
        except Exception as exc:  # noqa: BLE001  (never raise: any failure is a miss)
            self.stats.get_latency_s.append(time.perf_counter() - start)
            self.stats.errors += 1
            self._failed(exc)
            return None
        self.stats.get_latency_s.append(time.perf_counter() - start)
        self._succeeded()
        if blob is None:
            self.stats.misses += 1
            return None
        payload = decode_value(blob, mac_key=self._mac_key, bound_to=self.redis_key(key).encode())
        if payload is None:
            self.stats.corrupt += 1
            return None
        self.stats.hits += 1
        return payload

    def put(self, key: TierKey, payload: bytes) -> bool:
        """Store ``payload`` under ``key`` (with the TTL); False if it was not (certainly) stored.

        NOTE: the whole envelope goes in one SET, which Redis applies atomically, so a concurrent
        reader sees the old value, the new one or nothing. A write that times out may still land;
        that is harmless because values are a pure function of their key.
        """
        try:
            blob = encode_value(payload, mac_key=self._mac_key, bound_to=self.redis_key(key).encode())
        except ValueError:
            self.stats.put_errors += 1
            LOGGER.debug("value for %s too large for the shared tier", key.kind, exc_info=True)
            return False
        if not self._admit():
            return False
        try:
            self._client.set(self.redis_key(key), blob, px=self._ttl_ms)
        except Exception as exc:  # noqa: BLE001  (best effort: the local tier already has the value)
            self.stats.put_errors += 1
            self._failed(exc)
            return False
        self._succeeded()
        self.stats.puts += 1
        return True

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
