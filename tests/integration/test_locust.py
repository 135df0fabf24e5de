"""The Locust load test runs against the real server and reports TTFT, inter-token latency and cold requests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

LOCUSTFILE = Path(__file__).resolve().parents[2] / "warmup_tools" / "sim" / "load" / "locustfile.py"


def run_locust(triton, prefix: Path, *args: str, host: str | None = None):
    from warmup_tools.sim.load.stats import read_stats_json

    proc = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--host", host or triton.grpc_url, "--headless",
         "--json-file", str(prefix), "--only-summary", "--stop-timeout", "10", *args],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_stats_json(prefix)


def test_locust_users_report_ttft_and_itl_without_failures(triton, tmp_path):
    stats = run_locust(triton, tmp_path / "run", "-u", "2", "-r", "2", "-t", "6s")
    assert stats["ttft"].requests > 0 and stats["itl"].requests > 0
    assert sum(entry.failures for entry in stats.values()) == 0
    assert stats["ttft"].percentile(0.5) > 0


@pytest.fixture(scope="module")
def front(triton):
    """The OpenAI front beside the session's server: what compose's Locust service streams through."""
    from warmup_tools.front.server import FrontServer
    from warmup_tools.front.settings import FrontSettings

    settings = FrontSettings(port=0, triton_grpc_url=triton.grpc_url, triton_metrics_url=triton.metrics_url,
                             model_repository=Path(__file__).resolve().parents[2] / "model_repository")
    with FrontServer(settings, environ={"WARMUP_ASSETS_DIR": str(triton.assets_dir)}) as server:
        yield server


@pytest.mark.parametrize("transport", ["grpc", "http", "openai"])
def test_locust_replays_a_request_log_once_and_quits(triton, tmp_path, transport, request):
    from warmup_tools.demo.prompts import SYSTEM_PROMPTS

    log = tmp_path / "requests.jsonl"
    records = [{"ts": float(i), "tenant": f"locust-{transport}-{i % 2}", "adapter": adapter,
                "prompt": f"{SYSTEM_PROMPTS[adapter]}User: replayed question {i}\nAssistant:"}
               for i, adapter in enumerate(["support", "legal", "sql"] * 4)]
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    # -t is far beyond what twelve requests need: the run must end because the log is exhausted, and
    # only after the requests still in flight on other users have been answered and counted.
    stats = run_locust(triton, tmp_path / "replay", "-u", "3", "-r", "3", "-t", "90s", "--transport", transport,
                       "--replay-log", str(log), "--max-tokens", "2",
                       host={"http": triton.http_url, "grpc": triton.grpc_url}.get(transport)
                       or request.getfixturevalue("front").url)
    generated = sum(entry.requests for name, entry in stats.items() if name.startswith("generate "))
    assert generated == len(records)
    assert sum(entry.failures for entry in stats.values()) == 0
    # Each (tenant, adapter) pair is new to the server, and the tenant is in every KV block hash, so the
    # first request of a pair cannot be served from the cache unless warm-up filled it for that tenant.
    assert "cold" in stats and stats["cold"].requests >= 1
