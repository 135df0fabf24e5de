"""The real-text day the replay benchmarks share (``bench replay``, ``rolling``, ``load``, ``rollout``, ``fleet``,
``peer``): two days of traffic written and planned from day 1 (:func:`prepare`), day 2 replayed in order on one
server (:func:`replay`), the figures of a replayed window (:func:`figures`) and the floor.

The floor: a replayed request can reuse at most the blocks of its longest block-aligned token prefix
that some day-1 request of its tenant and adapter carried (any plan could have warmed those), or that
an earlier replayed request carried (the server caches what it serves). A request that shares no full
block with either is cold whatever the plan.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Mapping, Sequence, TextIO

from warmup_tools.common.errors import ConfigError
from warmup_tools.common.plan import Plan
from warmup_tools.common.records import RequestRecord, read_request_log
from warmup_tools.planning.analyse import BlockTrie
from warmup_tools.planning.plan_stanzas import COMPOSING_MODELS, write_plan_stanzas
from warmup_tools.planning.stanzas import write_model_warmup
from warmup_tools.server.client import GenerateParams, StreamingClient
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.server.process import TritonServer

TRAFFIC = ("generated", "real", "heldout")



@dataclasses.dataclass(frozen=True, slots=True)
class Served:
    """One replayed request as the server answered it."""

    ts: float
    cold: bool
    ttft_ms: float
    cached_tokens: int
    prompt_tokens: int



@dataclasses.dataclass(frozen=True, slots=True)
class WindowFigures:
    label: str
    requests: int
    cold: int
    cached_share: float
    ttft_p50_ms: float
    ttft_p90_ms: float

    @property
    def cold_share(self) -> float:
        return self.cold / self.requests if self.requests else 0.0



def figures(label: str, served: Sequence[Served]) -> WindowFigures:
    ttfts = sorted(s.ttft_ms for s in served) or [0.0]
    prompt = sum(s.prompt_tokens for s in served)
    return WindowFigures(label, len(served), sum(s.cold for s in served),
                         sum(s.cached_tokens for s in served) / prompt if prompt else 0.0,
                         statistics.median(ttfts), ttfts[int(0.9 * (len(ttfts) - 1))])



def floor(day1: Sequence[RequestRecord], replayed: Sequence[RequestRecord], tokenizer: Any,
          block_size: int) -> list[Served]:
    """The best any plan from ``day1`` could do for ``replayed`` (module docstring), one entry per request."""
    return simulate(day1, replayed, tokenizer, block_size)



def simulate(warmed: Sequence[RequestRecord] | Sequence[Mapping[str, Any]], replayed: Sequence[RequestRecord],
             tokenizer: Any, block_size: int) -> list[Served]:
    """``replayed`` served in order by a cache that holds every block of ``warmed`` (day-1 records: the
    floor; a plan's items: that plan) and keeps every block it serves (no eviction); one entry per request."""
    tries: dict[tuple[str, str], BlockTrie] = {}
    seen: dict[tuple[str, str], set[int]] = {}

    def chain(key: tuple[str, str], ids: Sequence[int]) -> list[int]:
        return tries.setdefault(key, BlockTrie(block_size)).chain(ids)

    for warm in warmed:
        if isinstance(warm, RequestRecord):
            key, ids = (warm.tenant, warm.adapter), _ids(tokenizer, warm)
        else:  # a plan item: its token ids are whole blocks, all of them usable
            key, ids = (warm["tenant"], warm["adapter"]), [*warm["token_ids"], 0]
        seen.setdefault(key, set()).update(chain(key, ids))
    out = []
    for record in replayed:
        key, ids = (record.tenant, record.adapter), _ids(tokenizer, record)
        nodes = chain(key, ids)
        known = seen.setdefault(key, set())
        reusable = next((i for i, node in enumerate(nodes) if node not in known), len(nodes))
        known.update(nodes)
        out.append(Served(record.ts, reusable == 0, 0.0, reusable * block_size, len(ids)))
    return out



def _ids(tokenizer: Any, record: RequestRecord) -> list[int]:
    return tokenizer.encode(record.prompt or "", add_special_tokens=True)



def replay(repo: Path, records: Sequence[RequestRecord], assets_dir: Path, label: str,
           out: TextIO) -> tuple[list[Served], float]:
    """Replay ``records`` in order (max_tokens 1) on a server of ``repo``; the answers and the load time."""
    start = time.perf_counter()
    served = []
    with TritonServer(repo, env=_server_env(assets_dir)) as server:
        server.wait_ready(timeout=1800)
        load_s = time.perf_counter() - start
        with StreamingClient(server.grpc_url) as client:
            for record in records:
                result = client.generate(record.prompt, GenerateParams(
                    max_tokens=1, adapter_id=record.adapter or None, tenant_id=record.tenant))
                served.append(Served(record.ts, result.cached_tokens == 0, result.ttft_s * 1000,
                                     result.cached_tokens, result.prompt_tokens))
    out.write(f"  {label}: {len(served)} requests replayed; server ready in {load_s:.0f} s\n")
    out.flush()
    return served, load_s



@dataclasses.dataclass(frozen=True, slots=True)
class Repositories:
    """Day 2's first hours, day 1, and two copies of the repository: without warm-up stanzas, and with the plan's."""

    first_hours: list[RequestRecord]
    day1: list[RequestRecord]
    day2_start: float
    without_plan: Path
    with_plan: Path
    tokenizer: Any
    block_size: int
    plan: Plan

    @property
    def first_hour(self) -> list[RequestRecord]:
        return [r for r in self.first_hours if r.ts < self.day2_start + 3600]



def write_traffic(traffic: str, work: Path, *, seed: int, requests_per_day: int) -> tuple[Path, Path, float]:
    """Two days of ``traffic`` under ``work``: day 1's log, day 2's log, and day 2's start (epoch seconds)."""
    if traffic == "generated":
        from warmup_tools.sim.traffic import TrafficConfig, write_logs

        config = TrafficConfig(seed=seed, requests_per_day=requests_per_day)
        day1, day2 = write_logs(config, work / "logs")[:2]
        return day1, day2, config.start + 86400
    if traffic == "real":
        from warmup_tools.sim.real_traffic import RealTrafficConfig, write_real_logs

        real = RealTrafficConfig(seed=seed, requests_per_day=requests_per_day)
        day1, day2 = write_real_logs(real, work / "logs")[:2]
        return day1, day2, real.start + 86400
    if traffic == "heldout":
        from warmup_tools.sim.heldout_traffic import HeldOutConfig, write_heldout_logs

        heldout = HeldOutConfig(seed=seed, requests_per_day=requests_per_day)
        day1, day2 = write_heldout_logs(heldout, work / "logs")[:2]
        return day1, day2, heldout.start + 86400
    raise ConfigError(f"traffic must be one of {', '.join(TRAFFIC)}, not {traffic!r}")



def prepare(work: Path, assets_dir: Path, *, seed: int, requests_per_day: int, out: TextIO,
            traffic: str = "generated", hours: float = 1.0, budgets: Mapping[str, Any] | None = None,
            arbitration: str = "measured") -> Repositories:
    """Write two days of traffic, plan from day 1 (``budgets``: overrides of the repository's default budgets;
    ``arbitration``: the planner's split of them across adapters), and write both repositories under ``work``."""
    from warmup_tools.embedding_cache.embedder import OnnxEmbedder
    from warmup_tools.planning.analyse import PlanOptions
    from warmup_tools.planning.select import build_plan, format_summary
    from warmup_tools.planning.target import PlanTarget

    day1_path, day2_path, day2_start = write_traffic(traffic, work, seed=seed, requests_per_day=requests_per_day)
    day1 = list(read_request_log([day1_path]))
    first_hours = sorted((r for r in read_request_log([day2_path]) if r.ts < day2_start + hours * 3600),
                         key=lambda r: r.ts)
    out.write(f"traffic ({traffic}): {len(day1)} day-1 requests; replaying day 2's first {hours:g} h: "
              f"{len(first_hours)} requests\n")
    baseline = work / "repo-without-plan"
    planned = work / "repo-with-plan"
    shutil.copytree(REPO_ROOT / "model_repository", baseline)
    shutil.copytree(REPO_ROOT / "model_repository", planned)
    target = PlanTarget.from_repository(planned, {**os.environ, **_server_env(assets_dir)})
    tokenizer = target.load_tokenizer()
    embedder = OnnxEmbedder(dataclasses.replace(target.embedder, num_threads=2))
    started = time.perf_counter()
    plan = build_plan(day1, tokenizer, embedder, target.default_budgets(**dict(budgets or {})), now=day2_start,
                      block_size=target.block_size, kv_bytes_per_token=target.kv_bytes_per_token, progress=False,
                      options=PlanOptions(arbitration=arbitration), kv=target.settings.engine.kv)
    out.write(f"planned {len(day1)} requests in {time.perf_counter() - started:.1f} s\n")
    plan.save(work / "plan.json")
    out.write(format_summary(plan) + "\n")

    for model in COMPOSING_MODELS:
        write_model_warmup(baseline / model, [])
    counts = write_plan_stanzas(plan, planned, target=target, tokenizer=tokenizer)
    out.write(f"stanzas from plan {plan.plan_id}: {counts}\n")
    out.flush()
    return Repositories(first_hours, day1, day2_start, baseline, planned, tokenizer, target.block_size, plan)



def _server_env(assets_dir: Path) -> dict[str, str]:
    return {"WARMUP_ASSETS_DIR": str(assets_dir), "WARMUP_CONTROL_DIR": ""}
