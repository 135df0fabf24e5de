"""The Redis shared cache tier, against a real redis-server started by the tests on a free port."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from tests.redis_support import REDIS_SERVER, RedisServer, free_port
from warmup_tools.caches.policies import LRUCache
from warmup_tools.caches.redis_tier import SharedTier, TierKey, decode_array, decode_value, encode_array, encode_value
from warmup_tools.caches.tiered import TieredCache

redis = pytest.importorskip("redis", reason="the shared tier tests need redis-py: pip install 'redis>=5'")

pytestmark = pytest.mark.timeout(30)

#: Generous bound on a call while Redis is down or paused: a bound check, not a benchmark.
CALL_BOUND_S = 0.5
RETRY_AFTER_S = 0.2


def digest(text: str) -> bytes:
    from warmup_tools.common.digests import text_digest

    return text_digest(text)


@pytest.fixture
def redis_server(tmp_path):
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not on PATH (apt-get install redis-server)")
    server = RedisServer(free_port(), tmp_path)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def tiers():
    """SharedTier objects a test creates, closed afterwards."""
    made: list[SharedTier] = []

    def make(url: str, **kwargs) -> SharedTier:
        kwargs.setdefault("retry_after_s", RETRY_AFTER_S)
        tier = SharedTier(url, **kwargs)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def make_cache(tier: SharedTier | None, fingerprint: str = "fp-tok-1") -> TieredCache[np.ndarray]:
    return TieredCache(
        LRUCache(1 << 20), tier, kind="tok", fingerprint=fingerprint, encode=encode_array, decode=decode_array
    )


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


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
    assert 0 < redis_server.admin().pttl(key.redis_key("wt")) <= 86400 * 1000

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
    tier = tiers(redis_server.url)
    cache = make_cache(tier)
    warm = digest("warm prompt")
    cache.put("t1", warm, np.array([7], dtype=np.int32))
    key = TierKey("tok", "t1", "fp-tok-1", digest("x"))
    assert tier.put(key, b"before")

    redis_server.stop()
    for i in range(5):
        value, elapsed = timed(tier.get, key)
        assert value is None and elapsed < CALL_BOUND_S
        stored, elapsed = timed(tier.put, key, b"during")
        assert stored is False and elapsed < CALL_BOUND_S
        # Requests still succeed: from the local tier, or by computing.
        assert cache.get_or_compute("t1", warm, lambda: pytest.fail("local hit expected"))[1] == "local"
        value, source = cache.get_or_compute("t1", digest(f"new {i}"), lambda i=i: np.array([i], dtype=np.int32))
        assert source == "computed" and value.tolist() == [i]
    assert tier.available is False
    assert tier.stats.errors >= 1 and tier.stats.skipped >= 10
    downs = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(downs) == 1  # one line when it goes down, not one per call

    redis_server.start()
    time.sleep(RETRY_AFTER_S * 1.5)
    misses = tier.stats.misses
    # Nothing to restart on our side: the next call after retry_after_s probes Redis and closes the
    # circuit. The restarted server is empty (no persistence), so the probe is a plain miss.
    assert tier.get(key) is None and tier.stats.misses == misses + 1
    assert tier.available is True
    assert tier.put(key, b"after") and tier.get(key) == b"after"
    ups = [r for r in caplog.records if r.levelno == logging.INFO and "reachable again" in r.getMessage()]
    assert len(ups) == 1


def test_starts_with_redis_down(tiers):
    tier = tiers(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    cache = make_cache(tier)
    (value, source), elapsed = timed(cache.get_or_compute, "t1", digest("p"), lambda: np.arange(3))
    assert source == "computed" and elapsed < CALL_BOUND_S
    assert tier.available is False


def test_slow_redis_times_out_within_the_bound_then_recovers(redis_server, tiers):
    tier = tiers(redis_server.url, timeout_ms=20)
    key = TierKey("tok", "t1", "fp1", digest("p"))
    assert tier.put(key, b"value")  # the connection is open before Redis stalls

    redis_server.admin().execute_command("CLIENT", "PAUSE", 500, "ALL")
    value, elapsed = timed(tier.get, key)
    assert value is None and elapsed < CALL_BOUND_S / 2
    assert tier.stats.errors == 1 and tier.available is False
    value, elapsed = timed(tier.get, key)  # circuit open: skipped without waiting for Redis
    assert value is None and elapsed < CALL_BOUND_S / 5 and tier.stats.skipped == 1

    deadline = time.monotonic() + 5
    while tier.get(key) != b"value":
        assert time.monotonic() < deadline, "the tier did not recover after CLIENT PAUSE ended"
        time.sleep(0.05)
    assert tier.available is True


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
