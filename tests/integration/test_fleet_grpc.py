"""The fleet on smg's gRPC worker protocol (``worker_protocol`` grpc): real replicas (tritonserver, sidecar, front
with its engine listeners) behind the real smg router, which tokenizes, routes ``cache_aware`` on its event index
fed by each listener's KV events, and reaches each model's listener as a worker of its own.

A replica that warmed before it joined is routed its warm prefixes: prefixes sent to its own front only (the
router never saw them), then, once the router's index holds what that replica announced, a request for each one
through the router goes to that replica and is served from its cache. Every wait is on a condition (the replica's
/health, the router's count of the blocks each worker announced), never on the clock."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.waiting import wait_for
from warmup_tools.server.client import metric_sum, scrape_metrics
from warmup_tools.sim.bench.support.sending import ROUTED_WORKER_HEADER

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

#: The repository's kv_block_size (the fleet registers its workers with it).
BLOCK = 16


@pytest.fixture(scope="module")
def fleet(served_assets, tmp_path_factory):
    """One replica joined at the start, over gRPC, routed cache_aware on the event index; the router's worker API
    behind the control key the fleet makes for the run."""
    from warmup_tools.fleet.fleet import Fleet
    from warmup_tools.fleet.settings import FleetSettings
    from warmup_tools.ops.cli.fleet import served_model

    settings = FleetSettings(replicas=1, worker_protocol="grpc", policy="cache_aware", port=0,
                             assets_dir=served_assets, work_dir=tmp_path_factory.mktemp("fleet"))
    with Fleet(settings, served_model(settings)) as running:
        yield running


def _complete(client: httpx.Client, url: str, prompt: str) -> httpx.Response:
    answer = client.post(f"{url}/v1/completions", json={"model": "base", "prompt": prompt, "max_tokens": 1})
    assert answer.status_code == 200, answer.text
    return answer


def _cached(answer: httpx.Response) -> int:
    return int(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def _announced(fleet, worker_url: str) -> float:
    """Blocks the router took from a worker's KV event state (smg's own counter: the state a new subscriber gets
    first, before any live event)."""
    return metric_sum(scrape_metrics(fleet.router.metrics_url, prefix="smg_kv_event_blocks"),
                      "smg_kv_event_blocks_total", worker=worker_url, op="snapshot")


def test_the_workers_are_the_fronts_listeners_one_per_model(fleet):
    (name, membership), = fleet.memberships.items()
    replica = fleet.replicas[name]
    listed = {w["url"]: w for w in fleet.router.workers()}
    assert set(membership.workers) == set(replica.models())  # the base model and each live adapter
    for model in membership.workers:
        worker = listed[membership.worker_url(model)]
        assert worker["connection_mode"] == "grpc" and worker["status"] == "ready"
        assert worker["model_id"] == model and worker["kv_block_size"] == BLOCK


def test_the_routers_worker_api_answers_only_the_fleets_control_key(fleet):
    """The replicas run open mode over gRPC; the router's worker API does not (the key the fleet made for this
    run, read by smg's launcher from its file): a caller without it cannot add a worker of its own, list or remove
    the fleet's, while the fleet registered every listener with it and serves through the router."""
    membership = next(iter(fleet.memberships.values()))  # the replica joined at the start
    ours = list(membership.workers.values())
    attacker = {"url": "grpc://127.0.0.1:9", "runtime": "vllm", "connection_mode": "grpc", "kv_block_size": BLOCK}
    url = fleet.router.url
    with httpx.Client(timeout=300) as client:
        for headers in ({}, {"Authorization": "Bearer not-the-key"}):
            assert client.post(f"{url}/workers", json=attacker, headers=headers).status_code == 401
            assert client.get(f"{url}/workers", headers=headers).status_code == 401
            for worker_id in ours:
                assert client.delete(f"{url}/workers/{worker_id}", headers=headers).status_code == 401
        listed = fleet.router.workers()  # with the key
        assert attacker["url"] not in {w["url"] for w in listed}
        assert {membership.worker_url(model) for model in membership.workers} <= {w["url"] for w in listed}
        assert fleet.workers_listed()
        answer = _complete(client, url, f"Dock schedule {uuid.uuid4().hex}: list the trucks due before noon.")
        assert answer.headers[ROUTED_WORKER_HEADER] in {membership.worker_url(model) for model in membership.workers}


