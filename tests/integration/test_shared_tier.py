"""The Redis tier behind the tokenizer and embedding caches, through the real server."""

from __future__ import annotations

import uuid

import pytest

from warmup_tools.server.client import GenerateParams, metric_sum, scrape_metrics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def lookups(triton, model, result):
    return metric_sum(scrape_metrics(triton.metrics_url), "warmup_cache_lookups_total", model=model, result=result)


def test_entries_reach_redis_keyed_by_tenant(triton, redis_server, grpc_client):
    text = f"Shared tier check {uuid.uuid4().hex}: what is the refund policy?"
    admin = redis_server.admin()
    before = admin.dbsize()
    grpc_client.generate(text, GenerateParams(max_tokens=1, tenant_id="acme"))
    assert admin.dbsize() > before
    keys = [k.decode() for k in admin.keys("wt:tok:*")]
    assert keys and all(len(k.split(":")) == 5 for k in keys)


def test_tenants_never_share_an_entry(triton, grpc_client):
    text = f"Tenant isolation {uuid.uuid4().hex}: summarise clause 4."
    grpc_client.generate(text, GenerateParams(max_tokens=1, tenant_id="acme"))
    hits = lookups(triton, "tokenizer_cache", "hit") + lookups(triton, "tokenizer_cache", "shared_hit")
    misses = lookups(triton, "tokenizer_cache", "miss")
    grpc_client.generate(text, GenerateParams(max_tokens=1, tenant_id="globex"))
    assert lookups(triton, "tokenizer_cache", "miss") == misses + 1
    assert lookups(triton, "tokenizer_cache", "hit") + lookups(triton, "tokenizer_cache", "shared_hit") == hits
    grpc_client.generate(text, GenerateParams(max_tokens=1, tenant_id="acme"))
    # A miss sends the local hits counted before it (they go to /metrics together), so the count is exact now.
    grpc_client.generate(f"Tenant isolation {uuid.uuid4().hex}", GenerateParams(max_tokens=1, tenant_id="acme"))
    assert lookups(triton, "tokenizer_cache", "hit") + lookups(triton, "tokenizer_cache", "shared_hit") == hits + 1


def test_redis_outage_during_load_fails_no_request_and_recovers(triton, redis_server, grpc_client):
    results = []
    try:
        for i in range(6):
            results.append(grpc_client.generate(f"before outage {i} {uuid.uuid4().hex}", GenerateParams(max_tokens=2)))
        redis_server.stop()
        for i in range(12):
            results.append(grpc_client.generate(f"during outage {i} {uuid.uuid4().hex}", GenerateParams(max_tokens=2)))
    finally:
        if redis_server.proc is None:
            redis_server.start()
    assert len(results) == 18 and all(r.output_tokens == 2 for r in results)
    # Recovery is automatic: new entries reach Redis again once the tier's retry delay has passed.
    from tests.waiting import wait_for

    admin = redis_server.admin()

    def new_entries_reach_redis():
        grpc_client.generate(f"after outage {uuid.uuid4().hex}", GenerateParams(max_tokens=1))
        return admin.dbsize() > 0

    wait_for(new_entries_reach_redis, "new entries in Redis after it came back", poll_s=0.5)
