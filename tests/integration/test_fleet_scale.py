"""Three replicas whose lora_adapter runs the simulated engine, behind the real smg router, replaying a short
slice of a public trace (what ``bench fleet-scale`` runs at 1 to 8 replicas): a plan made from the slice's first
part warms every replica, the rest is replayed through the router without a failed request and partly from the
KV cache, every replica's request log gives modelled TTFTs, and after a router restart each replica's workers
come back and requests are served again."""

from __future__ import annotations

import io
import time

import httpx
import pytest

from tests.waiting import wait_for
from warmup_tools.common.records import RequestRecord, log_files, read_request_log
from warmup_tools.common.settings import environ_overrides
from warmup_tools.fleet.fleet import Fleet
from warmup_tools.fleet.settings import FleetSettings
from warmup_tools.lora_adapter.profile import load_profile
from warmup_tools.sim.bench.fleet_scale import (
    Bench,
    replay,
    replicas_by_worker,
    summarise,
    workload,
)
from warmup_tools.sim.bench.support.sending import replica_named, send
from warmup_tools.sim.bench.support.simulated import replica_kv_tokens, simulated_environment
from warmup_tools.sim.traces import TraceScale

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

PROFILE = "h100-llama-3.1-8b"
SPEEDUP = 8.0


def test_three_simulated_replicas_replay_a_trace_slice_through_the_router(served_assets, tmp_path):
    engine = load_profile(PROFILE)
    kv_bytes = replica_kv_tokens(engine, 16, "conversation") * engine.kv_bytes_per_token
    with environ_overrides(simulated_environment(PROFILE, SPEEDUP, kv_bytes)):
        load = workload(tmp_path / "load", served_assets, "conversation",
                        TraceScale(block_tokens=16, max_output_tokens=2, duration_s=100), plan_min=1.5,
                        replay_min=0.5, split_replicas=3)
        bench = Bench(tmp_path, served_assets, load, speedup=SPEEDUP, window_s=30, concurrency=16, out=io.StringIO())
        settings = FleetSettings(replicas=3, policy="cache_aware", port=0, work_dir=tmp_path / "fleet",
                                 model_repository=load.whole_repo, assets_dir=served_assets,
                                 membership_interval_s=1.0)
        with Fleet(settings) as fleet:
            started = time.time()
            answers = replay(fleet.router.url, load.replayed, SPEEDUP, 16)
            taken = [r.requests_taken() for r in fleet.replicas.values()]

            fleet.restart_router()
            wait_for(fleet.workers_listed, "every model of every replica a worker again")
            with httpx.Client(timeout=120) as client:
                after = send(client, fleet.router.url, RequestRecord(ts=0.0, prompt=load.replayed[0].prompt), 2)
            logs = fleet.request_log_dir
            by_url = replicas_by_worker(fleet)

    assert len(load.plan_records) > 100 and len(load.replayed) > 20
    row = summarise("3 x cache_aware", 3, answers, [t for _, t in bench.modelled_ttfts(logs)], 30,
                    "/".join(map(str, taken)), "")
    assert row.requests == len(load.replayed) and row.failed == 0, [a.error for a in answers if a.error][:3]
    assert 0 < row.cached_share < 1
    assert sum(taken) == len(load.replayed)
    served = [r for r in read_request_log(log_files(logs)) if r.ts >= started]  # not the warm-up's
    assert len(served) == len(load.replayed) + 1 and row.ttft_p50_ms is not None and row.ttft_p50_ms > 0
    assert not after.error and after.cached_tokens > 0  # the router routes again, and the replica kept its cache
    assert replica_named(after.worker, by_url) in by_url.values(), f"the router names its worker: {after.worker!r}"
