"""``plan`` (and its actions ``history``, ``diff``, ``rollback``, ``canary``), ``apply-plan``, ``stanzas`` and
``adapters``: what is warmed, and the control folder a running server reads it from."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path
from typing import Any

from warmup_tools.common.errors import ConfigError
from warmup_tools.common.flags import add_options, add_settings, options_from_args, settings_from_args
from warmup_tools.common.names import replica_name
from warmup_tools.control.plan_history import PlanHistorySettings
from warmup_tools.ops.cli.options import (
    CanaryOptions,
    DiffOptions,
    HistoryOptions,
    LiveApplyOptions,
    MakePlanOptions,
    StanzasOptions,
)
from warmup_tools.server.config import ServeConfig

#: ``plan <action>``: the plan history of a control folder (``plan LOGS...`` makes a plan).
PLAN_ACTIONS = ("history", "diff", "rollback", "canary")
#: The server's folders a command reads (its fields of ServeConfig, ``WARMUP_<FIELD>`` variables included).
REPOSITORY = ("model_repository",)
CONTROL = ("control_dir",)
#: The positional arguments, which the options classes cannot express: each one's help, once.
LOGS_HELP = "request logs (.jsonl, .jsonl.gz, rotated .jsonl.N) or folders holding them"
PLAN_FILE_HELP = "a plan file written by `plan`"


def add_commands(sub: Any) -> None:
    plan_help = ("decide what to warm from request logs; writes a versioned plan. Also `plan history`, `plan diff "
                 "A B`, `plan rollback [ID]`: the plans a control folder served, and `plan canary`: a plan on trial "
                 "on one instance or replica, promoted or rolled back by the sidecar (each has its own --help)")
    plan = sub.add_parser("plan", help=plan_help, description=plan_help)
    plan.add_argument("logs", nargs="+", type=Path, help=LOGS_HELP)
    add_settings(plan, ServeConfig, only=REPOSITORY, file=False)
    add_options(plan, MakePlanOptions)
    plan.set_defaults(func=_cmd_plan)

    apply = sub.add_parser("apply-plan", help="serve a plan on a running server without a restart (through the "
                                              "control folder); waits until every instance reports it")
    apply.add_argument("plan", type=Path, help=PLAN_FILE_HELP)
    add_settings(apply, ServeConfig, only=CONTROL + REPOSITORY, file=False)
    _live_apply_flags(apply)
    apply.set_defaults(func=_cmd_apply_plan)

    stanzas = sub.add_parser("stanzas", help="write (or --check) model_warmup stanzas in the repository")
    add_settings(stanzas, ServeConfig, only=REPOSITORY, file=False)
    add_options(stanzas, StanzasOptions)
    stanzas.set_defaults(func=_cmd_stanzas)


def actions_parser() -> argparse.ArgumentParser:
    """``plan history|diff|rollback|canary``: parsed apart, since ``plan`` takes log paths as positionals."""
    parser = argparse.ArgumentParser(prog="warmup_tools plan", description="The plans a control folder served: "
                                     "every plan applied (apply-plan, the sidecar's re-plan, a rollback) is kept "
                                     "under <control>/plans/, content-addressed, with its parent and who applied it.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    actions = parser.add_subparsers(dest="action", required=True)
    history = actions.add_parser("history", help="the plans applied, newest first: id, parent, when, by whom, items, "
                                                 "bytes")
    add_settings(history, ServeConfig, only=CONTROL, file=False)
    add_options(history, HistoryOptions)
    history.set_defaults(func=_cmd_plan_history)
    diff = actions.add_parser("diff", help="items added, kept and dropped from plan A to plan B, with KV bytes")
    diff.add_argument("a", help="a history id (or a unique prefix, or a plan_id), or a plan file")
    diff.add_argument("b", help="the same, for the plan compared with A")
    add_settings(diff, ServeConfig, only=CONTROL, file=False)
    add_options(diff, DiffOptions)
    diff.set_defaults(func=_cmd_plan_diff)
    back = actions.add_parser("rollback", help="serve again the plan the served one replaced, or a named one (checked "
                                               "against the repository, applied live like apply-plan, recorded in "
                                               "the history)")
    back.add_argument("id", nargs="?", help="the plan to go back to (default: the parent of the plan served now)")
    add_settings(back, ServeConfig, only=CONTROL + REPOSITORY, file=False)
    _live_apply_flags(back)
    back.set_defaults(func=_cmd_plan_rollback)
    canary = actions.add_parser("canary",
                                help="put a plan on trial on one lora_adapter instance of a replica, or with "
                                     "--replica alone on every instance of that replica of a fleet (the others keep "
                                     "the plan served now); the replica's sidecar promotes it or rolls it back "
                                     "(docs/planner.md); --abort ends a trial without promoting it")
    canary.add_argument("plan", nargs="?", type=Path, help="the plan file to try (checked against the repository)")
    add_settings(canary, ServeConfig, only=CONTROL + REPOSITORY, file=False)
    add_options(canary, CanaryOptions)
    canary.set_defaults(func=_cmd_plan_canary)
    return parser


def _live_apply_flags(parser: argparse.ArgumentParser) -> None:
    """What apply-plan and plan rollback share: the stanzas, the wait, the history's bound."""
    add_options(parser, LiveApplyOptions)
    add_settings(parser, PlanHistorySettings, file=False)


