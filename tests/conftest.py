"""Shared fixtures: the demo assets and one real tritonserver per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import warmup_tools  # noqa: F401  NOTE: first, so that gRPC's fork support is off before any test module imports grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
ASSETS_DIR = Path(os.environ.get("WARMUP_ASSETS_DIR", REPO_ROOT / ".assets"))


@pytest.fixture(scope="session")
def demo_assets():
    from warmup_tools.demo.assets import ensure_demo_assets

    return ensure_demo_assets(ASSETS_DIR)


@pytest.fixture(scope="session")
def served_assets(demo_assets, tmp_path_factory):
    """An assets folder for the test server: the demo LM and embedder, and a private adapter root
    (copies of the demo adapters) where tests may add adapters."""
    import shutil

    root = tmp_path_factory.mktemp("served_assets")
    (root / "lm").symlink_to(demo_assets.lm_dir)
    (root / "embedder").symlink_to(demo_assets.embedder_dir)
    shutil.copytree(demo_assets.adapter_root, root / "adapters")
    return root


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server for the test server's shared cache tier (a test may stop and restart it)."""
    from tests.redis_support import REDIS_SERVER, RedisServer, free_port

    if REDIS_SERVER is None:
        pytest.fail("redis-server is not on PATH: `make test` installs it (apt-get install redis-server)")
    server = RedisServer(free_port(), tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def triton(served_assets, redis_server, tmp_path_factory):
    """The project's model repository served by a real tritonserver on free ports."""
    import shutil
    import tempfile

    from warmup_tools.server.client import scrape_metrics
    from warmup_tools.server.process import TritonServer

    control_dir = tmp_path_factory.mktemp("control")
    request_log_dir = tmp_path_factory.mktemp("request_log")
    kv_events_dir = Path(tempfile.mkdtemp(prefix="wkv-"))  # NOTE: short, as a unix socket's path must be
    server = TritonServer(
        REPO_ROOT / "model_repository",
        env={"WARMUP_ASSETS_DIR": str(served_assets), "WARMUP_CONTROL_DIR": str(control_dir),
             "WARMUP_REDIS_URL": redis_server.url,
             "WARMUP_REQUEST_LOG_DIR": str(request_log_dir), "WARMUP_KV_EVENTS_DIR": str(kv_events_dir)},
        work_dir=tmp_path_factory.mktemp("triton"),
        log_verbose=1,
    )
    server.control_dir = control_dir
    server.request_log_dir = request_log_dir
    server.assets_dir = served_assets
    server.kv_events_dir = kv_events_dir
    server.start()
    try:
        server.wait_ready(timeout=600)
        # What the warm-up samples left behind, before any test sends a request.
        server.metrics_at_ready = scrape_metrics(server.metrics_url)
        yield server
        # Zero cross-tenant KV hits over the whole suite (the prefix cache refuses and counts any).
        crossed = sum(v for (name, _), v in scrape_metrics(server.metrics_url).items()
                      if name == "warmup_kv_cross_tenant_hits_total")
        assert crossed == 0, f"{crossed} KV blocks written for one tenant were offered to another"
    finally:
        server.stop()
        shutil.rmtree(kv_events_dir, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    server = item.funcargs.get("triton") if hasattr(item, "funcargs") else None
    if report.failed and server is not None:
        report.sections.append(("tritonserver log (tail)", server.log_tail(80)))
