import gzip
import hashlib
from collections import Counter, defaultdict

import pytest

from warmup_tools.common.errors import ConfigError
from warmup_tools.common.jsonl import read_json_lines
from warmup_tools.common.records import RECORD_KEYS, RequestRecord
from warmup_tools.sim.traffic import (
    BASE_MODEL,
    DAY_SECONDS,
    TrafficConfig,
    generate,
    main_traffic,
    system_prompt,
    templates,
    write_logs,
)

DEFAULT = TrafficConfig()
SMALL = TrafficConfig(requests_per_day=1500)


@pytest.fixture(scope="module")
def records():
    return list(generate(DEFAULT))


def _day(record, config=DEFAULT):
    return int((record["ts"] - config.start) // DAY_SECONDS) + 1


def _template_counts(records, day):
    counts = defaultdict(Counter)
    for r in records:
        if r["template"] is not None and _day(r) == day:
            counts[(r["tenant"], r["adapter"])][r["template"]] += 1
    return counts


def _is_raw(record):
    return record["adapter"] == BASE_MODEL or not record["prompt"].startswith(
        system_prompt(record["tenant"], record["adapter"]))


def _ranks(values):
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def _spearman(x, y):
    rx, ry = _ranks(x), _ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def test_same_seed_writes_identical_bytes_and_another_seed_differs(tmp_path):
    for compressed in (False, True):
        first = write_logs(SMALL, tmp_path / f"a{compressed}", gzip=compressed)
        second = write_logs(SMALL, tmp_path / f"b{compressed}", gzip=compressed)
        other = write_logs(TrafficConfig(seed=1, requests_per_day=1500), tmp_path / f"c{compressed}", gzip=compressed)
        suffix = ".jsonl.gz" if compressed else ".jsonl"
        assert [p.name for p in first] == [f"day1{suffix}", f"day2{suffix}"]
        assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]
        assert all(a.read_bytes() != c.read_bytes() for a, c in zip(first, other))


def test_every_record_has_the_log_schema(records):
    for r in records:
        assert tuple(r) == RECORD_KEYS
        assert type(r["ts"]) is float
        assert r["tenant"] in DEFAULT.tenants
        assert r["adapter"] in (*DEFAULT.adapters, BASE_MODEL)
        assert isinstance(r["prompt"], str) and r["prompt"]
        assert r["prompt_digest"] == hashlib.blake2b(r["prompt"].encode(), digest_size=16).hexdigest()
        assert r["prompt_tokens"] is r["cached_tokens"] is r["ttft_ms"] is r["output_tokens"] is r["cluster"] is None
        assert r["template"] is None or r["template"].startswith(f"{r['adapter']}/{r['tenant']}/")