def _served_dirs(args: argparse.Namespace, fields: tuple[str, ...]) -> ServeConfig:
    """The server's folders a command took as flags (``--model-repository``, ``--control-dir``)."""
    served = settings_from_args(ServeConfig, args, only=fields)
    if "control_dir" in fields and served.control_dir is None:
        raise ConfigError("--control-dir (WARMUP_CONTROL_DIR) must name the lora_adapter model's control folder")
    return served


def _cmd_plan(args: argparse.Namespace) -> int:
    from warmup_tools.common.jsonl import ReadStats
    from warmup_tools.common.plan import Plan
    from warmup_tools.common.records import log_files, read_request_log
    from warmup_tools.embedding_cache.embedder import OnnxEmbedder
    from warmup_tools.planning.analyse import PlanOptions
    from warmup_tools.planning.select import build_plan, format_summary
    from warmup_tools.planning.target import PlanTarget

    opts = options_from_args(MakePlanOptions, args)
    target = PlanTarget.from_repository(_served_dirs(args, REPOSITORY).model_repository)
    given = {name: getattr(opts, name) for name in ("kv_bytes_total", "kv_bytes_per_adapter", "embedding_entries",
                                                    "tokenizer_entries", "warm_seconds")}
    budgets = target.default_budgets(**{k: v for k, v in given.items() if v is not None})
    previous = Plan.load(opts.previous) if opts.previous else None
    stats = ReadStats()
    records = list(read_request_log(log_files(args.logs), stats))
    if opts.since is not None:
        end = opts.now if opts.now is not None else max((r.ts for r in records), default=0.0)
        kept = [r for r in records if end - opts.since <= r.ts <= end]
        print(f"{len(kept)} of {len(records)} records in the last {opts.since / 3600:g} h before "
              f"{datetime.datetime.fromtimestamp(end, datetime.timezone.utc).isoformat(timespec='seconds')}",
              file=sys.stderr)
        records = kept
    options = PlanOptions(**({"arbitration": opts.arbitration} if opts.arbitration else {}),
                          replay_replicas=opts.replicas)
    plan = build_plan(records, target.load_tokenizer(), OnnxEmbedder(target.embedder),
                      budgets, now=opts.now, block_size=target.block_size,
                      kv_bytes_per_token=target.kv_bytes_per_token, progress=opts.progress, previous=previous,
                      options=options, kv=target.settings.engine.kv)
    plan.save(opts.out)
    if stats.skipped:
        print(f"skipped {stats.skipped} bad or torn log line(s) of {stats.records + stats.skipped}; first: "
              + "; ".join(str(s) for s in stats.examples[:5]), file=sys.stderr)
    print(format_summary(plan))
    print(f"plan {plan.plan_id} written to {opts.out}; apply it with "
          f"`python -m warmup_tools stanzas --plan {opts.out}`")
    return 0


def _cmd_apply_plan(args: argparse.Namespace) -> int:
    from warmup_tools.common.plan import Plan
    from warmup_tools.planning.live import apply_plan
    from warmup_tools.planning.target import PlanTarget

    dirs = _served_dirs(args, CONTROL + REPOSITORY)
    plan = Plan.load(args.plan)
    target = PlanTarget.from_repository(dirs.model_repository)
    tokenizer = target.load_tokenizer()
    entry = apply_plan(plan, dirs.control_dir, target=target, tokenizer=tokenizer,
                       inputs={"plan_file": str(args.plan)}, history=settings_from_args(PlanHistorySettings, args))
    return _served(dirs, options_from_args(LiveApplyOptions, args), plan, entry, target, tokenizer)


def _served(dirs: ServeConfig, live: LiveApplyOptions, plan: Any, entry: Any, target: Any, tokenizer: Any) -> int:
    """After apply-plan or a rollback: the history entry, the stanzas (--stanzas), each instance (--wait)."""
    from warmup_tools.planning.live import wait_applied
    from warmup_tools.planning.plan_stanzas import write_plan_stanzas

    print(f"plan {plan.plan_id} ({len(plan.items)} KV items) written to {dirs.control_dir}; history id {entry.id}, "
          f"parent {entry.parent or '-'}", flush=True)
    if live.stanzas:
        counts = write_plan_stanzas(plan, dirs.model_repository, target=target, tokenizer=tokenizer)
        print(f"stanzas of plan {plan.plan_id} written into {dirs.model_repository}: {counts}")
    if live.wait > 0:
        for instance, status in sorted(wait_applied(dirs.control_dir, plan.plan_id, instances=live.instances,
                                                    timeout_s=live.wait).items()):
            coverage = ", ".join(f"{name} {c.resident}/{c.planned}" + (f" ({c.shortfall})" if c.shortfall else "")
                                 for name, c in sorted(status.adapters.items()))
            print(f"{instance}: applied plan {status.plan_id}: {status.detail}; resident blocks: {coverage or '-'}")
    return 0


