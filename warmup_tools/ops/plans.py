"""What the plan commands do below the command line: the history as a table, a diff in lines, and which
instances a canary puts a plan on (``warmup_tools plan history|diff|canary``)."""

from __future__ import annotations

import datetime
import time
from pathlib import Path
from typing import Any, Sequence

from warmup_tools.common.errors import ConfigError


def _utc(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).isoformat(timespec="seconds")


def history_lines(control_dir: Path, limit: int) -> list[str]:
    """The plans ``control_dir`` served, newest first, as an aligned table, and the plan on trial if any."""
    from warmup_tools.control.plan_control import read_canary
    from warmup_tools.control.plan_history import PlanHistory

    history = PlanHistory(control_dir)
    entries = history.entries()
    if not entries:
        return [f"no plan history in {control_dir}"]
    served = history.current()
    rows = [("", "id", "parent", "when (UTC)", "by", "items", "KV bytes", "plan_id")]
    for index, entry in enumerate(entries[:max(limit, 1)]):
        by = f"{entry.by} ({entry.user})" if entry.user else entry.by
        rows.append(("*" if served is not None and index == 0 else "", entry.id, entry.parent or "-",
                     _utc(entry.at).replace("+00:00", ""), by, str(entry.items), f"{entry.kv_bytes:,}", entry.plan_id))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i in (5, 6) else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
             for row in rows]
    if served is None:
        lines.append(f"(plan.json in {control_dir} is not the newest plan of the history)")
    running = read_canary(control_dir)
    if running is not None:
        where = ", ".join(running.instances) or "every instance"
        since = datetime.datetime.fromtimestamp(running.started_at, datetime.timezone.utc)
        lines.append(f"on trial: {running.plan} (plan_id {running.plan_id}) on {where} of {running.host}, since "
                     f"{since:%Y-%m-%d %H:%M:%S} UTC")
    return lines


def diff_lines(a: Any, b: Any, items: int) -> list[str]:
    """What plan ``b`` adds, keeps and drops against plan ``a``, listing at most ``items`` of each."""
    from warmup_tools.control.plan_history import diff_plans

    diff = diff_plans(a, b)
    mib = 1 << 20
    lines = [f"plan {a.plan_id} -> plan {b.plan_id}: {len(diff.added)} items added ({diff.added_bytes / mib:.1f} MiB "
             f"of new blocks), {len(diff.kept)} kept ({diff.kept_bytes / mib:.1f} MiB of blocks in both), "
             f"{len(diff.dropped)} dropped ({diff.dropped_bytes / mib:.1f} MiB of blocks no longer warmed)"]
    for sign, listed in (("+", diff.added), ("-", diff.dropped)):
        for item in listed[:max(items, 0)]:
            text = " ".join(str(item.get("text", "")).split())[:60]
            lines.append(f"  {sign} {item['tenant']} / {item['adapter'] or '(base)'}: {len(item['token_ids'])} tokens "
                         f"{text!r}")
        if len(listed) > items:
            lines.append(f"  {sign} ... and {len(listed) - items} more")
    return lines


def canary_instances(control_dir: Path, host: str, *, replica: bool, named: Sequence[str]) -> list[str]:
    """The instances a plan on trial runs on: those ``named``; none (the whole replica ``host``, judged by its
    sidecar against the fleet's other replicas) with ``replica``; else the replica's last instance that
    reports. ConfigError when there is nothing to compare the trial with."""
    from warmup_tools.control.plan_control import PlanStatusBoard
    from warmup_tools.sidecar.config import SidecarConfig

    if named:
        return list(named)
    board = PlanStatusBoard(control_dir)
    if replica:
        replicas = board.hosts(since=time.time() - SidecarConfig().coverage_stale_s)
        if host not in replicas or len(replicas) < 2:
            raise ConfigError(f"replicas reporting to {control_dir} lately: {', '.join(replicas) or 'none'}; "
                              f"a trial on replica {host} needs it and another one to compare with "
                              "(or name --instance)")
        return []
    statuses, _ = board.read_all(host=host)
    if len(statuses) < 2:
        raise ConfigError(f"replica {host} has {len(statuses)} lora_adapter instance(s) reporting to "
                          f"{control_dir}: a canary needs one to try the plan and one to compare with")
    return sorted(statuses)[-1:]
