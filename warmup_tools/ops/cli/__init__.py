"""Command line: ``python -m warmup_tools <command>`` (or the ``warmup-tools`` console script).

One module per command group (:mod:`.serving`, :mod:`.fleet`, :mod:`.plans`, :mod:`.tools`, :mod:`.bench`),
each adding its commands; their flags come from the settings classes and functions they call
(:mod:`warmup_tools.common.flags`; a command's own options: :mod:`.options`), so no default is written here.
"""

from __future__ import annotations

import argparse
import logging
import sys

from warmup_tools.common.errors import WarmupToolsError
from warmup_tools.ops.cli import bench, fleet, plans, serving, tools
from warmup_tools.ops.cli.bench import bench_options
from warmup_tools.ops.cli.fleet import fleet_settings
from warmup_tools.ops.cli.plans import PLAN_ACTIONS
from warmup_tools.ops.cli.serving import front_settings, sidecar_config

__all__ = ["PLAN_ACTIONS", "bench_options", "fleet_settings", "front_settings", "main", "parser", "sidecar_config"]

LOGGER = logging.getLogger("warmup_tools")
#: The command groups, in the order ``--help`` lists their commands.
GROUPS = (serving, fleet, plans, tools, bench)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    words = [i for i, a in enumerate(argv) if not a.startswith("-")]
    if len(words) >= 2 and argv[words[0]] == "plan" and argv[words[1]] in PLAN_ACTIONS and words[1] == words[0] + 1:
        # NOTE: `plan` takes log paths as positionals, so its actions are parsed by their own parser (a log
        # file named like an action is given as ./history).
        command_line = plans.actions_parser()
        del argv[words[0]]
    else:
        command_line = parser(argv)
    args = command_line.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not args.verbose:  # NOTE: httpx logs every request at INFO: a benchmark's figures would drown in them
        logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return int(args.func(args) or 0)
    except WarmupToolsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """Every command's parser (``plan``'s actions have their own: :func:`plans.actions_parser`). ``argv``: the
    command line it is for (only the benchmark it names, if any, gets its flags; None: every one)."""
    root = argparse.ArgumentParser(prog="warmup_tools", description=__doc__.splitlines()[0])
    root.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = root.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        if group is bench:
            bench.add_commands(sub, argv)
        else:
            group.add_commands(sub)
    return root


_parser = parser  # the name the tests of other packages import
