"""The Redis shared tier, against a real redis-server started by the tests on a free port.

Without redis-server these tests fail (as the integration suite does): `make test` installs it.
"""

from __future__ import annotations

import collections
import logging
import threading

import numpy as np
import pytest

from tests.redis_support import REDIS_SERVER, RedisServer, free_port
from warmup_tools.caches.redis_tier import (
    CLIENT_NAME,
    LockState,
    SharedTier,
    TierKey,
    decode_array,
    decode_value,
    encode_array,
    encode_value,
)
from warmup_tools.caches.settings import SharedTierSettings
from warmup_tools.caches.store import LocalCache
from warmup_tools.caches.tiered import TieredCache
from warmup_tools.common.errors import ConfigError
from warmup_tools.sim.bench.stampede import largest_burst

pytestmark = pytest.mark.timeout(60)

RETRY_AFTER_S = 0.2


def digest(text: str) -> bytes:
    from warmup_tools.common.digests import text_digest

    return text_digest(text)


class FakeClock:
    """Injected time: ``sleep`` advances it, so waits and the circuit breaker run without real time."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def redis_server(tmp_path):
    if REDIS_SERVER is None:
        pytest.fail("redis-server is not on PATH: `make test` installs it (apt-get install redis-server)")
    server = RedisServer(free_port(), tmp_path)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def tiers():
    """SharedTier objects a test creates (``make(url, clock=..., **settings)``), closed afterwards."""
    made: list[SharedTier] = []

    def make(url: str, *, clock: FakeClock | None = None, sleep=None, mac_key: bytes = b"", salt: str = "",
             **settings) -> SharedTier:
        settings.setdefault("retry_after_s", RETRY_AFTER_S)
        timing = {} if clock is None else {"clock": clock, "sleep": sleep or clock.sleep}
        tier = SharedTier(SharedTierSettings(url=url, **settings), mac_key=mac_key, salt=salt, **timing)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def make_cache(tier: SharedTier | None, fingerprint: str = "fp-tok-1", local_bytes: int = 1 << 20
               ) -> TieredCache[np.ndarray]:
    return TieredCache(
        LocalCache(local_bytes, "lru"), tier, kind="tok", fingerprint=fingerprint, encode=encode_array,
        decode=decode_array
    )


# -- envelope and array codecs ---------------------------------------------------------------------


def test_envelope_round_trip():
    for payload in (b"", b"x", bytes(range(256)) * 100):
        assert decode_value(encode_value(payload)) == payload


def test_damaged_or_foreign_envelope_is_a_miss_never_an_exception():
    blob = encode_value(b"token ids go here")
    flipped = bytearray(blob)
    flipped[-1] ^= 0x01
    wrong_magic = b"XYZ" + blob[3:]
    wrong_version = blob[:3] + bytes([1]) + blob[4:]
    for bad in (bytes(flipped), blob[:-1], blob[:10], b"", wrong_magic, wrong_version, blob + b"\0", "text", None):
        assert decode_value(bad) is None


def test_a_keyed_envelope_is_bound_to_its_key_and_deployment():
    mac_key = b"k" * 32
    blob = encode_value(b"embedding", mac_key=mac_key, bound_to=b"wt:emb:fp:tenantA:digest")
    assert decode_value(blob, mac_key=mac_key, bound_to=b"wt:emb:fp:tenantA:digest") == b"embedding"
    assert decode_value(blob, mac_key=mac_key, bound_to=b"wt:emb:fp:tenantB:digest") is None  # moved
    assert decode_value(blob, mac_key=b"other" * 8, bound_to=b"wt:emb:fp:tenantA:digest") is None  # forged
    assert decode_value(blob, bound_to=b"wt:emb:fp:tenantA:digest") is None  # written with a key, read without


def test_array_round_trip_is_exact_and_read_only():
    arrays = [
        np.arange(7, dtype=np.int32),
        np.random.default_rng(0).standard_normal((3, 5)).astype(np.float16),
        np.arange(12, dtype=">i8").reshape(3, 4).T,  # big-endian, not contiguous
        np.zeros((0, 384), dtype=np.float32),
        np.float32(1.5).reshape(()),
    ]
    for a in arrays:
        b = decode_array(encode_array(a))
        assert b.dtype == a.dtype and b.shape == a.shape
        np.testing.assert_array_equal(b, a)
        assert not b.flags.writeable


def test_malformed_array_payload_raises_value_error():
    good = encode_array(np.arange(4, dtype=np.int32))
    for bad in (b"", good[:-1], good + b"\0", b"\x03\x01zzz" + b"\0" * 8):
        with pytest.raises(ValueError):
            decode_array(bad)


def test_keys_separate_tenants_and_fingerprints():
    d = digest("hello")
    base = TierKey("tok", "tenant-a", "fp1", d)
    assert base.redis_key("wt") == f"wt:tok:fp1:{base.redis_key('wt').split(':')[3]}:{d.hex()}"
    others = [
        TierKey("tok", "tenant-b", "fp1", d),
        TierKey("tok", "tenant-a", "fp2", d),
        TierKey("emb", "tenant-a", "fp1", d),
        TierKey("tok", "tenant-a", "fp1", digest("hello!")),
    ]
    keys = {k.redis_key("wt") for k in [base, *others]}
    assert len(keys) == 5
    # Any tenant string is safe: it goes in hashed, at a fixed length.
    odd = TierKey("tok", "a:b c/ü\n", "fp1", d).redis_key("wt")
    assert odd.count(":") == 4
    with pytest.raises(ValueError):
        TierKey("tok", "t", "fp:1", d)
    with pytest.raises(ValueError):
        TierKey("tok", "t", "fp1", b"short")


# -- against a real redis-server -------------------------------------------------------------------


def test_put_then_get_and_corrupt_values_read_as_misses(redis_server, tiers):
    tier = tiers(redis_server.url)
    key = TierKey("tok", "t1", "fp1", digest("prompt"))
    assert tier.get(key) is None and tier.stats.misses == 1
    assert tier.put(key, b"payload") is True
    assert tier.get(key) == b"payload" and tier.stats.hits == 1
    assert 0.9 * 86400 * 1000 - 60_000 < redis_server.admin().pttl(key.redis_key("wt")) <= 1.1 * 86400 * 1000

    admin = redis_server.admin()
    blob = admin.get(key.redis_key("wt"))
    flipped = bytearray(blob)
    flipped[-1] ^= 0x40
    for bad in (bytes(flipped), blob[:-3], b"NOT" + blob[3:], b"plain text from someone else"):
        admin.set(key.redis_key("wt"), bad)
        assert tier.get(key) is None
    assert tier.stats.corrupt == 4
    assert tier.available  # a bad value is not a bad server


def test_trust_mode_salts_keys_and_macs_values(redis_server, tiers):
    """A Redis reader cannot test for a tenant or a known prompt; a value moved or forged is a miss."""
    import hashlib

    salted = tiers(redis_server.url, salt="deployment-salt", mac_key=b"m" * 32)
    other = tiers(redis_server.url, salt="other-deployment", mac_key=b"n" * 32)
    key = TierKey("tok", "acme", "fp1", digest("a secret prompt"))
    assert salted.put(key, b"ids") is True and salted.get(key) == b"ids"
    stored = salted.redis_key(key)
    assert hashlib.sha256(b"acme").hexdigest()[:16] not in stored and key.digest.hex() not in stored
    assert redis_server.admin().get(key.redis_key("wt")) is None  # not under the unsalted name
    assert other.get(key) is None  # another deployment's salt and key
    admin = redis_server.admin()
    moved = TierKey("tok", "globex", "fp1", key.digest)
    admin.set(salted.redis_key(moved), admin.get(stored))  # copied under another tenant's key
    assert salted.get(moved) is None and salted.stats.corrupt == 1


def test_half_written_value_is_a_miss_and_gets_rewritten(redis_server, tiers):
    writer = make_cache(tiers(redis_server.url))
    reader_tier = tiers(redis_server.url)
    reader = make_cache(reader_tier)
    d = digest("a long prompt")
    ids = np.arange(1000, dtype=np.int32)
    key = TierKey("tok", "t1", "fp-tok-1", d).redis_key("wt")
    redis_server.admin().set(key, encode_value(encode_array(ids))[:-100])  # as if cut off mid-write

    value, source = reader.get("t1", d)
    assert (value, source) == (None, "miss") and reader_tier.stats.corrupt == 1
    # The next instance to compute it overwrites the partial value with a whole one.
    value, source = writer.get_or_compute("t1", d, lambda: ids)
    assert source == "computed"
    fresh = make_cache(tiers(redis_server.url))
    value, source = fresh.get("t1", d)
    assert source == "shared"
    np.testing.assert_array_equal(value, ids)


def test_two_instances_share_what_one_computed(redis_server, tiers):
    # Two TieredCaches with their own local caches and Redis clients: two Triton model instances.
    a = make_cache(tiers(redis_server.url))
    b = make_cache(tiers(redis_server.url))
    calls = []

    def compute():
        calls.append(1)
        return np.array([101, 2023, 102], dtype=np.int32)

    d = digest("what is a kv cache?")
    assert a.get_or_compute("t1", d, compute)[1] == "computed"
    value, source = b.get_or_compute("t1", d, compute)
    assert source == "shared" and value.tolist() == [101, 2023, 102]
    assert b.get_or_compute("t1", d, compute)[1] == "local"  # the shared hit was copied locally
    assert a.get_or_compute("t1", d, compute)[1] == "local"
    assert len(calls) == 1
    assert (a.stats.computed, a.stats.local_hits) == (1, 1)
    assert (b.stats.shared_hits, b.stats.local_hits, b.stats.computed) == (1, 1, 0)
    assert b.shared.stats.hits == 1 and a.shared.stats.puts == 1


def test_tenants_and_fingerprints_never_share_entries(redis_server, tiers):
    tier = tiers(redis_server.url)
    d = digest("same text")
    one = make_cache(tier, fingerprint="fp-A")
    one.put("tenant-1", d, np.array([1, 2, 3], dtype=np.int32))

    assert one.get("tenant-2", d) == (None, "miss")  # same digest, other tenant
    other_model = make_cache(tiers(redis_server.url), fingerprint="fp-B")
    assert other_model.get("tenant-1", d) == (None, "miss")  # other tokenizer
    same_model = make_cache(tiers(redis_server.url), fingerprint="fp-A")
    assert same_model.get("tenant-1", d)[1] == "shared"
    assert len(redis_server.admin().keys("wt:*")) == 1


def test_outage_degrades_to_local_and_compute_then_recovers(redis_server, tiers, caplog):
    caplog.set_level(logging.INFO, logger="warmup_tools.caches.redis_tier")
    clock = FakeClock()
    tier = tiers(redis_server.url, clock=clock)
    cache = make_cache(tier)
    warm = digest("warm prompt")
    cache.put("t1", warm, np.array([7], dtype=np.int32))
    key = TierKey("tok", "t1", "fp-tok-1", digest("x"))
    assert tier.put(key, b"before")

    redis_server.stop()
    for i in range(5):
        assert tier.get(key) is None
        assert tier.put(key, b"during") is False
        # Requests still succeed: from the local tier, or by computing (no lock to wait for).
        assert cache.get_or_compute("t1", warm, lambda: pytest.fail("local hit expected"))[1] == "local"
        value, source = cache.get_or_compute("t1", digest(f"new {i}"), lambda i=i: np.array([i], dtype=np.int32))
        assert source == "computed" and value.tolist() == [i]
    assert tier.available is False
    # One call went to the network and failed; every later one (get, put, and the miss's get, lock and
    # put) was skipped while the circuit stayed open: 4 in the first round, 5 in each of the other four.
    assert tier.stats.errors == 1 and tier.stats.skipped == 4 + 4 * 5
    assert clock.slept == []  # nobody waited for a lock
    downs = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(downs) == 1  # one line when it goes down, not one per call

    redis_server.start()
    assert tier.get(key) is None and tier.stats.skipped == 25  # still within retry_after_s
    clock.now += RETRY_AFTER_S
    misses = tier.stats.misses
    # Nothing to restart on our side: the next call after retry_after_s probes Redis and closes the
    # circuit. The restarted server is empty (no persistence), so the probe is a plain miss.
    assert tier.get(key) is None and tier.stats.misses == misses + 1
    assert tier.available is True
    assert tier.put(key, b"after") and tier.get(key) == b"after"
    ups = [r for r in caplog.records if r.levelno == logging.INFO and "reachable again" in r.getMessage()]
    assert len(ups) == 1


def test_starts_with_redis_down(tiers):
    clock = FakeClock()
    tier = tiers(f"redis://127.0.0.1:{free_port()}/0", clock=clock)  # nothing listens there
    cache = make_cache(tier)
    value, source = cache.get_or_compute("t1", digest("p"), lambda: np.arange(3))
    assert source == "computed" and value.tolist() == [0, 1, 2]
    # The first call failed and opened the circuit: the lock and the put were not even sent.
    assert tier.stats.errors == 1 and tier.stats.skipped == 2 and tier.available is False


def test_a_stopped_redis_never_hangs_a_call(redis_server, tiers):
    """A Redis that accepts connections but never answers (SIGSTOP): the call returns a miss instead of
    waiting, because the socket timeout ends it; then the circuit skips Redis until retry_after_s."""
    clock = FakeClock()
    tier = tiers(redis_server.url, clock=clock, timeout_ms=20)
    cache = make_cache(tier, local_bytes=0)
    key = TierKey("tok", "t1", "fp-tok-1", digest("p"))
    assert tier.put(key, b"value")  # the connection is open before Redis stalls

    redis_server.pause()
    try:
        # Without the socket timeout this would block until the test's own timeout fails it.
        assert tier.get(key) is None
        assert tier.stats.errors == 1 and tier.available is False
        assert tier.get(key) is None and tier.stats.skipped == 1  # circuit open: not sent at all
        value, source = cache.get_or_compute("t1", digest("q"), lambda: np.arange(2, dtype=np.int32))
        assert source == "computed" and tier.stats.errors == 1 and clock.slept == []
    finally:
        redis_server.resume()
    clock.now += RETRY_AFTER_S
    # The connection that timed out was dropped; the probe opens a new one and closes the circuit.
    assert tier.get(key) == b"value" and tier.available is True


@pytest.mark.parametrize("array,ok", [
    (np.arange(5, dtype=np.int32), True),
    (np.arange(5, dtype=np.int64), False),  # another dtype
    (np.arange(6, dtype=np.int32).reshape(2, 3), False),  # another shape
    (np.arange(11, dtype=np.int32), False),  # longer than the bound
])
def test_token_ids_from_the_shared_tier_are_checked(array, ok):
    from warmup_tools.caches.redis_tier import checked_decoder

    decode = checked_decoder("int32", max_length=10)
    if ok:
        assert np.array_equal(decode(encode_array(array)), array)
    else:
        with pytest.raises(ValueError):
            decode(encode_array(array))


def test_embeddings_from_the_shared_tier_must_have_the_width_and_be_finite():
    from warmup_tools.caches.redis_tier import checked_decoder

    decode = checked_decoder("float32", length=4, finite=True)
    assert decode(encode_array(np.ones(4, dtype=np.float32))).shape == (4,)
    for bad in (np.ones(3, dtype=np.float32), np.array([1, np.nan, 0, 0], dtype=np.float32),
                np.array([np.inf] * 4, dtype=np.float32), np.ones(4, dtype=np.float64)):
        with pytest.raises(ValueError):
            decode(encode_array(bad))


# -- settings --------------------------------------------------------------------------------------


def test_every_redis_parameter_reaches_the_tier(redis_server, tmp_path):
    from tests.unit.triton.test_shared_tier_keys import redis_tier_from_params
    from warmup_tools.triton.params import ModelParameters

    values = {"redis_url": redis_server.url, "redis_timeout_ms": "150", "redis_retry_after_s": "3",
              "redis_ttl_s": "600", "redis_ttl_jitter": "0.25", "redis_lock_wait_ms": "40", "redis_lock_ms": "900",
              "redis_lock_poll_ms": "4", "redis_max_connections": "3", "redis_pool_timeout_ms": "7",
              "control_dir": str(tmp_path)}  # open mode keeps its Redis key salt there
    params = ModelParameters({"name": "tokenizer_cache",
                              "parameters": {k: {"string_value": v} for k, v in values.items()}})
    tier = redis_tier_from_params(params)
    try:
        assert tier.settings == SharedTierSettings(
            url=redis_server.url, control_dir=tmp_path, timeout_ms=150, retry_after_s=3, ttl_s=600, ttl_jitter=0.25,
            lock_wait_ms=40, lock_ms=900, lock_poll_ms=4, max_connections=3, pool_timeout_ms=7)
        pool = tier._client.connection_pool
        assert (pool.max_connections, pool.timeout) == (3, 0.007)
        assert pool.connection_kwargs["socket_timeout"] == pool.connection_kwargs["socket_connect_timeout"] == 0.15
    finally:
        tier.close()
    assert redis_tier_from_params(ModelParameters({"name": "m", "parameters": {}})) is None  # no URL: no tier


@pytest.mark.parametrize("bad", [
    {"ttl_jitter": 1.0}, {"ttl_jitter": -0.1}, {"max_connections": 0}, {"pool_timeout_ms": 0},
    {"lock_wait_ms": -1}, {"lock_ms": 50, "lock_wait_ms": 100}, {"lock_poll_ms": 0}, {"timeout_ms": 0},
    {"ttl_s": -1}, {"namespace": "a:b"},
])
def test_settings_out_of_bounds_are_refused(bad):
    with pytest.raises(ConfigError):
        SharedTierSettings(**bad)


# -- TTL jitter ------------------------------------------------------------------------------------


def warm_up(tier: SharedTier, n: int, tenant: str = "t1") -> list[TierKey]:
    """What a warm-up does: ``n`` values written one after the other, all with the same ttl_s."""
    keys = [TierKey("tok", tenant, "fp-tok-1", digest(f"warm-up prompt {i}")) for i in range(n)]
    for key in keys:
        assert tier.put(key, encode_array(np.arange(8, dtype=np.int32)))
    return keys



@pytest.mark.parametrize("jitter", [0.0, 0.1])
def test_ttl_jitter_spreads_the_expiry_of_a_warm_up(redis_server, tiers, jitter):
    """200 values written at once with one TTL: Redis's own expiry times (PEXPIRETIME, absolute, so they do
    not depend on when the test reads them) lie within ttl_s * (1 +- jitter), and with jitter no 1% slice
    of the TTL holds more than a few of them."""
    ttl_s, n = 1000.0, 200
    tier = tiers(redis_server.url, ttl_s=ttl_s, ttl_jitter=jitter)
    admin = redis_server.admin()
    written_at_ms = int(admin.time()[0]) * 1000
    keys = warm_up(tier, n)
    expiry = [admin.execute_command("PEXPIRETIME", tier.redis_key(k)) for k in keys]
    ttl = [t - written_at_ms for t in expiry]
    slack_ms = 60_000  # the writes themselves take a little time after written_at_ms
    assert all(ttl_s * 1000 * (1 - jitter) - 1000 <= t <= ttl_s * 1000 * (1 + jitter) + slack_ms for t in ttl)
    burst = largest_burst(expiry, 0.01 * ttl_s * 1000)  # expiry times from PEXPIRETIME, in ms
    if jitter == 0.0:
        assert burst == n  # today's behaviour: the whole warm-up expires in the same second
    else:
        # Uniform over 20% of the TTL puts about n / 20 = 10 keys in a 1% slice.
        assert burst <= n // 8
        assert max(ttl) - min(ttl) >= 0.9 * 2 * jitter * ttl_s * 1000


def test_a_key_gets_the_same_ttl_from_every_instance(tiers, redis_server):
    a = tiers(redis_server.url, ttl_s=100)
    b = tiers(redis_server.url, ttl_s=100)
    names = [a.redis_key(TierKey("emb", "t", "fp", digest(f"p{i}"))) for i in range(50)]
    assert [a.ttl_ms(n) for n in names] == [b.ttl_ms(n) for n in names]
    assert all(90_000 <= a.ttl_ms(n) <= 110_000 for n in names) and len({a.ttl_ms(n) for n in names}) == 50
    assert tiers(redis_server.url, ttl_s=0).ttl_ms(names[0]) is None  # 0: never expires


# -- one recompute per key across instances --------------------------------------------------------


class Arrivals:
    """Counts the instances that have started on each key; ``wait_all`` blocks until all ``m`` have."""

    def __init__(self, m: int) -> None:
        self.m = m
        self.count: collections.Counter = collections.Counter()
        self.cond = threading.Condition()

    def arrive(self, key: bytes) -> None:
        with self.cond:
            self.count[key] += 1
            self.cond.notify_all()

    def wait_all(self, key: bytes) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.count[key] >= self.m, timeout=30), "an instance never arrived"


def test_a_warm_up_expiring_at_once_is_recomputed_once_per_key(redis_server, tiers):
    """The load the design names: N keys a warm-up wrote expire together (here all at the same instant,
    the worst case jitter would spread), and M instances (own client, pool and local cache each) then ask
    for every key at the same moment. Each key's computation only finishes once every instance has asked
    for it, so without single flight most of the M instances compute it too (N * M at worst); with the
    lock exactly one does and the others get its value from Redis."""
    n, m = 48, 8
    writer = tiers(redis_server.url, ttl_s=1000)
    keys = warm_up(writer, n)
    admin = redis_server.admin()
    names = [writer.redis_key(k) for k in keys]
    pipe = admin.pipeline()
    for name in names:
        pipe.execute_command("PEXPIREAT", name, 1)  # already past: Redis expires them all now
    pipe.execute()
    assert admin.exists(*names) == 0

    digests = [k.digest for k in keys]
    arrivals = Arrivals(m)
    computed: collections.Counter = collections.Counter()
    computed_lock = threading.Lock()

    def compute(d: bytes) -> np.ndarray:
        arrivals.wait_all(d)
        with computed_lock:
            computed[d] += 1
        return np.frombuffer(d, dtype=np.int32).copy()

    # NOTE: generous bounds, never reached: each wait ends when the holder publishes the value.
    instances = [make_cache(tiers(redis_server.url, ttl_s=1000, timeout_ms=5000, lock_wait_ms=30_000, lock_ms=60_000,
                                  pool_timeout_ms=5000)) for _ in range(m)]
    start = threading.Barrier(m)
    results: list[list[tuple[bytes, np.ndarray, str]]] = [[] for _ in range(m)]
    errors: list[BaseException] = []

    def instance(i: int) -> None:
        try:
            start.wait()
            for d in digests:
                arrivals.arrive(d)
                value, source = instances[i].get_or_compute("t1", d, lambda d=d: compute(d))
                results[i].append((d, value, source))
        except BaseException as exc:  # noqa: BLE001  (reported by the main thread)
            errors.append(exc)

    threads = [threading.Thread(target=instance, args=(i,)) for i in range(m)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sum(computed.values()) == n and set(computed.values()) == {1}  # one recompute per key, not N * M
    for per_instance in results:
        assert [d for d, _, _ in per_instance] == digests
        for d, value, _ in per_instance:
            assert value.tobytes() == d  # everyone got the one computed value
    sources = collections.Counter(source for per_instance in results for _, _, source in per_instance)
    assert sources == {"computed": n, "shared": n * (m - 1)}
    assert sum(c.stats.computed for c in instances) == n
    assert sum(c.shared.stats.lock_timeouts + c.shared.stats.lock_lost for c in instances) == 0
    assert admin.keys("*:lock") == []  # every lock released
    assert admin.exists(*names) == n  # and every value written back, with its jittered TTL
    assert all(900_000 <= admin.pttl(name) <= 1_100_000 for name in names)


def test_a_dead_lock_holder_delays_a_request_by_lock_wait_ms_at_most(redis_server, tiers):
    """An instance took the key's lock and died: another instance waits lock_wait_ms (on an injected clock),
    then computes the value itself and stores it."""
    dead = tiers(redis_server.url, lock_ms=60_000)
    key = TierKey("tok", "t1", "fp-tok-1", digest("p"))
    state, _lease = dead.try_lock(key)  # never released
    assert state is LockState.HELD

    clock = FakeClock()
    tier = tiers(redis_server.url, clock=clock, lock_wait_ms=100, lock_poll_ms=2)
    cache = make_cache(tier)
    started = clock.now
    value, source = cache.get_or_compute("t1", key.digest, lambda: np.array([5], dtype=np.int32))
    assert source == "computed" and value.tolist() == [5]
    assert clock.now - started == pytest.approx(0.100)  # waited lock_wait_ms, in lock_poll_ms steps
    assert max(clock.slept) == pytest.approx(0.002) and len(clock.slept) in (50, 51)  # 51: float rounding
    assert (tier.stats.lock_busy, tier.stats.lock_timeouts, tier.stats.lock_waited) == (1, 1, 0)
    assert make_cache(tiers(redis_server.url)).get("t1", key.digest)[1] == "shared"  # stored for the others


def test_a_waiting_instance_takes_the_value_as_soon_as_it_lands(redis_server, tiers):
    holder = tiers(redis_server.url)
    key = TierKey("tok", "t1", "fp-tok-1", digest("p"))
    state, lease = holder.try_lock(key)
    assert state is LockState.HELD

    clock = FakeClock()

    def sleep(seconds: float) -> None:  # the holder finishes while the waiter sleeps its third poll
        clock.sleep(seconds)
        if len(clock.slept) == 3:
            make_cache(holder).put("t1", key.digest, np.array([9], dtype=np.int32))
            holder.unlock(lease)

    waiter = make_cache(tiers(redis_server.url, clock=clock, sleep=sleep, lock_wait_ms=100, lock_poll_ms=2))
    value, source = waiter.get_or_compute("t1", key.digest, lambda: pytest.fail("the holder computed it"))
    assert source == "shared" and value.tolist() == [9] and len(clock.slept) == 3
    assert waiter.shared.stats.lock_waited == 1


def test_a_lock_that_expired_is_never_released_by_its_old_holder(redis_server, tiers):
    """The holder's lock expired mid-compute and another instance took it: the old holder's release
    (compare-and-delete on its token) leaves the new holder's lock in place."""
    admin = redis_server.admin()
    a = tiers(redis_server.url)
    b = tiers(redis_server.url)
    cache = make_cache(a)
    key = TierKey("tok", "t1", "fp-tok-1", digest("slow prompt"))
    lock_name = a.redis_key(key) + ":lock"
    taken = []

    def slow_compute():
        admin.delete(lock_name)  # as if lock_ms ran out
        taken.append(b.try_lock(key))
        return np.array([1], dtype=np.int32)

    assert cache.get_or_compute("t1", key.digest, slow_compute)[1] == "computed"
    assert taken[0][0] is LockState.HELD
    assert a.stats.lock_lost == 1 and admin.get(lock_name) is not None  # b's lock survives
    b.unlock(taken[0][1])
    assert admin.get(lock_name) is None and b.stats.lock_lost == 0


