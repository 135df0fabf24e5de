"""The second real-text log: tenant preambles, other questions, raw calls, day 2 repeating day 1."""

from collections import Counter

import pytest

from warmup_tools.common.errors import ConfigError
from warmup_tools.common.jsonl import read_json_lines
from warmup_tools.sim.heldout_traffic import (
    PREAMBLE_LEAD,
    HeldOutConfig,
    generate_heldout,
    load_heldout_corpus,
    write_heldout_logs,
)
from warmup_tools.sim.real_traffic import USER_LEAD, CorpusMissingError
from warmup_tools.sim.traffic import DAY_SECONDS

try:
    CORPUS = load_heldout_corpus()
except CorpusMissingError as exc:  # the packages of the realtext extra ship the text
    pytest.skip(str(exc), allow_module_level=True)

SMALL = HeldOutConfig(requests_per_day=1500)


@pytest.fixture(scope="module")
def days():
    records = list(generate_heldout(SMALL))
    cut = SMALL.start + DAY_SECONDS
    return [r for r in records if r["ts"] < cut], [r for r in records if r["ts"] >= cut]


def test_same_config_writes_identical_bytes(tmp_path):
    first = write_heldout_logs(SMALL, tmp_path / "a")
    second = write_heldout_logs(SMALL, tmp_path / "b")
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]
    assert len(list(read_json_lines(first[0]))) == 1500


def test_the_shares_are_those_of_the_config(days):
    day1, day2 = days
    assert sum(r["template"] is None for r in day1) == 150  # raw calls: exactly 10%
    seen = {(r["tenant"], r["adapter"], r["prompt"]) for r in day1}
    repeats = sum((r["tenant"], r["adapter"], r["prompt"]) in seen for r in day2) / len(day2)
    assert 1 / 3 <= repeats < 0.45  # a third by construction, plus popular turns that recur by themselves


def test_application_prompts_are_a_role_a_tenant_preamble_and_a_question(days):
    day1, _ = days
    roles = {text for _, text in CORPUS.roles}
    preambles_by_tenant: dict[str, set[str]] = {}
    for record in day1:
        if record["template"] is None:
            assert record["prompt"] in CORPUS.turns and PREAMBLE_LEAD not in record["prompt"]
            continue
        system, _, user = record["prompt"].partition(USER_LEAD)
        role, _, preamble = system.partition(PREAMBLE_LEAD)
        assert role in roles and preamble in CORPUS.preambles and user in CORPUS.turns
        preambles_by_tenant.setdefault(record["tenant"], set()).add(preamble)
    assert all(len(p) == 1 for p in preambles_by_tenant.values())  # one preamble per tenant
    assert len(set.union(*preambles_by_tenant.values())) == len(preambles_by_tenant)
    assert Counter(r["template"] for r in day1).most_common(1)[0][1] < len(day1) / 3  # Zipf, not one app


@pytest.mark.parametrize("changes", [{"raw_share": 1.5}, {"repeat_share": -0.1}, {"applications": 2},
                                     {"churn": 0.6}, {"max_user_words": 0}])
def test_invalid_configs_are_rejected(changes):
    with pytest.raises(ConfigError):
        HeldOutConfig(**changes)
