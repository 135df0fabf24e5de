"""The tritonserver command line the launcher builds (no server is started)."""

from __future__ import annotations

from pathlib import Path

from warmup_tools.server.process import RepositoryKey, ServerPorts, TritonDistribution, TritonServer


def command(tmp_path: Path, **options: object) -> list[str]:
    server = TritonServer(tmp_path, ports=ServerPorts(1, 2, 3), work_dir=tmp_path, **options)
    return server.command(TritonDistribution(Path("/bin/tritonserver"), Path("/backends")))


def test_default_mode_has_no_model_control_and_still_restricts_the_admin_apis(tmp_path):
    cmd = command(tmp_path)
    assert not [arg for arg in cmd if "model-control" in arg]
    # A server started without a key is restricted with one nobody holds: its own, never printed.
    server = TritonServer(tmp_path, ports=ServerPorts(1, 2, 3), work_dir=tmp_path)
    restricted = [a for a in cmd if a.startswith(("--http-restricted-api=", "--grpc-restricted-protocol="))]
    assert len(restricted) == 2 and server.repository_key.value not in repr(server.repository_key)


def test_sidecar_mode_loads_every_model_explicitly_and_restricts_every_admin_api(tmp_path):
    key = RepositoryKey("warmup-repository-key", "s3cret")
    cmd = command(tmp_path, explicit_model_control=True, repository_key=key)
    assert "--model-control-mode=explicit" in cmd and "--load-model=*" in cmd
    groups = "shared-memory,logging,trace,statistics,model-repository"
    assert f"--http-restricted-api={groups}:warmup-repository-key=s3cret" in cmd
    assert f"--grpc-restricted-protocol={groups}:warmup-repository-key=s3cret" in cmd
    assert "s3cret" not in repr(key)
    assert key.grpc_headers() == {"triton-grpc-protocol-warmup-repository-key": "s3cret"}


def test_http_and_grpc_listen_on_the_loopback_unless_told_and_metrics_where_told(tmp_path):
    from warmup_tools.server.config import ServeConfig

    cmd = command(tmp_path, host=ServeConfig().host)
    assert "--http-address=127.0.0.1" in cmd and "--grpc-address=127.0.0.1" in cmd
    assert "--metrics-address=127.0.0.1" in cmd  # empty metrics_host: the host's, as tritonserver does
    server = TritonServer(tmp_path, ports=ServerPorts(1, 2, 3), work_dir=tmp_path, metrics_host="0.0.0.0")
    assert "--metrics-address=0.0.0.0" in server.command(TritonDistribution(Path("/t"), Path("/b")))
    assert server.metrics_url == "http://127.0.0.1:3/metrics" and server.http_url == "127.0.0.1:1"


def test_what_counts_as_the_loopback():
    from warmup_tools.server.process import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.7") and not is_loopback("triton")


def test_generated_keys_differ_per_run():
    assert RepositoryKey.generate().value != RepositoryKey.generate().value


def test_stubs_import_this_checkouts_package(tmp_path, monkeypatch):
    import os

    import warmup_tools

    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    server = TritonServer(tmp_path, ports=ServerPorts(1, 2, 3), work_dir=tmp_path)
    env = server.environment(TritonDistribution(Path("/bin/tritonserver"), Path("/backends")))
    first, *rest = env["PYTHONPATH"].split(os.pathsep)
    assert Path(first) == Path(warmup_tools.__file__).resolve().parents[1] and rest == ["/elsewhere"]