def test_a_failed_compute_releases_the_lock(redis_server, tiers):
    tier = tiers(redis_server.url)
    cache = make_cache(tier)
    d = digest("p")

    def broken():
        raise RuntimeError("tokenizer failed")

    with pytest.raises(RuntimeError, match="^tokenizer failed$"):
        cache.get_or_compute("t1", d, broken)
    assert redis_server.admin().keys("*:lock") == []
    assert cache.get_or_compute("t1", d, lambda: np.array([3], dtype=np.int32))[1] == "computed"
    assert tier.stats.locks == 2 and tier.stats.lock_busy == 0


def test_no_lock_when_single_flight_is_off(redis_server, tiers):
    tier = tiers(redis_server.url, lock_wait_ms=0)
    cache = make_cache(tier)
    tiers(redis_server.url).try_lock(TierKey("tok", "t1", "fp-tok-1", digest("p")))  # someone holds it
    assert cache.get_or_compute("t1", digest("p"), lambda: np.array([3], dtype=np.int32))[1] == "computed"
    assert (tier.stats.locks, tier.stats.lock_busy) == (0, 0)


# -- the connection pool ---------------------------------------------------------------------------


def client_count(admin) -> int:
    """Connections the tier opened (they name themselves), not the admin's own."""
    return sum(1 for c in admin.client_list() if c["name"] == CLIENT_NAME)


