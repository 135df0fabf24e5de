"""bench race against the project's own server: started from nothing with its plan, then restarted from the KV
snapshot its first run left, each into the same open-loop replay of real-text traffic (the peers are not installed
in CI; their command lines are checked in tests/unit/sim/test_peer.py)."""

from __future__ import annotations

import io

import pytest

from warmup_tools.sim.bench.race import run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def test_the_project_races_itself_with_its_plan_then_from_its_snapshot_and_answers_every_request(demo_assets):
    out = io.StringIO()
    runs = run(demo_assets.root, peers="", requests_per_day=600, duration_s=10, first_s=3, max_tokens=2, out=out)
    assert [r.name for r in runs] == ["this project (plan)", "this project (plan, snapshot)"]
    plan, restarted = runs
    assert len(plan.sent) == len(restarted.sent) > 0
    assert not plan.failed and not restarted.failed, out.getvalue()
    assert plan.ready_s > 0 and restarted.ready_s > 0
    # The restart holds what the first run computed (its snapshot) beside the plan's prefixes: at least as warm.
    cached = [sum(s.cached_tokens for s in r.sent) for r in runs]
    assert cached[1] >= cached[0] and cached[1] > 0, out.getvalue()
    table = out.getvalue()
    assert "| this project (plan) |" in table and "| this project (plan, snapshot) |" in table
