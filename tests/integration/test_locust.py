"""The Locust load test runs against the real server and reports TTFT and inter-token latency."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

LOCUSTFILE = Path(__file__).resolve().parents[2] / "warmup_tools" / "load" / "locustfile.py"


def test_locust_users_report_ttft_and_itl_without_failures(triton, tmp_path):
    prefix = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--host", triton.grpc_url, "--headless",
         "-u", "2", "-r", "2", "-t", "6s", "--csv", str(prefix), "--only-summary", "--stop-timeout", "10"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(f"{prefix}_stats.csv") as handle:
        rows = {row["Name"]: row for row in csv.DictReader(handle)}
    assert int(rows["ttft"]["Request Count"]) > 0 and int(rows["itl"]["Request Count"]) > 0
    assert int(rows["Aggregated"]["Failure Count"]) == 0
    assert float(rows["ttft"]["Median Response Time"]) > 0