def test_records_are_in_time_order_within_their_days(tmp_path, records):
    stamps = [r["ts"] for r in records]
    assert stamps == sorted(stamps)
    per_day = Counter(_day(r) for r in records)
    assert per_day == {1: DEFAULT.requests_per_day, 2: DEFAULT.requests_per_day}
    paths = write_logs(SMALL, tmp_path)
    for day, path in enumerate(paths, 1):
        day_start = SMALL.start + (day - 1) * DAY_SECONDS
        stamps = [r["ts"] for r in read_json_lines([path])]
        assert len(stamps) == SMALL.requests_per_day
        assert day_start <= min(stamps) and max(stamps) < day_start + DAY_SECONDS
    # The replay benchmark uses day 2's first hour: quieter than average, but not empty.
    day2 = DEFAULT.start + DAY_SECONDS
    first_hour = sum(day2 <= r["ts"] < day2 + 3600 for r in records) / DEFAULT.requests_per_day
    assert 0.02 <= first_hour <= 0.04
    # Working hours are busier than the night.
    hours = Counter(int((r["ts"] - DEFAULT.start) % DAY_SECONDS // 3600) for r in records)
    assert hours[14] > 2 * hours[3]


def test_template_popularity_is_zipf_like(records):
    pairs = _template_counts(records, day=1)
    assert len(pairs) == len(DEFAULT.tenants) * len(DEFAULT.adapters)
    for pair, counts in pairs.items():
        ranked = [n for _, n in counts.most_common()]
        assert len(ranked) == DEFAULT.templates_per_adapter, pair
        assert ranked[0] >= 3 * ranked[4], (pair, ranked)


def test_long_tail_and_raw_shares_match_the_config(records):
    long_tail = [r for r in records if r["template"] is None]
    raw = [r for r in records if _is_raw(r)]
    assert abs(len(long_tail) / len(records) - DEFAULT.long_tail_share) < 0.012
    assert abs(len(raw) / len(records) - DEFAULT.raw_share) < 0.006
    assert all(r["template"] is None for r in raw)
    assert any(r["adapter"] == BASE_MODEL for r in raw) and any(r["adapter"] != BASE_MODEL for r in raw)
    assert len({r["prompt"] for r in long_tail}) == len(long_tail)


def test_day_two_drifts_from_day_one(records):
    day1, day2 = _template_counts(records, day=1), _template_counts(records, day=2)
    correlations = []
    for pair, first in day1.items():
        second = day2[pair]
        assert 1 <= len(set(second) - set(first)) <= 2, pair
        common = sorted(set(first) & set(second))
        correlations.append(_spearman([first[t] for t in common], [second[t] for t in common]))
    mean = sum(correlations) / len(correlations)
    assert 0.0 < mean < 0.95
    assert all(c < 1.0 for c in correlations)
    new = {t.name for t in templates(DEFAULT) if t.first_day == 2}
    assert {r["template"] for r in records if _day(r) == 2} & new


def test_no_drift_keeps_the_template_set():
    config = TrafficConfig(drift=0.0, requests_per_day=1500)
    assert {t.first_day for t in templates(config)} == {1}
    day2 = {r["template"] for r in generate(config) if r["template"] and _day(r, config) == 2}
    assert day2 <= {t.name for t in templates(config)}


def test_prompts_are_system_prompt_then_template_then_user_part(records):
    by_name = {t.name: t for t in templates(DEFAULT)}
    assert all(40 <= len(t.body.split()) <= 200 for t in by_name.values())
    prompts = {(t, a): system_prompt(t, a) for t in DEFAULT.tenants for a in DEFAULT.adapters}
    assert len(set(prompts.values())) == len(prompts)
    assert all(150 <= len(p.split()) <= 250 for p in prompts.values())
    user_parts = Counter()
    for r in records:
        if _is_raw(r):
            assert not any(r["prompt"].startswith(p) for p in prompts.values())
            continue
        head = prompts[(r["tenant"], r["adapter"])]
        assert r["prompt"].startswith(head)
        if r["template"] is not None:
            head += by_name[r["template"]].body
            assert r["prompt"].startswith(head)
            user = r["prompt"][len(head):]
            assert 5 <= len(user.split()) <= 30, user
            user_parts[(r["template"], user)] += 1
    repeated = sum(n for n in user_parts.values() if n > 1) / sum(user_parts.values())
    assert 0.05 < repeated < 0.5  # some user parts recur verbatim, most don't


def test_gzip_logs_read_back_as_generated(tmp_path):
    paths = write_logs(SMALL, tmp_path, gzip=True)
    assert all(p.name.endswith(".jsonl.gz") for p in paths)
    with gzip.open(paths[0], "rt", encoding="utf-8") as f:
        assert f.readline().startswith('{"v":1,"ts":')
    assert list(read_json_lines(paths)) == list(generate(SMALL))


def test_generated_records_are_request_records():
    for raw in list(generate(SMALL))[:50]:
        assert RequestRecord.from_json(raw).to_json(with_template=True) == raw


@pytest.mark.parametrize("changes", [
    {"raw_share": 0.1, "long_tail_share": 0.05},
    {"adapters": ("support", "poetry")},
    {"days": 0},
    {"tenants": "acme"},
    {"tenants": ("acme", "acme")},
    {"drift": 1.5},
])
def test_invalid_config_is_rejected(changes):
    with pytest.raises(ConfigError):
        TrafficConfig(**changes)


def test_main_traffic_writes_logs_and_prints_a_summary(tmp_path, capsys):
    paths = main_traffic(tmp_path, seed=3, days=3, requests_per_day=400, gzip=False)
    assert [p.name for p in paths] == ["day1.jsonl", "day2.jsonl", "day3.jsonl"]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["day", "requests", "support", "legal", "sql", "base", "templates", "long-tail", "raw",
                                "first-hour"]
    assert [line.split()[:2] for line in lines[1:]] == [[p.name, "400"] for p in paths]