def test_a_replica_warmed_before_it_joins_is_routed_its_warm_prefixes(fleet):
    """Each prompt's first half went through the router to the first replica (the only one then); the whole prompt
    was then warmed on a new replica's own front, which the router never saw. smg's tree of the text it routed
    points at the first replica (it matched half of the prompt there: over HTTP workers the new replica's warm
    prompts go there, checked 2026-12-06); the event index knows the new replica holds the whole prompt."""
    (first, _), = fleet.memberships.items()
    ours = fleet.memberships[first].worker_url("base")
    sentence = "reconcile the pallets of bay {bay} against the manifest, then list each discrepancy with its lot " \
               "number and the shift that logged it. "
    prompts = [f"Inventory note {uuid.uuid4().hex}: " + sentence.format(bay=bay) * 4 for bay in range(3)]
    heads = [prompt[:len(prompt) // 2] for prompt in prompts]
    held = {}
    with httpx.Client(timeout=300) as client:
        for head in heads:
            assert _complete(client, fleet.router.url, head).headers[ROUTED_WORKER_HEADER] == ours
        warmed = fleet.launch(restore=False)
        warmed.wait_warm()
        for prompt in prompts:
            _complete(client, warmed.url, prompt)
            held[prompt] = _cached(_complete(client, warmed.url, prompt))
            assert held[prompt] >= 4 * BLOCK, "the new replica holds the whole prompt it served"
        fleet.join(warmed)
        theirs = fleet.memberships[warmed.name].worker_url("base")
        # Its base model's blocks are these prompts' alone (the stanzas warm the adapters).
        wait_for(lambda: _announced(fleet, theirs) >= sum(held.values()) // BLOCK,
                 "the router took the warmed replica's state",
                 detail=lambda: f"; {_announced(fleet, theirs)} blocks of {sum(held.values()) // BLOCK}")
        for prompt in prompts:
            answer = _complete(client, fleet.router.url, f"{prompt}Start with lot {uuid.uuid4().hex[:6]}.")
            assert answer.headers[ROUTED_WORKER_HEADER] == theirs, "routed to the replica that holds the prompt"
            assert _cached(answer) >= held[prompt], "served from its warm prefix"


def test_a_restarted_router_routes_on_the_replicas_state_again(fleet):
    """The router restarts with nothing: each membership adds its replica's workers again, smg subscribes from 0 and
    takes each worker's whole state (the full-state answer), and a prefix one replica holds (warmed on its own front,
    never seen by any router) is routed to it again. The seconds from the router answering to its index holding that
    replica's state are printed (`-s`); nothing here depends on them."""
    import time

    if len(fleet.replicas) < 2:
        other = fleet.launch(restore=False)
        other.wait_warm()
        fleet.join(other)
    holder = sorted(fleet.replicas)[-1]
    theirs = fleet.memberships[holder].worker_url("base")
    prompt = f"Shipping audit {uuid.uuid4().hex}: " + "match each container seal to its bill of lading. " * 8
    with httpx.Client(timeout=300) as client:
        _complete(client, fleet.replicas[holder].url, prompt)
        held = _cached(_complete(client, fleet.replicas[holder].url, prompt))
        assert held >= 4 * BLOCK
        fleet.restart_router()
        answered = time.monotonic()
        wait_for(lambda: _announced(fleet, theirs) >= held // BLOCK, "the restarted router took the replica's state",
                 detail=lambda: f"; {_announced(fleet, theirs)} blocks of at least {held // BLOCK}")
        print(f"\nrouter restart: its index held the replica's state {time.monotonic() - answered:.2f} s after it "
              f"answered (membership_interval_s {fleet.settings.membership_interval_s:g})")
        answer = _complete(client, fleet.router.url, f"{prompt}Begin with seal {uuid.uuid4().hex[:6]}.")
        assert answer.headers[ROUTED_WORKER_HEADER] == theirs and _cached(answer) >= held