def test_pool_is_bounded_and_a_full_pool_is_a_miss(redis_server, tiers):
    tier = tiers(redis_server.url, max_connections=2, pool_timeout_ms=5)
    key = TierKey("tok", "t1", "fp1", digest("p"))
    assert tier.put(key, b"value")
    pool = tier._client.connection_pool
    held = [pool.get_connection(), pool.get_connection()]  # both connections busy (other threads' calls)
    try:
        assert tier.get(key) is None and tier.put(key, b"other") is False
        assert tier.stats.pool_exhausted == 2 and tier.stats.errors == 1 and tier.stats.put_errors == 1
        assert tier.available  # a busy pool is not a Redis outage: the circuit stays closed
    finally:
        for connection in held:
            pool.release(connection)
    assert tier.get(key) == b"value"


def test_many_threads_share_at_most_max_connections(redis_server, tiers):
    admin = redis_server.admin()
    tier = tiers(redis_server.url, max_connections=2, pool_timeout_ms=5000, timeout_ms=5000)
    keys = warm_up(tier, 20)
    start = threading.Barrier(8)
    seen = []

    def reader() -> None:
        start.wait()
        for _ in range(5):
            for key in keys:
                tier.get(key)
        seen.append(client_count(admin))

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 8 and max(seen) <= 2
    assert tier.stats.hits + tier.stats.pool_exhausted == 8 * 5 * 20
    assert client_count(admin) <= 2
