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
from warmup_tools.common.names import replica_name
from warmup_tools.common.settings import parse_duration
from warmup_tools.control.plan_history import PlanHistorySettings
from warmup_tools.ops.cli.flags import add_settings, reported, settings_from_args
from warmup_tools.server.config import REPO_ROOT, ServeConfig

#: ``plan <action>``: the plan history of a control folder (``plan LOGS...`` makes a plan).
PLAN_ACTIONS = ("history", "diff", "rollback", "canary")
_DEFAULTS = ServeConfig()
_CONTROL_HELP = "the lora_adapter model's control_dir (WARMUP_CONTROL_DIR)"
_REPOSITORY_HELP = "the repository the server runs: the plan is checked against it first"


def add_commands(sub: Any) -> None:
    plan_help = ("decide what to warm from request logs; writes a versioned plan. Also `plan history`, `plan diff "
                 "A B`, `plan rollback [ID]`: the plans a control folder served, and `plan canary`: a plan on trial "
                 "on one instance or replica, promoted or rolled back by the sidecar (each has its own --help)")
    plan = sub.add_parser("plan", help=plan_help, description=plan_help)
    plan.add_argument("logs", nargs="+", type=Path,
                      help="request logs (.jsonl, .jsonl.gz, rotated .jsonl.N) or folders holding them")
    plan.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "plan.json")
    plan.add_argument("--model-repository", type=Path, default=_DEFAULTS.model_repository,
                      help="the repository the plan is for: KV block size, storage, dtype and budget, the "
                           "tokenizer and the embedder are read from its configs")
    plan.add_argument("--kv-bytes-total", type=int,
                      help="KV bytes per instance the plan may fill (default: lora_adapter's kv_cache_bytes "
                           "less kv_live_reserve)")
    plan.add_argument("--kv-bytes-per-adapter", type=int,
                      help="an upper bound per adapter (default: --kv-bytes-total; --arbitration splits the total)")
    plan.add_argument("--arbitration", choices=("measured", "fixed"),
                      help="when the adapters' hot sets do not all fit: split the budget by each adapter's cold "
                           "share and traffic (measured, the default), or let every adapter take up to "
                           "--kv-bytes-per-adapter, hottest blocks first (fixed); docs/planner.md")
    plan.add_argument("--replicas", type=int, default=1,
                      help="replicas that each warm this plan behind a prefix-affine router (smg cache_aware): the "
                           "warm set is sized by replaying one replica's share of the log's tail (docs/planner.md)")
    plan.add_argument("--embedding-entries", type=int, help="prompt embeddings to pre-compute (default: the plan's)")
    plan.add_argument("--tokenizer-entries", type=int, help="texts to register with the tokenizer cache (default: "
                                                            "the plan's)")
    plan.add_argument("--warm-seconds", type=float, help="time the KV warm-up may take (default: the plan's)")
    plan.add_argument("--now", type=float, help="epoch seconds the heat decays to (default: the last record)")
    plan.add_argument("--since", type=reported(parse_duration), metavar="DURATION",
                      help="plan from the last DURATION of the logs only (before --now, or the last record): "
                           "30m, 6h, 2d")
    plan.add_argument("--previous", type=Path, metavar="PLAN",
                      help="the plan now served: its items are kept unless clearly beaten (no flapping), and the "
                           "new plan says what it added, kept and dropped")
    plan.add_argument("--no-progress", action="store_true")
    plan.set_defaults(func=_cmd_plan)

    apply = sub.add_parser("apply-plan", help="serve a plan on a running server without a restart (through the "
                                              "control folder); waits until every instance reports it")
    apply.add_argument("plan", type=Path, help="a plan file written by `plan`")
    apply.add_argument("--control-dir", type=Path, default=_DEFAULTS.control_dir, help=_CONTROL_HELP)
    _live_apply_flags(apply)
    apply.set_defaults(func=_cmd_apply_plan)

    stanzas = sub.add_parser("stanzas", help="write (or --check) model_warmup stanzas in the repository")
    stanzas.add_argument("--model-repository", type=Path, default=_DEFAULTS.model_repository)
    stanzas.add_argument("--plan", type=Path, help="a plan from `warmup_tools plan` (default: the demo prompts)")
    stanzas.add_argument("--tokenizer", type=Path, default=_DEFAULTS.assets_dir / "lm",
                         help="tokenizer folder used to turn the demo warm-up prompts into token ids")
    stanzas.add_argument("--check", action="store_true", help="only validate the stanzas against the configs")
    stanzas.set_defaults(func=_cmd_stanzas)


