import json
import subprocess
import sys
from pathlib import Path

import pytest

from warmup_tools.common.errors import ConfigError
from warmup_tools.front.settings import FrontSettings
from warmup_tools.ops.cli import _parser, front_settings

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("field, value", [("port", 70000), ("pipeline", "direct"), ("max_body_bytes", 10),
                                          ("poll_interval_s", 0), ("served_model_name", ""),
                                          ("triton_grpc_url", "localhost")])
def test_a_setting_out_of_its_bound_is_refused_naming_it(field, value):
    with pytest.raises(ConfigError, match=field):
        FrontSettings(**{field: value})


def test_the_front_command_reads_file_then_environment_then_flags(tmp_path, monkeypatch):
    config = tmp_path / "front.json"
    config.write_text(json.dumps({"port": 9100, "served_model_name": "llama", "max_messages": 8}))
    monkeypatch.setenv("WARMUP_FRONT_PORT", "9200")
    monkeypatch.setenv("WARMUP_PORT", "1")  # serve's names never reach the front
    args = _parser().parse_args(["front", "--front-config", str(config), "--triton-grpc-url", "triton:8001",
                                 "--pipeline", "ensemble", "--served-model-name", "base"])
    settings = front_settings(args)
    assert (settings.port, settings.served_model_name, settings.max_messages) == (9200, "base", 8)
    assert (settings.triton_grpc_url, settings.pipeline) == ("triton:8001", "ensemble")


def test_serve_and_sidecar_start_the_front_unless_told_not_to():
    from warmup_tools.common.flags import options_from_args
    from warmup_tools.ops.cli.options import BesideOptions

    assert options_from_args(BesideOptions, _parser().parse_args(["serve"])).front is True
    assert options_from_args(BesideOptions, _parser().parse_args(["sidecar", "--no-front"])).front is False


def test_the_front_raises_the_soft_limit_on_open_files_to_hold_its_connections():
    """In a process of its own: the test lowers the soft limit first, as a host with ``ulimit -n 1024`` has it."""
    script = (
        "import resource\n"
        "from tests.unit.front.conftest import ScriptedEngine\n"
        "from warmup_tools.front.server import FILES_BESIDE_CONNECTIONS, FrontServer\n"
        "from warmup_tools.front.settings import FrontSettings\n"
        "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))\n"
        "wanted = 2048 + FILES_BESIDE_CONNECTIONS\n"
        "with FrontServer(FrontSettings(port=0, max_connections=2048), engine=ScriptedEngine()):\n"
        "    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]\n"
        "print(soft == (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.stdout.strip() == "True", done.stderr
