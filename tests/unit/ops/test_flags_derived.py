"""Every flag of the command line is derived from a declaration: a settings field (a process's settings or a
command's options, :mod:`warmup_tools.ops.cli.options`) or an annotated parameter of the function a command calls
(a benchmark's ``run()``). A flag written by hand beside them is a second definition of its default and help, so
the whole parser tree is walked and every hand-written argument must be on the allow-list below; one named like a
declared setting or parameter fails whatever the list says."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
import typing

import pytest

from warmup_tools.common.flags import add_options, add_settings, flag_of
from warmup_tools.common.settings import Spec, is_settings, spec_of
from warmup_tools.ops.cli import options, parser
from warmup_tools.ops.cli.bench import BENCHES, bench_run
from warmup_tools.ops.cli.plans import actions_parser
from warmup_tools.server.config import ServeConfig

#: The arguments still written by hand, as (command, option string or positional's dest). Nothing else may be:
#: a new flag is declared as a setting or an annotated parameter, and these are what a declaration cannot say.
ALLOWED = {
    # the root parsers' debug logging switch (a logging level, not a setting of anything)
    ("", "--verbose"), ("", "-v"), ("plan ACTION", "--verbose"), ("plan ACTION", "-v"),
    # positionals: what the command acts on (its help is written once, beside it)
    ("plan", "logs"), ("apply-plan", "plan"), ("plan diff", "a"), ("plan diff", "b"), ("plan rollback", "id"),
    ("plan canary", "plan"), ("adapters add", "name"), ("adapters retire", "name"), ("tenant-key", "tenant"),
}


def parsers() -> dict[str, argparse.ArgumentParser]:
    """The whole tree: every command and sub-command (every benchmark's flags), ``plan``'s actions (their own
    parser: ``plan`` takes log paths as positionals) and ``bench engine``'s command line without the CLI."""
    from warmup_tools.sim.bench.engine import command_line

    roots = {"": ("", parser(None)), "plan ACTION": ("plan", actions_parser()),
             "python -m warmup_tools.sim.bench.engine": ("", command_line())}
    found = {name: root for name, (_, root) in roots.items()}
    for prefix, root in roots.values():
        found.update(_subparsers(prefix, root))
    return found


def _subparsers(prefix: str, root: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found = {}
    for action in root._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                command = f"{prefix} {name}".strip()
                found[command] = sub
                found.update(_subparsers(command, sub))
    return found


def hand_written(tree: dict[str, argparse.ArgumentParser]) -> list[tuple[str, str, argparse.Action]]:
    """Each argument no declaration made: (command, option string or positional's dest, action)."""
    found = []
    for command, sub in tree.items():
        for action in sub._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if getattr(action, "derived_from", None) is not None:
                continue
            found += [(command, name, action) for name in (action.option_strings or [action.dest])]
    return found


def declared_names() -> dict[str, str]:
    """Every flag a declaration has (or would have): each settings class's fields and each benchmark's and each
    command function's annotated parameters, as ``--flag`` -> where it is declared."""
    parsers()  # imports every module the command line reaches, every benchmark's included
    names: dict[str, str] = {}
    classes = {cls for module in list(sys.modules.values()) if module and module.__name__.startswith("warmup_tools")
               for cls in vars(module).values() if is_settings(cls)}
    for cls in classes:
        for field in dataclasses.fields(cls):
            if (spec := spec_of(field)) is not None:
                for flag in {flag_of(field.name, spec), "--" + field.name.replace("_", "-")}:
                    names[flag] = f"{cls.__module__}.{cls.__name__}.{field.name}"
    for name in BENCHES:
        run = bench_run(name)
        hints = typing.get_type_hints(run, include_extras=True)
        for param in inspect.signature(run).parameters:
            for spec in (m for m in getattr(hints.get(param), "__metadata__", ()) if isinstance(m, Spec)):
                names[flag_of(param, spec)] = f"{run.__module__}.run({param})"
    return names


def test_no_flag_is_hand_written_where_a_setting_or_parameter_declares_it():
    declared = declared_names()
    clashes = [f"{command or 'warmup_tools'} {name}: written by hand, but {declared[name]} declares it"
               for command, name, _ in hand_written(parsers()) if name in declared]
    assert not clashes, "\n".join(clashes)


def test_every_hand_written_argument_is_on_the_allow_list():
    written = {(command, name) for command, name, _ in hand_written(parsers())}
    assert written - ALLOWED == set(), "declare these as settings or annotated parameters (or allow them here)"
    assert ALLOWED - written == set(), "no longer hand-written: drop them from ALLOWED"


def test_the_check_finds_a_hand_written_flag_of_a_setting():
    """What the first test would report: a command that writes --control-dir and --wait itself."""
    root = argparse.ArgumentParser()
    root.add_argument("--control-dir", default="/srv/control")
    root.add_argument("--wait", type=float, default=600.0)
    add_options(root, options.HistoryOptions)
    add_settings(root, ServeConfig, only=("model_repository",), file=False)
    declared = declared_names()
    found = {name for _, name, _ in hand_written({"apply-plan": root}) if name in declared}
    assert found == {"--control-dir", "--wait"}


@pytest.mark.parametrize("cls", [cls for cls, _ in options.COMMAND_OPTIONS], ids=lambda cls: cls.__name__)
def test_every_command_option_is_a_flag_of_a_command_and_owns_its_default(cls):
    """Each field of a command's options class is a flag somewhere (no dead declaration), its default None in the
    parser (the class owns it), and the class built from no flags is the class's defaults."""
    derived = {}
    for command, sub in parsers().items():
        for action in sub._actions:
            origin = getattr(action, "derived_from", "")
            if origin.startswith(cls.__name__ + "."):
                derived[origin.split(".", 1)[1]] = (command, action)
                assert action.default is None, (command, action.option_strings)
    assert set(derived) == {f.name for f in dataclasses.fields(cls)}
    required = [f for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
    for field in required:
        assert derived[field.name][1].required, field.name
    if not required:
        assert options_from_no_flags(cls) == cls()


def options_from_no_flags(cls: type) -> object:
    from warmup_tools.common.flags import options_from_args

    return options_from_args(cls, argparse.Namespace())


@pytest.mark.parametrize("argv, cls, expected", [
    (["plan", "logs", "--no-progress", "--since", "6h"], options.MakePlanOptions,
     {"progress": False, "since": 21600.0}),
    (["serve", "--no-front"], options.BesideOptions, {"front": False}),
    (["adapters", "add", "a", "--warm-prompt", "hello, world", "--warm-prompt", "x"], options.AdapterAddOptions,
     {"warm_prompt": ("hello, world", "x"), "wait": 300.0}),
    (["adapters", "retire", "a"], options.AdapterRetireOptions, {"wait": 120.0}),
    (["join", "--router", "http://r:30000", "--replica", "http://t:9000", "--once"], options.JoinOptions,
     {"once": True, "timeout_s": 1800.0, "worker_host": None}),
])
def test_flags_users_scripts_give_keep_their_meaning(argv, cls, expected):
    from warmup_tools.common.flags import options_from_args

    got = options_from_args(cls, parser(argv).parse_args(argv))
    assert {name: getattr(got, name) for name in expected} == expected


def test_plan_canary_takes_instance_once_per_instance():
    from warmup_tools.common.flags import options_from_args

    args = actions_parser().parse_args(["canary", "p.json", "--instance", "a", "--instance", "b", "--replica", "r"])
    assert options_from_args(options.CanaryOptions, args) == options.CanaryOptions(("a", "b"), "r", False)