def _cmd_plan_history(args: argparse.Namespace) -> int:
    from warmup_tools.ops.plans import history_lines

    limit = options_from_args(HistoryOptions, args).limit
    print("\n".join(history_lines(_served_dirs(args, CONTROL).control_dir, limit)))
    return 0


def _cmd_plan_diff(args: argparse.Namespace) -> int:
    from warmup_tools.common.plan import Plan
    from warmup_tools.control.plan_history import PlanHistory
    from warmup_tools.ops.plans import diff_lines

    history = PlanHistory(_served_dirs(args, CONTROL).control_dir)

    def load(ref: str) -> Any:
        return Plan.load(Path(ref)) if os.sep in ref or ref.endswith(".json") else history.load(ref)

    print("\n".join(diff_lines(load(args.a), load(args.b), options_from_args(DiffOptions, args).items)))
    return 0


def _cmd_plan_rollback(args: argparse.Namespace) -> int:
    from warmup_tools.planning.live import rollback
    from warmup_tools.planning.target import PlanTarget

    dirs = _served_dirs(args, CONTROL + REPOSITORY)
    target = PlanTarget.from_repository(dirs.model_repository)
    tokenizer = target.load_tokenizer()
    settings = settings_from_args(PlanHistorySettings, args)
    plan, entry = rollback(dirs.control_dir, args.id, target=target, tokenizer=tokenizer, history=settings)
    print(f"rolled back from plan {entry.inputs.get('rolled_back') or '-'} to {entry.id}")
    return _served(dirs, options_from_args(LiveApplyOptions, args), plan, entry, target, tokenizer)


def _cmd_plan_canary(args: argparse.Namespace) -> int:
    from warmup_tools.common.plan import Plan
    from warmup_tools.control.plan_control import read_canary
    from warmup_tools.control.plan_history import applied_by
    from warmup_tools.ops.plans import canary_instances
    from warmup_tools.planning.live import check_plan
    from warmup_tools.sidecar.canary.trial import end_canary, start_canary

    dirs = _served_dirs(args, CONTROL + REPOSITORY)
    opts = options_from_args(CanaryOptions, args)
    if opts.abort:
        running = read_canary(dirs.control_dir)
        if running is None:
            print(f"no plan on trial in {dirs.control_dir}")
            return 1
        end_canary(dirs.control_dir, running, promote=False, by=applied_by("plan canary --abort"))
        print(f"ended the trial of plan {running.plan_id}: every instance serves plan.json again")
        return 0
    if args.plan is None:
        raise ConfigError("name the plan file to try (or --abort)")
    host = replica_name(opts.replica)
    plan = Plan.load(args.plan)
    check_plan(plan, dirs.model_repository)
    instances = canary_instances(dirs.control_dir, host, replica=bool(opts.replica), named=opts.canary_instances)
    canary = start_canary(dirs.control_dir, plan, host=host, instances=instances, by=applied_by("plan canary"),
                          settings=settings_from_args(PlanHistorySettings, args))
    print(f"plan {plan.plan_id} on trial on {', '.join(canary.instances) or 'every instance'} of {host} (stored as "
          f"{canary.plan}); the sidecar's /status (canary) shows the verdict")
    return 0


def _cmd_stanzas(args: argparse.Namespace) -> int:
    from warmup_tools.common.plan import Plan
    from warmup_tools.demo.prompts import SYSTEM_PROMPTS
    from warmup_tools.planning.plan_stanzas import check_repository, write_plan_stanzas
    from warmup_tools.planning.prompt_stanzas import write_prompt_stanzas

    opts = options_from_args(StanzasOptions, args)
    repository = _served_dirs(args, REPOSITORY).model_repository
    if not opts.check:
        if opts.plan:
            plan = Plan.load(opts.plan)
            counts = write_plan_stanzas(plan, repository)
            print(f"wrote stanzas of plan {plan.plan_id} into {repository}: {counts}")
        else:
            files = write_prompt_stanzas(repository, opts.tokenizer, SYSTEM_PROMPTS)
            print(f"wrote the demo model_warmup stanzas ({len(files)} data files) into {repository}")
    problems = check_repository(repository)
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"stanzas in {repository} are consistent with their configs")
    return 0
