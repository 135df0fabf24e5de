import json

import pytest

from warmup_tools.embedding_cache.heat import (
    OVERFLOW_ADAPTER,
    OVERFLOW_ADAPTER_KEYS,
    OVERFLOW_CLUSTER,
    HeatEntry,
    HeatLogWriter,
    HeatSampler,
)


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def counts(sampler: HeatSampler) -> dict[tuple[int, str, float], tuple[float, float]]:
    return {(e.cluster_id, e.adapter, e.window_s): (e.requests, e.prompt_tokens) for e in sampler.snapshot()}


def test_counts_per_window_slide_with_the_clock():
    clock = FakeClock(1000.0)
    sampler = HeatSampler(windows_s=(30, 120), bucket_s=10, clock=clock)
    sampler.record(1, "sql", prompt_tokens=100)
    clock.t = 1015.0
    sampler.record(1, "sql", prompt_tokens=50)
    sampler.record(2, "legal", prompt_tokens=7)
    assert counts(sampler) == {
        (1, "sql", 30.0): (2.0, 150.0), (1, "sql", 120.0): (2.0, 150.0),
        (2, "legal", 30.0): (1.0, 7.0), (2, "legal", 120.0): (1.0, 7.0),
    }
    clock.t = 1025.0  # the 30 s window now spans buckets 1000..1020 and 1020..1030: still both requests
    assert counts(sampler)[(1, "sql", 30.0)] == (2.0, 150.0)
    clock.t = 1030.0  # the bucket starting at 1000 left the 30 s window
    assert counts(sampler)[(1, "sql", 30.0)] == (1.0, 50.0)
    assert counts(sampler)[(1, "sql", 120.0)] == (2.0, 150.0)
    clock.t = 1045.0  # nothing left in 30 s: keys with zero counts are not reported
    snapshot = counts(sampler)
    assert (1, "sql", 30.0) not in snapshot and snapshot[(2, "legal", 120.0)] == (1.0, 7.0)
    clock.t = 1135.0  # 120 s back from here is bucket 1020..1030
    assert sampler.snapshot() == [] and len(sampler) == 0


def test_sample_rate_weights_keep_counts_unbiased():
    clock = FakeClock()
    sampler = HeatSampler(windows_s=(60,), clock=clock, sample_rate=0.25)
    for _ in range(3):
        sampler.record(5, "support", prompt_tokens=10)
    sampler.record(5, "support", prompt_tokens=10, weight=1.0)  # an explicit weight wins
    assert sampler.snapshot() == [HeatEntry(5, "support", 60.0, 13.0, 130.0)]


def test_drain_log_returns_each_closed_bucket_once():
    clock = FakeClock(1000.0)
    sampler = HeatSampler(windows_s=(60,), bucket_s=10, clock=clock)
    sampler.record(1, "sql", prompt_tokens=3)
    assert sampler.drain_log() == []  # the bucket is still open
    clock.t = 1012.0
    sampler.record(1, "sql", prompt_tokens=4)
    sampler.record(2, "base", prompt_tokens=1, weight=0.5)
    assert sampler.drain_log() == [{"t": 1000, "dt": 10, "cluster": 1, "adapter": "sql", "n": 1, "tokens": 3}]
    assert sampler.drain_log() == []
    clock.t = 1020.0
    records = sampler.drain_log()
    assert records == [
        {"t": 1010, "dt": 10, "cluster": 1, "adapter": "sql", "n": 1, "tokens": 4},
        {"t": 1010, "dt": 10, "cluster": 2, "adapter": "base", "n": 0.5, "tokens": 0.5},
    ]
    json.dumps(records)
    assert sampler.drain_log() == []


def test_buckets_older_than_the_largest_window_are_dropped():
    clock = FakeClock(0.0)
    sampler = HeatSampler(windows_s=(20, 60), bucket_s=10, clock=clock)
    for step in range(1000):
        clock.t = step * 10.0
        sampler.record(step % 3, "a")
    assert len(sampler._buckets) <= 6
    assert sampler.stats.undrained_dropped > 0
    assert len(sampler.drain_log()) <= 3 * 5


