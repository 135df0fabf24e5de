"""The server object: readiness, logs, stop, and that no tritonserver or stub outlives its owner."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.waiting import wait_for
from warmup_tools.common.errors import ServerError
from warmup_tools.server.process import TritonServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ECHO_CONFIG = """
name: "echo"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""
ECHO_MODEL = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        {init}

    def execute(self, requests):
        return [pb_utils.InferenceResponse(
                    [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())])
                for r in requests]
"""


def make_repo(root, init="pass"):
    model = root / "echo"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(ECHO_CONFIG)
    (model / "1" / "model.py").write_text(ECHO_MODEL.replace("{init}", init))
    return root


def group_alive(pgid):
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_start_ready_stop_leaves_no_process(tmp_path):
    server = TritonServer(make_repo(tmp_path / "repo"), work_dir=tmp_path / "work")
    with server:
        server.wait_ready(timeout=120)
        pgid = server.pid
        assert group_alive(pgid)
        assert "echo" in server.logs()
    assert not server.is_alive()
    wait_for(lambda: not group_alive(pgid), "no tritonserver or stub left after stop()", timeout_s=120)


def test_model_that_fails_to_load_gives_a_clear_error_with_the_log(tmp_path):
    repo = make_repo(tmp_path / "repo", init='raise pb_utils.TritonModelException("broken on purpose")')
    server = TritonServer(repo, work_dir=tmp_path / "work")
    with server:
        with pytest.raises(ServerError, match="broken on purpose"):
            server.wait_ready(timeout=120)
    assert not server.is_alive()


def test_server_dies_with_the_process_that_started_it(tmp_path):
    repo = make_repo(tmp_path / "repo")
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from warmup_tools.server.process import TritonServer
        server = TritonServer(Path({str(repo)!r}), work_dir=Path({str(tmp_path / 'work')!r}))
        server.start()
        server.wait_ready(timeout=120)
        print(server.pid, flush=True)
        sys.stdin.read()  # until it is killed
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    pgid = None
    try:
        pgid = int(owner.stdout.readline())
        assert group_alive(pgid)
        owner.kill()
        owner.wait(timeout=30)
        wait_for(lambda: not group_alive(pgid), "tritonserver and its stubs gone with the process that started them",
                 timeout_s=120)
    finally:
        owner.kill()
        if pgid is not None and group_alive(pgid):
            os.killpg(pgid, 9)


def test_a_bad_lora_adapter_parameter_fails_the_load_naming_the_parameter(tmp_path, demo_assets):
    import shutil

    from tests.conftest import REPO_ROOT

    repo = tmp_path / "repo"
    shutil.copytree(REPO_ROOT / "model_repository" / "lora_adapter", repo / "lora_adapter")
    env = {"WARMUP_ASSETS_DIR": str(demo_assets.root), "WARMUP_CONTROL_DIR": "", "WARMUP_WARM_SHARE": "2"}
    server = TritonServer(repo, env=env, work_dir=tmp_path / "work")
    with server:
        with pytest.raises(ServerError, match="warm_share must be > 0 and <= 1"):
            server.wait_ready(timeout=300)
    assert not server.is_alive()
