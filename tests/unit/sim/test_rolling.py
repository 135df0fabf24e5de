"""bench rolling's figures: windows and how long new applications stay cold (no server)."""

from warmup_tools.common.records import RequestRecord
from warmup_tools.sim.bench.rolling import apps_table, new_applications, table
from warmup_tools.sim.bench.support.workload import Served

START = 1_700_000_000.0


def test_new_applications_are_timed_from_their_first_request_to_their_first_warm_one():
    day1 = [RequestRecord(ts=START - 100, tenant="acme", adapter="sql", template="old")]
    day2 = [RequestRecord(ts=START + 60 * i, tenant="acme", adapter="sql", template=t)
            for i, t in enumerate(["old", "new", "new", "new", "gone"])]
    cold, warm = Served(0, False, 1.0, 16, 100), Served(0, False, 1.0, 64, 100)
    # Day 1 could know 16 tokens of each prompt (the scope's system prompt); more than that is warm.
    apps = new_applications(day1, day2, [16] * 5, {"static": [warm, cold, cold, warm, cold],
                                         "rolling": [warm, warm, warm, warm, cold]})
    # "new" warms at its third request, two minutes in; "gone" (one cold request) never does.
    assert apps["static"] == [(2.0, 2), (None, 1)]
    assert apps["rolling"] == [(0.0, 0), (None, 1)]
    text = apps_table(apps)
    assert "| static | 2 | 1 | 2 / 2 | 2 / 2 |" in text
    windows = table(day2, START, 0.05, 0.1, {"static": [warm, cold, cold, warm, cold]})
    assert "| +0 to +0.05 h | static | 3 | 0 | 0.0% |" in windows and "| +0 to +0.1 h | static | 5 |" in windows
