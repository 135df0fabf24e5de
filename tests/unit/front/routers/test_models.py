def test_models_lists_the_base_model_and_live_adapters_only(client):
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["base", "sql"]
    assert data[1]["parent"] == "base" and data[1]["object"] == "model"
    assert client.get("/v1/models/sql").json()["id"] == "sql"


def test_a_warming_adapter_is_404_with_its_reason(client):
    for response in (client.get("/v1/models/legal"),
                     client.post("/v1/completions", json={"model": "legal", "prompt": "x"})):
        assert response.status_code == 404
        assert "is warming" in response.json()["error"]["message"]
        assert response.json()["error"]["code"] == "model_not_found"


def test_health_follows_the_readiness_and_metrics_use_vllm_names(client, engine):
    assert client.get("/health").status_code == 200
    text = client.get("/metrics").text
    assert 'vllm:num_requests_running{model_name="base"} 3.0' in text
    assert 'vllm:num_requests_waiting{model_name="base"} 1.0' in text
    assert 'vllm:kv_cache_usage_perc{model_name="base"} 0.25' in text
    assert "warmup_front_requests_in_flight 0.0" in text and "warmup_front_requests_total " in text
    assert 'vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""}' in text
    engine.ready = False
    response = client.get("/health")
    assert response.status_code == 503
    assert "failing its probes" in response.json()["error"]["message"]
    answer = client.post("/v1/completions", json={"model": "base", "prompt": "x"})
    assert answer.status_code == 503 and answer.json()["error"]["type"] == "service_unavailable"


def test_health_carries_the_sidecars_temperature_when_it_has_one(client, engine):
    assert client.get("/health").content == b""  # no sidecar: the status alone, as vLLM's /health
    engine.temperature = {"temperature": "warm", "adapters": {"sql": "hot"}}
    response = client.get("/health")
    assert response.status_code == 200 and response.json() == {"temperature": "warm", "adapters": {"sql": "hot"}}


def test_every_route_is_served_under_a_model_prefix_too(client):
    assert client.get("/m/sql/health").status_code == 200
    answer = client.post("/m/sql/v1/completions", json={"model": "sql", "prompt": "x"})
    assert answer.status_code == 200 and answer.json()["model"] == "sql"
    assert client.get("/m/sql/v1/models").json()["data"][0]["id"] == "base"
    assert client.get("/m/").status_code == 404


def test_in_trust_mode_health_and_metrics_name_no_adapter_to_a_caller_without_a_key(engine, tmp_path):
    from tests.unit.front.conftest import make_client
    from warmup_tools.triton.trust import add_tenant_key

    keys_file = tmp_path / "tenant_keys.json"
    key = add_tenant_key(keys_file, tmp_path / "deployment.secret", "acme")
    engine.temperature = {"temperature": "warm", "adapters": {"sql": "hot"}}
    with make_client(engine, tenant_keys_file=keys_file) as client:
        for who in ({}, {"Authorization": "Bearer not-a-key"}):
            health = client.get("/health", headers=who)
            assert health.status_code == 200 and health.content == b""  # the status a load balancer needs
            text = client.get("/metrics", headers=who).text
            assert 'vllm:num_requests_waiting{model_name="base"} 1.0' in text  # what routers and the HPA read
            assert "vllm:lora_requests_info" not in text and "sql" not in text
        keyed = {"Authorization": f"Bearer {key}"}
        assert client.get("/health", headers=keyed).json() == {"temperature": "warm", "adapters": {"sql": "hot"}}
        assert 'vllm:lora_requests_info{max_lora="1"' in client.get("/metrics", headers=keyed).text
        engine.ready = False
        anonymous = client.get("/health")
        assert anonymous.status_code == 503 and "failing its probes" not in anonymous.text
        assert "failing its probes" in client.get("/health", headers=keyed).json()["error"]["message"]
