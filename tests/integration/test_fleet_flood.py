"""One tenant floods a fleet of two replicas through the real smg router (issue 41): the flooder is refused with
429 ``rate_limit_error`` once it holds its share of each instance, every request of another tenant is served, no
replica's sidecar says not ready, and no model is reloaded. The replicas' lora_adapter runs the simulated engine
(its scheduler is the real one) with small bounds, so that a few dozen streams fill it; open mode, the tenant in
``user``. Every wait is on a condition; the flood stops when the other tenant is done (and at a request bound)."""

from __future__ import annotations

import pytest

from warmup_tools.common.settings import environ_overrides
from warmup_tools.fleet.fleet import Fleet
from warmup_tools.fleet.settings import FleetSettings
from warmup_tools.sim.bench.tenant_flood import flood_fleet, simulated_fleet_environment

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

#: Concurrent streams of the flooder: more than two instances hold of one tenant (4 running + 4 waiting each).
FLOODERS = 32


def test_one_tenant_flooding_two_replicas_gets_429_while_another_is_served_and_nothing_reloads(served_assets,
                                                                                                tmp_path):
    with environ_overrides(simulated_fleet_environment()):
        settings = FleetSettings(replicas=2, port=0, assets_dir=served_assets, work_dir=tmp_path,
                                 membership_interval_s=1.0)
        with Fleet(settings) as fleet:
            sidecars = {name: replica.sidecar_url for name, replica in fleet.replicas.items()}
            report = flood_fleet(fleet.router.url, sidecars, flooders=FLOODERS, quiet_requests=12,
                                 max_flood_requests=20_000)

    assert report.first_429 is not None, f"the flooder was never refused: {report.flooder_statuses}"
    error = report.first_429["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded", error
    assert "this tenant" in error["message"] and "lower your concurrency" in error["message"]
    assert report.flooder_statuses[200] > 0 and set(report.flooder_statuses) <= {200, 429}, report.flooder_statuses
    # The other tenant: every request served, before and during the flood.
    assert report.quiet_errors == [] and len(report.flood_ttft_ms) == 12 and len(report.quiet_ttft_ms) == 12
    # No replica went not ready, and nothing was reloaded or restarted.
    assert report.readiness_reads > 0 and report.not_ready == []
    assert report.recoveries == {name: 0 for name in sidecars}
