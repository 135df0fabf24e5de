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
