"""The command line is derived from the settings: each command's flags, help and environment variables come
from the fields of the settings classes it takes; the settings own every default."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest

from warmup_tools.common.flags import flag_of, settings_from_args
from warmup_tools.common.settings import env_name, spec_of
from warmup_tools.control.plan_history import PlanHistorySettings
from warmup_tools.fleet.settings import FleetSettings
from warmup_tools.front.settings import FrontSettings
from warmup_tools.ops.cli import main, parser
from warmup_tools.ops.cli.fleet import ROUTER_FIELDS
from warmup_tools.ops.cli.serving import FRONT_BESIDE
from warmup_tools.server.config import ServeConfig
from warmup_tools.sidecar.config import SidecarConfig

CLI = Path(__file__).resolve().parents[3] / "warmup_tools" / "ops" / "cli"
ALL = None
BESIDE = {f.name for f in dataclasses.fields(FrontSettings)} - set(FRONT_BESIDE)
#: Each command, the settings classes it takes and which of their fields are its flags (ALL: every one).
COMMANDS = {
    "serve": [(ServeConfig, ALL), (FrontSettings, BESIDE)],
    "sidecar": [(ServeConfig, ALL), (SidecarConfig, ALL), (FrontSettings, BESIDE)],
    "front": [(FrontSettings, ALL)],
    "demo": [(ServeConfig, ALL)],
    "fleet": [(FleetSettings, ALL)],
    "router": [(FleetSettings, set(ROUTER_FIELDS))],
    "apply-plan": [(PlanHistorySettings, ALL)],
}


def subparsers(root: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found = {}
    for action in root._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[name] = sub
                found.update({f"{name} {k}": v for k, v in subparsers(sub).items()})
    return found


def fields_of(cls: type, wanted: set[str] | None) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if spec_of(f) and (wanted is None or f.name in wanted)]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_names_every_field_of_the_settings_a_command_takes_with_its_variable(command, capsys):
    with pytest.raises(SystemExit):
        parser().parse_args([*command.split(), "--help"])
    text = capsys.readouterr().out
    for cls, wanted in COMMANDS[command]:
        for field in fields_of(cls, wanted):
            assert flag_of(field.name, spec_of(field)) in text, (command, field.name)
            assert env_name(cls, field.name) in " ".join(text.split()).replace("- ", "-"), (command, field.name)


def test_no_default_is_written_in_the_command_line():
    """A flag of a setting or of a benchmark's parameter defaults to None: what is not given comes from the
    settings (or the signature), never from the parser."""
    for name, sub in subparsers(parser()).items():
        for action in sub._actions:
            if re.search(r"\((default [^)]*|[^)]*; WARMUP_[A-Z_]+)\)$", action.help or ""):
                assert action.default is None, (name, action.option_strings)


def test_no_function_of_the_command_line_is_over_80_lines():
    for path in CLI.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno + 1 <= 80, f"{path.name}: {node.name}"


@pytest.mark.parametrize("cls, command, field, flag_value, value", [
    (ServeConfig, "serve", "http_port", "9100", 9100),
    (SidecarConfig, "sidecar", "probe_interval_s", "0.5", 0.5),
    (FrontSettings, "front", "max_messages", "12", 12),
    (FleetSettings, "fleet", "replicas", "3", 3),
])
def test_a_file_the_environment_and_a_flag_each_reach_the_settings_in_that_order(tmp_path, monkeypatch, cls, command,
                                                                                   field, flag_value, value):
    default = getattr(cls(), field)
    file = tmp_path / "settings.json"
    other = 7 if isinstance(default, int) else 0.75
    file.write_text(json.dumps({field: other}))
    file_flag = "--config" if cls is ServeConfig else f"--{cls.section.lower()}-config"
    flag = flag_of(field, spec_of(next(f for f in dataclasses.fields(cls) if f.name == field)))
    read = lambda *extra: settings_from_args(cls, parser().parse_args([command, *extra]))  # noqa: E731
    monkeypatch.delenv(env_name(cls, field), raising=False)
    assert getattr(read(), field) == default
    assert getattr(read(file_flag, str(file)), field) == other
    monkeypatch.setenv(env_name(cls, field), "5")
    assert getattr(read(file_flag, str(file)), field) == 5
    assert getattr(read(file_flag, str(file), flag, flag_value), field) == value


def test_the_sidecar_reads_its_own_variables_and_a_bad_value_is_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("WARMUP_SIDECAR_CANARY_JUDGE", "false")
    monkeypatch.setenv("WARMUP_SIDECAR_MODELS", "tokenizer_cache,ensemble")
    settings = settings_from_args(SidecarConfig, parser().parse_args(["sidecar"]))
    assert settings.canary_judge is False and settings.models == ("tokenizer_cache", "ensemble")
    assert settings_from_args(SidecarConfig, parser().parse_args(["sidecar", "--canary-judge"])).canary_judge is True
    monkeypatch.setenv("WARMUP_SIDECAR_PROBE_TIMEOUT_S", "soon")
    assert main(["sidecar", "--control-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: probe_timeout_s='soon'") and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_a_file_value_of_the_wrong_type_is_refused_naming_it(tmp_path):
    from warmup_tools.common.errors import ConfigError
    from warmup_tools.common.settings import load_settings

    file = tmp_path / "front.json"
    for bad in ({"port": "ninety"}, {"port": True}, {"port": 9000.5}, {"pipeline": 3}, {"model_repository": 5}):
        file.write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=next(iter(bad))):
            load_settings(FrontSettings, file, env={})
    file.write_text(json.dumps({"port": 9001, "model_repository": "repo", "max_stop": 2}))
    settings = load_settings(FrontSettings, file, env={})
    assert (settings.port, settings.model_repository, settings.max_stop) == (9001, Path("repo"), 2)


def test_an_empty_flag_or_variable_clears_an_optional_path(monkeypatch):
    monkeypatch.setenv("WARMUP_SNAPSHOT_DIR", "/tmp/snapshots")
    args = parser().parse_args(["serve", "--control-dir", ""])
    config = settings_from_args(ServeConfig, args)
    assert config.control_dir is None and config.snapshot_dir == Path("/tmp/snapshots")