def test_a_flood_of_cluster_ids_is_capped_and_counted_under_the_overflow_cluster():
    clock = FakeClock()
    sampler = HeatSampler(windows_s=(60,), clock=clock, max_keys=100)
    for cluster_id in range(10_000):
        sampler.record(cluster_id, "sql", prompt_tokens=1)
    assert len(sampler) == 101
    snapshot = counts(sampler)
    assert snapshot[(OVERFLOW_CLUSTER, "sql", 60.0)] == (10_000 - 100, 10_000 - 100)
    # a flood of adapter names is capped too
    for i in range(1000):
        sampler.record(7, f"adapter-{i}")
    assert len(sampler) == 100 + OVERFLOW_ADAPTER_KEYS + 1
    snapshot = counts(sampler)
    assert sum(n for n, _ in snapshot.values()) == 11_000  # nothing is lost, only merged
    assert snapshot[(OVERFLOW_CLUSTER, OVERFLOW_ADAPTER, 60.0)][0] == 1000 - OVERFLOW_ADAPTER_KEYS + 1
    assert sampler.stats.overflowed == 10_000 - 100 + 1000


def test_keys_come_back_under_the_cap_once_old_buckets_expire():
    clock = FakeClock(0.0)
    sampler = HeatSampler(windows_s=(10,), bucket_s=10, clock=clock, max_keys=2)
    sampler.record(1, "a")
    sampler.record(2, "a")
    clock.t = 10.0
    sampler.record(3, "a")
    assert {e.cluster_id for e in sampler.snapshot()} == {3}


def test_a_clock_stepping_back_counts_into_the_latest_bucket():
    clock = FakeClock(100.0)
    sampler = HeatSampler(windows_s=(60,), bucket_s=10, clock=clock)
    sampler.record(1, "a")
    clock.t = 50.0
    sampler.record(1, "a")
    assert counts(sampler)[(1, "a", 60.0)] == (2.0, 0.0)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError):
        HeatSampler(sample_rate=0.0)
    with pytest.raises(ValueError):
        HeatSampler(bucket_s=0)
    with pytest.raises(ValueError):
        HeatSampler(windows_s=())


def test_log_writer_appends_json_lines_and_rotates(tmp_path):
    path = tmp_path / "heat" / "heat.jsonl"
    writer = HeatLogWriter(path, max_bytes=200, backups=2)
    record = {"t": 1000, "dt": 10, "cluster": 1, "adapter": "sql", "n": 1, "tokens": 3}
    line_bytes = len(json.dumps(record, separators=(",", ":"))) + 1
    assert writer.write([]) == 0
    written = 0
    for _ in range(20):
        written += writer.write([record, record])
    assert written == 40
    files = sorted(p.name for p in path.parent.iterdir())
    assert files == ["heat.jsonl", "heat.jsonl.1", "heat.jsonl.2"]
    for p in path.parent.iterdir():
        assert p.stat().st_size <= 200
        assert all(json.loads(line) == record for line in p.read_text().splitlines())
    assert (path.parent / "heat.jsonl.1").stat().st_size == (200 // line_bytes) * line_bytes


def test_log_writer_without_backups_truncates(tmp_path):
    path = tmp_path / "heat.jsonl"
    writer = HeatLogWriter(path, max_bytes=100, backups=0)
    for i in range(30):
        writer.write([{"i": i}])
    assert [p.name for p in tmp_path.iterdir()] == ["heat.jsonl"]
    assert path.stat().st_size <= 100
    assert json.loads(path.read_text().splitlines()[-1]) == {"i": 29}


def test_sampler_to_writer_round_trip(tmp_path):
    clock = FakeClock(0.0)
    sampler = HeatSampler(windows_s=(60,), bucket_s=10, clock=clock)
    writer = HeatLogWriter(tmp_path / "heat.jsonl")
    for step in range(6):
        clock.t = step * 10.0
        sampler.record(step, "a", prompt_tokens=step)
        writer.write(sampler.drain_log())
    lines = [json.loads(line) for line in (tmp_path / "heat.jsonl").read_text().splitlines()]
    assert [r["cluster"] for r in lines] == [0, 1, 2, 3, 4]
