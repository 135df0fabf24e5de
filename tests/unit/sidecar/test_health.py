"""The sidecar's state machine, fed probe results by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from warmup_tools.sidecar.health import (
    HealthTracker,
    ModelState,
    ProbeResult,
    RecoveryResult,
    unhealthy_stub_model,
)

MODELS = ("tokenizer_cache", "embedding_cache", "lora_adapter", "ensemble")
STUB_DEAD = "Stub process 'lora_adapter_0_0' is not healthy."


def ok(at: float = 0.0) -> ProbeResult:
    return ProbeResult(True, 0.01, at)


def failed(error: str = "connection reset", at: float = 0.0) -> ProbeResult:
    return ProbeResult(False, 0.01, at, error)


def all_ok(tracker: HealthTracker) -> None:
    tracker.record_server(True)
    for model in MODELS:
        tracker.record(model, ok())


def test_not_ready_until_the_server_and_every_model_passed_a_probe():
    tracker = HealthTracker(MODELS)
    assert not tracker.readiness().ready
    tracker.record_server(True)
    tracker.record("tokenizer_cache", ok())
    readiness = tracker.readiness()
    assert not readiness.ready and "lora_adapter: not probed yet" in readiness.reason
    all_ok(tracker)
    assert tracker.readiness().ready and tracker.readiness().reason == ""


def test_server_not_ready_wins():
    tracker = HealthTracker(MODELS)
    all_ok(tracker)
    tracker.record_server(False, "tritonserver not reachable: connection refused")
    assert tracker.readiness() == tracker.readiness().__class__(False, "tritonserver not reachable: connection refused")


def test_one_failed_probe_makes_it_unready_but_is_not_yet_worth_a_reload():
    tracker = HealthTracker(MODELS, failures_to_recover=3)
    all_ok(tracker)
    tracker.record("embedding_cache", failed("deadline exceeded"))
    assert tracker.health["embedding_cache"].state is ModelState.FAILING
    assert not tracker.readiness().ready and "deadline exceeded" in tracker.readiness().reason
    assert tracker.to_recover(now=1.0) == []
    tracker.record("embedding_cache", ok())
    assert tracker.readiness().ready


def test_n_failures_in_a_row_ask_for_a_reload():
    tracker = HealthTracker(MODELS, failures_to_recover=3)
    all_ok(tracker)
    for _ in range(2):
        tracker.record("tokenizer_cache", failed())
    assert tracker.to_recover(now=1.0) == []
    tracker.record("tokenizer_cache", failed())
    assert tracker.to_recover(now=1.0) == ["tokenizer_cache"]
    assert "3 probes failed in a row" in tracker.health["tokenizer_cache"].recovery_reason


def test_a_stub_error_asks_for_a_reload_at_once():
    tracker = HealthTracker(MODELS, failures_to_recover=3)
    all_ok(tracker)
    tracker.record("lora_adapter", failed(STUB_DEAD))
    assert tracker.to_recover(now=1.0) == ["lora_adapter"]


def test_a_stub_error_seen_through_the_ensemble_marks_the_model_that_owns_the_stub():
    tracker = HealthTracker(MODELS, failures_to_recover=3)
    all_ok(tracker)
    tracker.record("ensemble", failed(f"in ensemble 'ensemble', {STUB_DEAD}"))
    assert tracker.health["ensemble"].state is ModelState.FAILING
    assert tracker.to_recover(now=1.0) == ["lora_adapter"]
    tracker.record("lora_adapter", failed(STUB_DEAD))  # the first reason is kept
    assert tracker.health["lora_adapter"].recovery_reason.startswith("in ensemble")


def test_ready_again_only_after_the_reload_and_a_passing_probe():
    tracker = HealthTracker(MODELS)
    all_ok(tracker)
    tracker.record("lora_adapter", failed(STUB_DEAD))
    tracker.recovery_started("lora_adapter")
    tracker.record("lora_adapter", failed("model unavailable"))  # probes during the reload change nothing
    assert tracker.health["lora_adapter"].state is ModelState.RECOVERING
    assert not tracker.readiness().ready
    tracker.recovery_finished(RecoveryResult("lora_adapter", True, 10.0, 11.0))
    readiness = tracker.readiness()
    assert not readiness.ready and "reloaded in 11.0s, waiting for a probe to pass" in readiness.reason
    assert tracker.to_recover(now=30.0) == []
    tracker.record("lora_adapter", ok())
    assert tracker.readiness().ready
    assert tracker.health["lora_adapter"].recoveries == 1
    assert tracker.snapshot()["last_recovery"]["duration_s"] == 11.0


def test_a_failed_reload_is_retried_after_a_growing_backoff():
    tracker = HealthTracker(MODELS, recovery_backoff_s=5.0, max_backoff_s=8.0)
    all_ok(tracker)
    tracker.record("lora_adapter", failed(STUB_DEAD))
    tracker.recovery_started("lora_adapter")
    tracker.recovery_finished(RecoveryResult("lora_adapter", False, 100.0, 1.0, "HTTP 403"))
    assert tracker.health["lora_adapter"].state is ModelState.RECOVERY_FAILED
    assert "reload failed: HTTP 403" in tracker.readiness().reason
    tracker.record("lora_adapter", failed(STUB_DEAD))  # still dead: stays in backoff
    assert tracker.to_recover(now=105.0) == []
    assert tracker.to_recover(now=106.0) == ["lora_adapter"]
    tracker.recovery_started("lora_adapter")
    tracker.recovery_finished(RecoveryResult("lora_adapter", False, 200.0, 1.0, "HTTP 403"))
    assert tracker.to_recover(now=208.5) == []
    assert tracker.to_recover(now=209.0) == ["lora_adapter"]  # 10 s capped at 8 s


def test_stub_error_parsing():
    assert unhealthy_stub_model(STUB_DEAD, MODELS) == "lora_adapter"
    assert unhealthy_stub_model("Stub process 'embedding_cache_0_1' is not healthy.", MODELS) == "embedding_cache"
    assert unhealthy_stub_model("Stub process 'other_0_0' is not healthy.", MODELS) is None
    assert unhealthy_stub_model("deadline exceeded", MODELS) is None


def test_a_probe_the_server_rejects_makes_it_unready_but_never_reloads():
    tracker = HealthTracker(MODELS, failures_to_recover=2)
    all_ok(tracker)
    for _ in range(5):
        tracker.record("embedding_cache", ProbeResult(False, 0.01, 0.0, "input 'tenant_id' is not a valid name",
                                                      rejected=True))
    assert not tracker.readiness().ready and "not a valid name" in tracker.readiness().reason
    assert tracker.to_recover(now=1.0) == []


def test_the_probe_tenant_is_a_name_the_models_accept():
    from warmup_tools.common.records import PROBE_TENANT
    from warmup_tools.triton.inputs import IDENTITY_PATTERN

    assert IDENTITY_PATTERN.fullmatch(PROBE_TENANT) and len(PROBE_TENANT) <= 64


def test_a_model_that_never_passes_after_its_reloads_is_reloaded_ever_more_slowly():
    tracker = HealthTracker(MODELS, recovery_backoff_s=5.0, max_backoff_s=60.0)
    all_ok(tracker)
    waits = []
    start = 0.0
    for _ in range(4):
        tracker.record("lora_adapter", failed(STUB_DEAD))
        due_at = next(t / 2 for t in range(int(start) * 2, 10_000) if tracker.to_recover(now=t / 2))
        waits.append(due_at - start)
        tracker.recovery_started("lora_adapter")
        tracker.recovery_finished(RecoveryResult("lora_adapter", True, due_at, 1.0))
        start = due_at + 1.0
    assert waits == [0.0, 5.0, 10.0, 20.0]
    tracker.record("lora_adapter", ok())  # a passing probe forgets the history
    tracker.record("lora_adapter", failed(STUB_DEAD))
    assert tracker.to_recover(now=start) == ["lora_adapter"]


def test_in_trust_mode_probes_carry_the_probe_tenant_s_key_and_a_fresh_signed_token(tmp_path):
    from warmup_tools.common.records import PROBE_TENANT
    from warmup_tools.sidecar.app import _probe_credentials
    from warmup_tools.sidecar.probes import _probe_requests
    from warmup_tools.triton.trust import TenantAuthError, TenantTrust, add_tenant_key

    assert _probe_credentials({}) == {}
    secret, keys = tmp_path / "secret", tmp_path / "keys.json"
    key = add_tenant_key(keys, secret, PROBE_TENANT)
    now = [1_800_000_000.0]
    creds = _probe_credentials({"WARMUP_DEPLOYMENT_SECRET_FILE": str(secret), "WARMUP_PROBE_TENANT_KEY": key},
                               clock=lambda: now[0])
    trust = TenantTrust.from_files(secret, keys, model="lora_adapter")
    trust.verify_key(PROBE_TENANT, creds["tenant_key"])
    requests = _probe_requests(PROBE_TENANT.encode(), creds["tenant_key"], creds["tenant_token"]())
    names = {model: {name for name, _, _ in r.inputs} for model, r in requests.items()}
    assert "tenant_key" in names["tokenizer_cache"] and "tenant_key" in names["ensemble"]
    lora_token = next(a for n, a, _ in requests["lora_adapter"].inputs if n == "tenant_token")
    assert trust.tenant_of({"tenant_token": lora_token}, own_sample=False, now=now[0]) == PROBE_TENANT
    # Tokens expire: the sidecar makes a new one for every probe, so a probe an hour later still passes.
    now[0] += 3600
    with pytest.raises(TenantAuthError):
        trust.tenant_of({"tenant_token": lora_token}, own_sample=False, now=now[0])
    fresh = np.array([creds["tenant_token"]().encode()], dtype=object)
    assert trust.tenant_of({"tenant_token": fresh}, own_sample=False, now=now[0]) == PROBE_TENANT


def test_in_open_mode_probes_prove_the_probe_tenant_with_the_per_start_secret(tmp_path):
    from warmup_tools.common.records import PROBE_TENANT
    from warmup_tools.server.process import RepositoryKey, TritonDistribution, TritonServer
    from warmup_tools.sidecar.app import _probe_credentials
    from warmup_tools.triton.trust import TenantTrust

    key = RepositoryKey.generate()
    creds = _probe_credentials({}, key, clock=lambda: 1_800_000_000.0)
    # The server started with this key hands its models the same secret (WARMUP_PROBE_SECRET).
    server = TritonServer(tmp_path, repository_key=key, work_dir=tmp_path / "w")
    probe_secret = server.environment(TritonDistribution(Path("/bin/tritonserver"), Path("/b")))["WARMUP_PROBE_SECRET"]
    assert probe_secret == creds["tenant_key"] == key.probe_secret() != RepositoryKey.generate().probe_secret()
    first = TenantTrust.from_files(None, probe_secret=probe_secret)
    later = TenantTrust.from_files(None, model="embedding_cache", probe_secret=probe_secret)
    claim = {"tenant_id": np.array([PROBE_TENANT.encode()], dtype=object)}
    assert first.first_step_tenant({**claim, "tenant_key": np.array([creds["tenant_key"].encode()], dtype=object)},
                                   own_sample=False) == PROBE_TENANT
    token = np.array([creds["tenant_token"]().encode()], dtype=object)
    assert later.tenant_of({**claim, "tenant_token": token}, own_sample=False, now=1_800_000_000.0) == PROBE_TENANT


def test_the_status_is_also_prometheus_text():
    from prometheus_client.parser import text_string_to_metric_families

    from warmup_tools.sidecar.endpoints import prometheus_text

    status = {"ready": False, "models": {
        "lora_adapter": {"state": "recovering", "last_probe": {"latency_ms": 12.5}, "recoveries": 2,
                         "failed_recoveries": 1},
        "ensemble": {"state": "healthy", "last_probe": None, "recoveries": 0, "failed_recoveries": 0}}}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(prometheus_text(status)) for s in f.samples}
    assert samples[("warmup_sidecar_ready", ())] == 0
    assert samples[("warmup_sidecar_model_healthy", (("model", "ensemble"),))] == 1
    assert samples[("warmup_sidecar_model_healthy", (("model", "lora_adapter"),))] == 0
    assert samples[("warmup_sidecar_probe_latency_seconds", (("model", "lora_adapter"),))] == 0.0125
    assert samples[("warmup_sidecar_recoveries", (("model", "lora_adapter"),))] == 2
