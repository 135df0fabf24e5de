"""Atomic writes: owner-only files by default, whatever the umask and whatever the file they replace."""

import os
import stat

import pytest

from warmup_tools.common.files import write_atomic
from warmup_tools.control.plan_control import PlanStatus, PlanStatusBoard
from warmup_tools.control.registry import ControlRegistry


def mode(path):
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(params=[0o022, 0o000], ids=["umask022", "umask000"])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def test_a_new_file_and_a_replaced_one_are_owner_only(tmp_path, umask):
    path = tmp_path / "desired.json"
    write_atomic(path, b"{}")
    assert mode(path) == 0o600
    path.chmod(0o644)  # a file an older version wrote world-readable
    write_atomic(path, b"[]")
    assert mode(path) == 0o600 and path.read_bytes() == b"[]"
    write_atomic(path, b"1", mode=0o640)  # a caller that needs more says so
    assert mode(path) == 0o640


def test_the_control_folder_files_that_carry_prompts_are_owner_only(tmp_path, umask):
    registry = ControlRegistry(tmp_path)
    registry.add("sql", ["a prompt from the request log"])
    registry.report("i0", {})
    PlanStatusBoard(tmp_path).report(PlanStatus("i0", None, "control", "none", {}))
    files = [tmp_path / "desired.json", tmp_path / "status" / "i0.json", tmp_path / "plan_status" / "i0.json"]
    assert {str(f.relative_to(tmp_path)): mode(f) for f in files} == {
        str(f.relative_to(tmp_path)): 0o600 for f in files}
