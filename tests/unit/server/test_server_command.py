"""The tritonserver command line the launcher builds (no server is started)."""

from __future__ import annotations

from pathlib import Path

from warmup_tools.server.process import RepositoryKey, ServerPorts, TritonDistribution, TritonServer


def command(tmp_path: Path, **options: object) -> list[str]:
    server = TritonServer(tmp_path, ports=ServerPorts(1, 2, 3), work_dir=tmp_path, **options)
    return server.command(TritonDistribution(Path("/bin/tritonserver"), Path("/backends")))


def test_default_mode_has_no_model_control_and_no_restriction(tmp_path):
    cmd = command(tmp_path)
    assert not [arg for arg in cmd if "model-control" in arg or "restricted" in arg]


def test_sidecar_mode_loads_every_model_explicitly_and_restricts_the_repository_api(tmp_path):
    key = RepositoryKey("warmup-repository-key", "s3cret")
    cmd = command(tmp_path, explicit_model_control=True, repository_key=key)
    assert "--model-control-mode=explicit" in cmd and "--load-model=*" in cmd
    assert "--http-restricted-api=model-repository:warmup-repository-key=s3cret" in cmd
    assert "--grpc-restricted-protocol=model-repository:warmup-repository-key=s3cret" in cmd
    assert "s3cret" not in repr(key)


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
