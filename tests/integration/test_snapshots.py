"""KV snapshots across real tritonserver restarts: written at shutdown, restored before the warm-up samples run
by the next server on the same folder, and refused (with a metric) when damaged or from another model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from warmup_tools.kv.snapshot_verify import MANIFEST_SUFFIX, list_snapshots
from warmup_tools.server.client import GenerateParams, StreamingClient, metric_sum, scrape_metrics
from warmup_tools.server.process import TritonServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2] / "model_repository"
#: A prompt no warm-up sample carries (no system prompt): only a snapshot can make it warm on a new server.
HOT = ("Summarise the quarterly incident review for the platform team: three outages, two caused by "
       "expired certificates and one by a saturated connection pool; list owners, dates and follow-ups. ")
PARAMS = GenerateParams(max_tokens=8, adapter_id="sql", tenant_id="acme")


def start(served_assets, snapshots: Path, work: Path, **env: str) -> TritonServer:
    server = TritonServer(REPO, env={"WARMUP_ASSETS_DIR": str(served_assets), "WARMUP_CONTROL_DIR": "",
                                     "WARMUP_SNAPSHOT_DIR": str(snapshots), "WARMUP_SNAPSHOT_INTERVAL_S": "0",
                                     "WARMUP_SNAPSHOT_VERIFY_SHARE": "0.2", **env},
                          work_dir=work)
    server.start()
    return server


def first_request(server: TritonServer):
    with StreamingClient(server.grpc_url, timeout_s=120) as client:
        return client.generate(HOT, PARAMS)


def skipped(server: TritonServer) -> dict[str, float]:
    samples = scrape_metrics(server.metrics_url)
    return {dict(labels)["reason"]: value for (name, labels), value in samples.items()
            if name == "warmup_kv_snapshot_skipped_total" and value}


def test_a_restarted_server_serves_a_live_prefix_warm_from_the_snapshot_and_refuses_damaged_ones(
        served_assets, tmp_path):
    snapshots = tmp_path / "snapshots"
    first = start(served_assets, snapshots, tmp_path / "work1")
    try:
        first.wait_ready(timeout=600)
        cold = first_request(first)
        assert cold.cached_tokens == 0
    finally:
        first.stop()
    manifests = list_snapshots(snapshots)
    assert len(manifests) == 1, "finalize wrote no snapshot"
    manifest = json.loads(manifests[0].read_text())
    assert manifest["blocks"] and manifest["identity"]["salt_fingerprint"] == ""  # open mode: no salt

    second = start(served_assets, snapshots, tmp_path / "work2")
    try:
        second.wait_ready(timeout=600)
        warm = first_request(second)  # the first request this server sees
        samples = scrape_metrics(second.metrics_url)
        log = second.logs()
    finally:
        second.stop()
    assert warm.cached_tokens > 0, log[-3000:]
    assert warm.text == cold.text
    assert metric_sum(samples, "warmup_kv_snapshot_restored_blocks_total") >= len(manifest["blocks"]) > 0
    assert not skipped_from(samples)

    # A flipped byte in the payload: skipped with one log line and a metric, never served.
    payload = snapshots / manifest_of(snapshots)["payload"]["file"]
    data = bytearray(payload.read_bytes())
    data[len(data) // 2] ^= 0x10
    payload.write_bytes(bytes(data))
    third = start(served_assets, snapshots, tmp_path / "work3")
    try:
        third.wait_ready(timeout=600)
        refused = first_request(third)
        reasons = skipped(third)
        log = third.logs()
    finally:
        third.stop()
    assert reasons == {"checksum": 1.0}
    assert sum("KV snapshot" in line and "skipped (checksum)" in line for line in log.splitlines()) == 1
    assert refused.cached_tokens == 0 and refused.text == cold.text

    # The third server wrote a sound snapshot at shutdown; a server storing KV as INT8 must not use it.
    fourth = start(served_assets, snapshots, tmp_path / "work4", WARMUP_KV_STORAGE="int8")
    try:
        fourth.wait_ready(timeout=600)
        other = first_request(fourth)
        reasons = skipped(fourth)
    finally:
        fourth.stop()
    assert reasons == {"storage": 1.0} and other.cached_tokens == 0


def skipped_from(samples) -> dict[str, float]:
    return {dict(labels)["reason"]: value for (name, labels), value in samples.items()
            if name == "warmup_kv_snapshot_skipped_total" and value}


def manifest_of(folder: Path) -> dict:
    return json.loads(next(folder.glob(f"*{MANIFEST_SUFFIX}")).read_text())