def actions_parser() -> argparse.ArgumentParser:
    """``plan history|diff|rollback|canary``: parsed apart, since ``plan`` takes log paths as positionals."""
    parser = argparse.ArgumentParser(prog="warmup_tools plan", description="The plans a control folder served: "
                                     "every plan applied (apply-plan, the sidecar's re-plan, a rollback) is kept "
                                     "under <control>/plans/, content-addressed, with its parent and who applied it.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    actions = parser.add_subparsers(dest="action", required=True)
    control = argparse.ArgumentParser(add_help=False)
    control.add_argument("--control-dir", type=Path, default=_DEFAULTS.control_dir, help=_CONTROL_HELP)
    history = actions.add_parser("history", parents=[control],
                                 help="the plans applied, newest first: id, parent, when, by whom, items, bytes")
    history.add_argument("--limit", type=int, default=50, help="show at most this many entries")
    history.set_defaults(func=_cmd_plan_history)
    diff = actions.add_parser("diff", parents=[control],
                              help="items added, kept and dropped from plan A to plan B, with KV bytes")
    diff.add_argument("a", help="a history id (or a unique prefix, or a plan_id), or a plan file")
    diff.add_argument("b", help="the same, for the plan compared with A")
    diff.add_argument("--items", type=int, default=20, help="list at most this many added and dropped items")
    diff.set_defaults(func=_cmd_plan_diff)
    back = actions.add_parser("rollback", parents=[control],
                              help="serve again the plan the served one replaced, or a named one (checked against "
                                   "the repository, applied live like apply-plan, recorded in the history)")
    back.add_argument("id", nargs="?", help="the plan to go back to (default: the parent of the plan served now)")
    _live_apply_flags(back)
    back.set_defaults(func=_cmd_plan_rollback)
    canary = actions.add_parser("canary", parents=[control],
                                help="put a plan on trial on one lora_adapter instance of a replica, or with "
                                     "--replica alone on every instance of that replica of a fleet (the others keep "
                                     "the plan served now); the replica's sidecar promotes it or rolls it back "
                                     "(docs/planner.md); --abort ends a trial without promoting it")
    canary.add_argument("plan", nargs="?", type=Path, help="the plan file to try (checked against the repository)")
    canary.add_argument("--instance", action="append", dest="canary_instances",
                        help="an instance that serves the plan on trial (repeat; default: the replica's last one, "
                             "of those that report)")
    canary.add_argument("--replica", default="", help="the replica's name (its replica_name, else its host name; "
                                                      "default: this host's name); without --instance: every "
                                                      "instance of it, judged against the fleet's other replicas")
    canary.add_argument("--abort", action="store_true", help="end the running trial: every instance goes back to "
                                                             "the plan served now")
    canary.add_argument("--model-repository", type=Path, default=_DEFAULTS.model_repository, help=_REPOSITORY_HELP)
    canary.set_defaults(func=_cmd_plan_canary)
    return parser


def _live_apply_flags(parser: argparse.ArgumentParser) -> None:
    """What apply-plan and plan rollback share: the check, the stanzas, the wait, the history's bound."""
    parser.add_argument("--model-repository", type=Path, default=_DEFAULTS.model_repository, help=_REPOSITORY_HELP)
    parser.add_argument("--stanzas", action="store_true",
                        help="also write the plan's model_warmup stanzas, so the next start begins from it")
    parser.add_argument("--wait", type=float, default=600.0, help="seconds to wait for the instances (0: don't)")
    parser.add_argument("--instances", type=int, help="how many instances must report (default: all that report)")
    add_settings(parser, PlanHistorySettings, file=False)


def _cmd_plan(args: argparse.Namespace) -> int:
    from warmup_tools.common.jsonl import ReadStats
    from warmup_tools.common.plan import Plan
    from warmup_tools.common.records import log_files, read_request_log
    from warmup_tools.embedding_cache.embedder import OnnxEmbedder
    from warmup_tools.planning.analyse import PlanOptions
    from warmup_tools.planning.select import build_plan, format_summary
    from warmup_tools.planning.target import PlanTarget

    target = PlanTarget.from_repository(args.model_repository)
    given = {name: getattr(args, name) for name in ("kv_bytes_total", "kv_bytes_per_adapter", "embedding_entries",
                                                    "tokenizer_entries", "warm_seconds")}
    budgets = target.default_budgets(**{k: v for k, v in given.items() if v is not None})
    previous = Plan.load(args.previous) if args.previous else None
    stats = ReadStats()
    records = list(read_request_log(log_files(args.logs), stats))
    if args.since is not None:
        end = args.now if args.now is not None else max((r.ts for r in records), default=0.0)
        kept = [r for r in records if end - args.since <= r.ts <= end]
        print(f"{len(kept)} of {len(records)} records in the last {args.since / 3600:g} h before "
              f"{datetime.datetime.fromtimestamp(end, datetime.timezone.utc).isoformat(timespec='seconds')}",
              file=sys.stderr)
        records = kept
    options = PlanOptions(**({"arbitration": args.arbitration} if args.arbitration else {}),
                          replay_replicas=args.replicas)
    plan = build_plan(records, target.load_tokenizer(), OnnxEmbedder(target.embedder),
                      budgets, now=args.now, block_size=target.block_size,
                      kv_bytes_per_token=target.kv_bytes_per_token, progress=not args.no_progress, previous=previous,
                      options=options, kv=target.settings.engine.kv)
    plan.save(args.out)
    if stats.skipped:
        print(f"skipped {stats.skipped} bad or torn log line(s) of {stats.records + stats.skipped}; first: "
              + "; ".join(str(s) for s in stats.examples[:5]), file=sys.stderr)
    print(format_summary(plan))
    print(f"plan {plan.plan_id} written to {args.out}; apply it with "
          f"`python -m warmup_tools stanzas --plan {args.out}`")
    return 0


def _cmd_apply_plan(args: argparse.Namespace) -> int:
    from warmup_tools.common.plan import Plan
    from warmup_tools.planning.live import apply_plan
    from warmup_tools.planning.target import PlanTarget

    plan = Plan.load(args.plan)
    target = PlanTarget.from_repository(args.model_repository)
    tokenizer = target.load_tokenizer()
    entry = apply_plan(plan, args.control_dir, target=target, tokenizer=tokenizer,
                       inputs={"plan_file": str(args.plan)}, history=settings_from_args(PlanHistorySettings, args))
    return _served(args, plan, entry, target, tokenizer)


def _served(args: argparse.Namespace, plan: Any, entry: Any, target: Any, tokenizer: Any) -> int:
    """After apply-plan or a rollback: the history entry, the stanzas (--stanzas), each instance (--wait)."""
    from warmup_tools.planning.live import wait_applied
    from warmup_tools.planning.plan_stanzas import write_plan_stanzas

    print(f"plan {plan.plan_id} ({len(plan.items)} KV items) written to {args.control_dir}; history id {entry.id}, "
          f"parent {entry.parent or '-'}", flush=True)
    if args.stanzas:
        counts = write_plan_stanzas(plan, args.model_repository, target=target, tokenizer=tokenizer)
        print(f"stanzas of plan {plan.plan_id} written into {args.model_repository}: {counts}")
    if args.wait > 0:
        for instance, status in sorted(wait_applied(args.control_dir, plan.plan_id, instances=args.instances,
                                                    timeout_s=args.wait).items()):
            coverage = ", ".join(f"{name} {c.resident}/{c.planned}" + (f" ({c.shortfall})" if c.shortfall else "")
                                 for name, c in sorted(status.adapters.items()))
            print(f"{instance}: applied plan {status.plan_id}: {status.detail}; resident blocks: {coverage or '-'}")
    return 0


def _cmd_plan_history(args: argparse.Namespace) -> int:
    from warmup_tools.ops.plans import history_lines

    print("\n".join(history_lines(args.control_dir, args.limit)))
    return 0


def _cmd_plan_diff(args: argparse.Namespace) -> int:
    from warmup_tools.common.plan import Plan
    from warmup_tools.control.plan_history import PlanHistory
    from warmup_tools.ops.plans import diff_lines

    history = PlanHistory(args.control_dir)

    def load(ref: str) -> Any:
        return Plan.load(Path(ref)) if os.sep in ref or ref.endswith(".json") else history.load(ref)

    print("\n".join(diff_lines(load(args.a), load(args.b), args.items)))
    return 0


def _cmd_plan_rollback(args: argparse.Namespace) -> int:
    from warmup_tools.planning.live import rollback
    from warmup_tools.planning.target import PlanTarget

    target = PlanTarget.from_repository(args.model_repository)
    tokenizer = target.load_tokenizer()
    settings = settings_from_args(PlanHistorySettings, args)
    plan, entry = rollback(args.control_dir, args.id, target=target, tokenizer=tokenizer, history=settings)
    print(f"rolled back from plan {entry.inputs.get('rolled_back') or '-'} to {entry.id}")
    return _served(args, plan, entry, target, tokenizer)


def _cmd_plan_canary(args: argparse.Namespace) -> int:
    from warmup_tools.common.plan import Plan
    from warmup_tools.control.plan_control import read_canary
    from warmup_tools.control.plan_history import applied_by
    from warmup_tools.ops.plans import canary_instances
    from warmup_tools.planning.live import check_plan
    from warmup_tools.sidecar.canary.trial import end_canary, start_canary

    if args.abort:
        running = read_canary(args.control_dir)
        if running is None:
            print(f"no plan on trial in {args.control_dir}")
            return 1
        end_canary(args.control_dir, running, promote=False, by=applied_by("plan canary --abort"))
        print(f"ended the trial of plan {running.plan_id}: every instance serves plan.json again")
        return 0
    if args.plan is None:
        raise ConfigError("name the plan file to try (or --abort)")
    host = replica_name(args.replica)
    plan = Plan.load(args.plan)
    check_plan(plan, args.model_repository)
    instances = canary_instances(args.control_dir, host, replica=bool(args.replica),
                                 named=args.canary_instances or ())
    canary = start_canary(args.control_dir, plan, host=host, instances=instances, by=applied_by("plan canary"),
                          settings=settings_from_args(PlanHistorySettings, args))
    print(f"plan {plan.plan_id} on trial on {', '.join(canary.instances) or 'every instance'} of {host} (stored as "
          f"{canary.plan}); the sidecar's /status (canary) shows the verdict")
    return 0


def _cmd_stanzas(args: argparse.Namespace) -> int:
    from warmup_tools.common.plan import Plan
    from warmup_tools.demo.prompts import SYSTEM_PROMPTS
    from warmup_tools.planning.plan_stanzas import check_repository, write_plan_stanzas
    from warmup_tools.planning.prompt_stanzas import write_prompt_stanzas

    if not args.check:
        if args.plan:
            plan = Plan.load(args.plan)
            counts = write_plan_stanzas(plan, args.model_repository)
            print(f"wrote stanzas of plan {plan.plan_id} into {args.model_repository}: {counts}")
        else:
            files = write_prompt_stanzas(args.model_repository, args.tokenizer, SYSTEM_PROMPTS)
            print(f"wrote the demo model_warmup stanzas ({len(files)} data files) into {args.model_repository}")
    problems = check_repository(args.model_repository)
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    if problems:
        return 1
    print(f"stanzas in {args.model_repository} are consistent with their configs")
    return 0
