"""Seeded, reproducible LLM request logs: the traffic the warm-up planner learns from.

The generator models a multi-tenant serving day. Every request belongs to a tenant and goes to one of
the demo adapters (or to the base model). Its prompt is one of three kinds:

* **templated** (``1 - long_tail_share`` of requests): the tenant's system prompt for the adapter, then
  the body of one of the (tenant, adapter) pair's templates (a RAG preamble with a retrieved-document
  block, a business intent such as "refund request", or a few-shot block), then a user part of 5-30
  words. Templates of a pair are Zipf-ranked; a template's user part sometimes recurs verbatim.
* **long tail** (``long_tail_share - raw_share``): the system prompt followed by a one-off message.
* **raw** (``raw_share``): an API call with no system prompt at all, half of them to the base model.

Arrivals follow a non-homogeneous Poisson process: exponential gaps in "operational time", mapped back
through a diurnal UTC profile (busy working hours, quiet nights) plus hourly bursts in which one
template's rate is multiplied. Day to day the template ranking drifts: part of it is reshuffled, and
one or two new templates per pair appear while as many bottom-ranked ones retire.

Records use the serving log schema (:class:`~warmup_tools.common.records.RequestRecord`). The fields a real server fills
(``prompt_tokens``, ``cached_tokens``, ``ttft_ms``, ``output_tokens``, ``cluster``) are null here;
``template`` is the generator's ground-truth label, which tests use to score clustering and which the
planner must ignore, because real logs don't have it.

Everything derives from ``TrafficConfig.seed`` through labelled sub-seeds (never Python's ``hash()``),
so the same config writes byte-identical files in every process.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import random
import re
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from gzip import GzipFile
from itertools import accumulate
from pathlib import Path

from warmup_tools.sim.demo_prompts import SYSTEM_PROMPTS
from warmup_tools.common.errors import ConfigError, WarmupToolsError
from warmup_tools.common.digests import prompt_digest, stable_seed
from warmup_tools.common.jsonl import read_json_lines, write_json_lines
from warmup_tools.common.records import RequestRecord

DAY_SECONDS = 86_400
BASE_MODEL = ""
"""The ``adapter`` value of a request served by the base model."""


_KINDS = ("rag", "intent", "fewshot")
_KIND_WEIGHTS = (0.35, 0.40, 0.25)
_MINUTES = DAY_SECONDS // 60
_MAX_TS_MS = DAY_SECONDS * 1000 - 1


@dataclass(frozen=True, slots=True)
class TrafficConfig:
    """What to generate. Invalid values raise :class:`ConfigError`; the same config (seed included)
    always yields the same records."""

    seed: int = 0
    days: int = 2
    requests_per_day: int = 6000
    tenants: tuple[str, ...] = ("acme", "globex", "initech")
    adapters: tuple[str, ...] = ("support", "legal", "sql")
    templates_per_adapter: int = 12
    """Templates per (tenant, adapter) pair on day 1, Zipf-ranked."""
    zipf_s: float = 1.1
    long_tail_share: float = 0.08
    """Share of requests with no template; all but ``raw_share`` of them start with a system prompt."""
    raw_share: float = 0.02
    """Share of all requests that are raw API calls with no system prompt (part of the long tail)."""
    burst_probability: float = 0.15
    """Chance, per hour, of a burst that multiplies one template's rate for 15 to 60 minutes."""
    drift: float = 0.25
    """Share of each pair's ranking reshuffled from one day to the next. Above 0, each pair also gains
    one or two new templates per day (and retires as many bottom-ranked ones); 0 means no drift at all."""
    start: float = 1_767_225_600.0
    """Epoch seconds at which day 1 begins (2026-01-01T00:00:00Z)."""

    def __post_init__(self) -> None:
        for name in ("tenants", "adapters"):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, Iterable):
                raise ConfigError(f"traffic {name} must be a sequence of names, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        _check_int("seed", self.seed, minimum=None)
        _check_int("days", self.days, minimum=1)
        _check_int("requests_per_day", self.requests_per_day, minimum=1)
        _check_int("templates_per_adapter", self.templates_per_adapter, minimum=1)
        if not self.tenants or len(set(self.tenants)) != len(self.tenants):
            raise ConfigError(f"traffic tenants must be distinct and non-empty, got {self.tenants!r}")
        for tenant in self.tenants:
            if not isinstance(tenant, str) or not _NAME.fullmatch(tenant):
                raise ConfigError(f"traffic tenant {tenant!r} must match {_NAME.pattern}")
        if not self.adapters or len(set(self.adapters)) != len(self.adapters):
            raise ConfigError(f"traffic adapters must be distinct and non-empty, got {self.adapters!r}")
        unknown = [a for a in self.adapters if a not in _CONTENT]
        if unknown:
            raise ConfigError(f"no traffic content for adapters {unknown}; known: {sorted(_CONTENT)}")
        for name in ("zipf_s", "long_tail_share", "raw_share", "burst_probability", "drift", "start"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"traffic {name} must be a finite number, got {value!r}")
        if self.zipf_s < 0:
            raise ConfigError(f"traffic zipf_s must be >= 0, got {self.zipf_s}")
        for name in ("long_tail_share", "burst_probability", "drift"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"traffic {name} must be within [0, 1], got {getattr(self, name)}")
        if not 0.0 <= self.raw_share <= self.long_tail_share:
            raise ConfigError(f"traffic raw_share must be within [0, long_tail_share={self.long_tail_share}] "
                              f"(raw calls are part of the long tail), got {self.raw_share}")


@dataclass(frozen=True, slots=True)
class Template:
    """One prompt template of a (tenant, adapter) pair: ground truth for tests and demos."""

    name: str
    """The records' ``template`` label, ``"<adapter>/<tenant>/<kind>-<n>"``."""
    tenant: str
    adapter: str
    kind: str
    """``"rag"``, ``"intent"`` or ``"fewshot"``."""
    intent: str
    body: str
    """What follows the system prompt; it ends with the lead-in (``"Customer: "``) the user part follows."""
    first_day: int
    questions: tuple[str, ...]
    """User-part patterns with ``{slot}`` fields."""
    canned: tuple[str, ...]
    """User parts that recur verbatim."""
    repeat_probability: float
    """Chance that a request uses one of ``canned`` instead of a freshly composed user part."""


@dataclass(frozen=True, slots=True)
class DaySummary:
    """What one day's log holds; see :func:`summarize`."""

    label: str
    requests: int
    per_adapter: tuple[tuple[str, int], ...]
    templates: int
    long_tail_share: float
    raw_share: float
    first_hour_share: float


def system_prompt(tenant: str, adapter: str) -> str:
    """The system prompt every non-raw prompt of ``tenant`` on ``adapter`` starts with.

    It is the demo adapter's system prompt (with the tenant's brand where the demo names one) followed
    by a paragraph about the tenant; it does not depend on the seed.
    """
    if adapter not in _CONTENT:
        raise ConfigError(f"no system prompt for adapter {adapter!r}; known: {sorted(_CONTENT)}")
    profile = _profile(tenant)
    demo = SYSTEM_PROMPTS[adapter].replace("Acme Cloud", profile.brand)
    return demo + _TENANT_PARAGRAPHS[adapter].format_map(_profile_fields(profile)) + "\n\n"


def templates(config: TrafficConfig) -> list[Template]:
    """Every template that receives traffic on some day, pair by pair, in order of creation."""
    return [t for pair in _build_world(config).pairs for t in pair.created]


def generate(config: TrafficConfig) -> Iterator[dict]:
    """Yield the log records of every day, in time order."""
    for _day, records in _generate_days(config):
        yield from records


def write_logs(config: TrafficConfig, out_dir: Path, *, gzip: bool = False) -> list[Path]:
    """Write one JSON Lines file per day (``day1.jsonl``, ``day2.jsonl``... or ``.jsonl.gz``).

    Files are replaced atomically. Other files in ``out_dir`` (a previous run's extra days, or the other
    compression) are left alone: the returned paths are this run's logs.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for day, records in _generate_days(config):
        path = out_dir / f"day{day}.jsonl{'.gz' if gzip else ''}"
        write_json_lines(path, records, compress=gzip)
        paths.append(path)
    return paths


def summarize(records: Iterable[dict], *, day_start: float, label: str = "") -> DaySummary:
    """Count one day's records: per adapter, distinct templates, long tail, raw calls, first hour.

    Raw calls are the records whose prompt does not start with their tenant's system prompt for their
    adapter (every base-model record is one).
    """
    requests = long_tail = raw = first_hour = 0
    per_adapter: Counter[str] = Counter()
    labels: set[str] = set()
    prefixes: dict[tuple[str, str], str] = {}
    for record in records:
        requests += 1
        adapter = record["adapter"]
        per_adapter[adapter] += 1
        if record["ts"] < day_start + 3600:
            first_hour += 1
        if record.get("template") is not None:
            labels.add(record["template"])
            continue
        long_tail += 1
        key = (record["tenant"], adapter)
        if key not in prefixes:
            prefixes[key] = system_prompt(*key) if adapter in _CONTENT else ""
        if not prefixes[key] or not record["prompt"].startswith(prefixes[key]):
            raw += 1
    total = max(requests, 1)
    return DaySummary(label, requests, tuple(sorted(per_adapter.items())), len(labels), long_tail / total,
                      raw / total, first_hour / total)


def format_summary(summaries: Iterable[DaySummary], adapters: Iterable[str]) -> str:
    """A plain-text table, one row per day."""
    columns = [*adapters, BASE_MODEL]
    header = ["day", "requests", *[a or "base" for a in columns], "templates", "long-tail", "raw", "first-hour"]
    rows = [header]
    for s in summaries:
        counts = dict(s.per_adapter)
        rows.append([s.label, str(s.requests), *[str(counts.get(a, 0)) for a in columns], str(s.templates),
                     f"{s.long_tail_share:.1%}", f"{s.raw_share:.1%}", f"{s.first_hour_share:.1%}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
                     for row in rows)


def main_traffic(out_dir: Path, seed: int, days: int, requests_per_day: int, gzip: bool) -> list[Path]:
    """CLI entry: write the logs, print a summary table per day (read back from the files), return the paths."""
    config = TrafficConfig(seed=seed, days=days, requests_per_day=requests_per_day)
    paths = write_logs(config, out_dir, gzip=gzip)
    summaries = [summarize(read_json_lines([path]), day_start=config.start + i * DAY_SECONDS, label=path.name)
                 for i, path in enumerate(paths)]
    print(format_summary(summaries, config.adapters))
    return paths


# --------------------------------------------------------------------------------------------------
# The world: tenants, pairs, templates and their rankings per day.

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _check_int(name: str, value: object, *, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ConfigError(f"traffic {name} must be an integer{bound}, got {value!r}")


def _rng(*parts: object) -> random.Random:
    """A generator seeded from labelled parts, identical in every process."""
    return random.Random(stable_seed(*parts))


@dataclass(slots=True)
class _Pair:
    tenant: str
    adapter: str
    profile: _Profile
    system: str
    weight: float
    created: list[Template]
    rankings: list[list[Template]]
    """Per day (index ``day - 1``), most popular first."""


@dataclass(slots=True)
class _World:
    config: TrafficConfig
    pairs: list[_Pair]
    pair_cum: list[float]
    tenant_cum: list[float]


def _build_world(config: TrafficConfig) -> _World:
    pairs = []
    tenant_weights = []
    for tenant in config.tenants:
        profile = _profile(tenant)
        tenant_weight = _rng(config.seed, "tenant-volume", tenant).uniform(0.6, 1.4)
        tenant_weights.append(tenant_weight)
        mix = {a: _rng(config.seed, "adapter-mix", tenant, a).uniform(0.5, 1.5) for a in config.adapters}
        mix_total = sum(mix.values())
        for adapter in config.adapters:
            created, rankings = _rankings(config, profile, tenant, adapter)
            pairs.append(_Pair(tenant, adapter, profile, system_prompt(tenant, adapter),
                               tenant_weight * mix[adapter] / mix_total, created, rankings))
    return _World(config, pairs, list(accumulate(p.weight for p in pairs)), list(accumulate(tenant_weights)))


def _rankings(config: TrafficConfig, profile: _Profile, tenant: str, adapter: str
              ) -> tuple[list[Template], list[list[Template]]]:
    rng = _rng(config.seed, "templates", tenant, adapter)
    created: list[Template] = []

    def new(day: int) -> Template:
        template = _make_template(rng, profile, tenant, adapter, len(created) + 1, day, {t.body for t in created})
        created.append(template)
        return template

    ranking = [new(1) for _ in range(config.templates_per_adapter)]
    # NOTE: creation order is not popularity order, so a template's number says nothing about its rank.
    rng.shuffle(ranking)
    rankings = [ranking]
    for day in range(2, config.days + 1):
        ranking = list(ranking)
        if config.drift > 0:
            _reshuffle(rng, ranking, config.drift)
            fresh = rng.choice((1, 2))
            retire = min(fresh, len(ranking) - 1)
            del ranking[len(ranking) - retire:]
            for _ in range(fresh):
                # New templates enter the top half (a launch gets traffic), but not at the very top.
                ranking.insert(rng.randint(1, max(1, len(ranking) // 2)), new(day))
        rankings.append(ranking)
    return created, rankings


def _reshuffle(rng: random.Random, ranking: list[Template], drift: float) -> None:
    count = round(drift * len(ranking))
    if count < 2:
        count = min(2, len(ranking))
    positions = sorted(rng.sample(range(len(ranking)), count))
    moved = [ranking[p] for p in positions]
    order = list(range(count))
    rng.shuffle(order)
    if order == sorted(order):
        order = order[1:] + order[:1]
    for position, index in zip(positions, order):
        ranking[position] = moved[index]


def _zipf_cum(length: int, s: float) -> list[float]:
    return list(accumulate(1.0 / (rank ** s) for rank in range(1, length + 1)))


# --------------------------------------------------------------------------------------------------
# One day of traffic.

def _generate_days(config: TrafficConfig) -> Iterator[tuple[int, list[dict]]]:
    world = _build_world(config)
    seen: set[str] = set()
    for day in range(1, config.days + 1):
        yield day, _day_records(world, day, seen)


def _day_records(world: _World, day: int, seen: set[str]) -> list[dict]:
    config = world.config
    rng = _rng(config.seed, "day", day)
    day_start = config.start + (day - 1) * DAY_SECONDS
    rankings = [pair.rankings[day - 1] for pair in world.pairs]
    zipf = {n: _zipf_cum(n, config.zipf_s) for n in {len(r) for r in rankings}}

    base = [_diurnal(day_start + (minute + 0.5) * 60) for minute in range(_MINUTES)]
    bursts = _bursts(rng, world, rankings, zipf, base)
    totals = [b + sum(extra for _, _, extra in bursts.get(m, ())) for m, b in enumerate(base)]
    cum = list(accumulate(totals, initial=0.0))

    # NOTE: N exponential gaps normalised to the day's integrated rate: a Poisson process conditioned on
    # exactly requests_per_day arrivals, so every day holds the configured count.
    gaps = list(accumulate(rng.expovariate(1.0) for _ in range(config.requests_per_day + 1)))
    scale = cum[-1] / gaps[-1]
    # Burst requests are templated: the other requests carry the long tail at a share raised to match,
    # so that long_tail_share and raw_share hold for all requests.
    lift = cum[-1] / sum(base)
    raw_share = min(1.0, config.raw_share * lift)
    long_tail_share = min(1.0, config.long_tail_share * lift)

    records = []
    for gap in gaps[:-1]:
        u = gap * scale
        minute = min(bisect_right(cum, u) - 1, _MINUTES - 1)
        offset_s = (minute + (u - cum[minute]) / totals[minute]) * 60
        ts = day_start + min(int(offset_s * 1000), _MAX_TS_MS) / 1000
        pick = rng.random() * totals[minute]
        if pick >= base[minute]:
            pick -= base[minute]
            for pair, template, extra in bursts[minute]:
                if pick < extra:
                    break
                pick -= extra
            records.append(_templated(rng, pair, template, ts))
            continue
        kind = rng.random()
        if kind < raw_share:
            records.append(_raw(rng, world, ts, seen))
        elif kind < long_tail_share:
            pair = rng.choices(world.pairs, cum_weights=world.pair_cum)[0]
            records.append(_long_tail(rng, pair, ts, seen))
        else:
            index = rng.choices(range(len(world.pairs)), cum_weights=world.pair_cum)[0]
            ranking = rankings[index]
            template = rng.choices(ranking, cum_weights=zipf[len(ranking)])[0]
            records.append(_templated(rng, world.pairs[index], template, ts))
    return records


_HOURLY = (0.80, 0.70, 0.62, 0.56, 0.55, 0.60, 0.72, 0.92, 1.20, 1.42, 1.55, 1.60,
           1.58, 1.62, 1.68, 1.66, 1.55, 1.40, 1.25, 1.12, 1.02, 0.95, 0.90, 0.85)
"""Relative request rate at the start of each UTC hour: working hours in Europe and the Americas are
busy, the night over the Atlantic is quiet; midnight UTC (the Americas' evening) sees ~3% of a day."""


def _diurnal(ts: float) -> float:
    hour = (ts % DAY_SECONDS) / 3600
    low = int(hour)
    frac = hour - low
    return _HOURLY[low] * (1 - frac) + _HOURLY[(low + 1) % 24] * frac


def _bursts(rng: random.Random, world: _World, rankings: list[list[Template]], zipf: dict[int, list[float]],
            base: list[float]) -> dict[int, list[tuple[_Pair, Template, float]]]:
    """Per minute of the day, the bursts running then: (pair, template, extra rate)."""
    config = world.config
    templated = 1.0 - config.long_tail_share
    total_weight = world.pair_cum[-1]
    bursts: dict[int, list[tuple[_Pair, Template, float]]] = {}
    for hour in range(24):
        if rng.random() >= config.burst_probability:
            continue
        index = rng.choices(range(len(world.pairs)), cum_weights=world.pair_cum)[0]
        ranking = rankings[index]
        rank = rng.randrange(len(ranking))
        weights = zipf[len(ranking)]
        pair_share = templated * world.pairs[index].weight / total_weight
        share = pair_share * (weights[rank] - (weights[rank - 1] if rank else 0.0)) / weights[-1]
        # NOTE: a tail template's own rate is tiny; a burst multiplies at least the pair's mean template
        # rate, so bursts on tail templates are visible too.
        share = max(share, pair_share / len(ranking))
        factor = rng.uniform(4.0, 12.0)
        first = rng.randrange(0, 46)
        length = rng.randint(15, 60 - first)
        for minute in range(hour * 60 + first, hour * 60 + first + length):
            bursts.setdefault(minute, []).append(
                (world.pairs[index], ranking[rank], (factor - 1.0) * share * base[minute]))
    return bursts


def _record(ts: float, tenant: str, adapter: str, prompt: str, template: str | None) -> dict:
    record = RequestRecord(ts=ts, tenant=tenant, adapter=adapter, prompt_digest=prompt_digest(prompt), prompt=prompt,
                           template=template)
    return record.to_json(with_template=True)


def _templated(rng: random.Random, pair: _Pair, template: Template, ts: float) -> dict:
    if rng.random() < template.repeat_probability:
        user = rng.choice(template.canned)
    else:
        user = _user_part(rng, pair.profile, pair.adapter, template.questions)
    return _record(ts, pair.tenant, pair.adapter, pair.system + template.body + user, template.name)


def _long_tail(rng: random.Random, pair: _Pair, ts: float, seen: set[str]) -> dict:
    content = _CONTENT[pair.adapter]
    patterns = content.misc + tuple(q for intent in content.intents for q in intent.questions)
    text = _unique(seen, lambda: _user_part(rng, pair.profile, pair.adapter, patterns, max_extras=3),
                   lambda: f"Reference {rng.randint(100000, 999999)}.")
    return _record(ts, pair.tenant, pair.adapter, pair.system + text, None)


def _raw(rng: random.Random, world: _World, ts: float, seen: set[str]) -> dict:
    tenant = rng.choices(world.config.tenants, cum_weights=world.tenant_cum)[0]
    adapter = BASE_MODEL if rng.random() < 0.5 else rng.choice(world.config.adapters)
    profile = _profile(tenant)
    text = _unique(seen, lambda: _fill(rng, profile, rng.choice(_RAW_PATTERNS)),
                   lambda: f"(request {rng.randint(100000, 999999)})")
    return _record(ts, tenant, adapter, text, None)


def _unique(seen: set[str], make: Callable[[], str], suffix: Callable[[], str]) -> str:
    text = make()
    while text in seen:
        text = f"{text} {suffix()}"
    seen.add(text)
    return text


# --------------------------------------------------------------------------------------------------
# Prompt text: templates, user parts, slots.

def _make_template(rng: random.Random, profile: _Profile, tenant: str, adapter: str, number: int,
                   first_day: int, taken: set[str]) -> Template:
    content = _CONTENT[adapter]
    for _attempt in range(1000):
        kind = rng.choices(_KINDS, weights=_KIND_WEIGHTS)[0]
        intent = rng.choice(content.intents)
        body = _BODY_BUILDERS[kind](rng, profile, adapter, content, intent)
        if body not in taken:
            break
    else:
        raise ConfigError(f"cannot make {number} distinct {adapter} templates; lower templates_per_adapter")
    canned = tuple(_user_part(rng, profile, adapter, intent.questions) for _ in range(rng.randint(1, 2)))
    return Template(f"{adapter}/{tenant}/{kind}-{number}", tenant, adapter, kind, intent.name, body, first_day,
                    intent.questions, canned, round(rng.uniform(0.05, 0.35), 3))


def _rag_body(rng: random.Random, profile: _Profile, adapter: str, content: _Content, intent: _Intent) -> str:
    # The retriever finds one document about the topic, and one or two that merely look similar.
    related = [doc for doc in content.docs if doc[0] in intent.docs] or list(content.docs)
    first = rng.choice(related)
    docs = [first, *rng.sample([doc for doc in content.docs if doc is not first], rng.randint(1, 2))]
    lines = [f"[{content.doc_prefix}{stable_seed(profile.brand, adapter, title) % 9000 + 1000}] {title}: {text}"
             for title, text in docs]
    head = f"{rng.choice(content.rag_preambles)} Conversation topic: {intent.name}."
    return _fit([head, "<documents>", *lines, "</documents>"], f"\n\n{content.lead}: ", keep=4)


def _intent_body(rng: random.Random, profile: _Profile, adapter: str, content: _Content, intent: _Intent) -> str:
    guidance = rng.sample(intent.guidance, rng.randint(3, len(intent.guidance)))
    text = f"Task: {intent.name}.\n" + " ".join(guidance) + "\n" + rng.choice(content.formats)
    return f"{text}\n\n{content.lead}: "


def _fewshot_body(rng: random.Random, profile: _Profile, adapter: str, content: _Content, intent: _Intent) -> str:
    examples = rng.sample(content.examples, rng.randint(2, 3))
    blocks = [f"Below are worked examples of {intent.name} answers in the expected format."]
    for i, (question, answer) in enumerate(examples, 1):
        slots = _Slots(rng, profile)  # one set of values, so the answer names the question's order
        blocks.append(f"Example {i}\n{content.lead}: {question.format_map(slots)}\n"
                      f"{content.answer_label}: {answer.format_map(slots)}")
    return _fit(blocks, f"\n\nNow handle the next one the same way.\n{content.lead}: ", keep=3, sep="\n\n")


_BODY_BUILDERS: dict[str, Callable[[random.Random, _Profile, str, _Content, _Intent], str]] = {
    "rag": _rag_body, "intent": _intent_body, "fewshot": _fewshot_body,
}


def _fit(parts: list[str], tail: str, *, keep: int, sep: str = "\n") -> str:
    """Join parts and tail, dropping parts before the last (a document, an example) while over 200 words."""
    while len(parts) > keep and len((sep.join(parts) + tail).split()) > 200:
        del parts[-2 if parts[-1] == "</documents>" else -1]
    return sep.join(parts) + tail


def _user_part(rng: random.Random, profile: _Profile, adapter: str, patterns: tuple[str, ...],
               *, max_extras: int = 2) -> str:
    """One question from ``patterns`` plus up to ``max_extras`` extra sentences, 5 to 30 words."""
    text = _fill(rng, profile, rng.choice(patterns))
    words = len(text.split())
    extras = _CONTENT[adapter].extras
    count = rng.choices(range(max_extras + 1), weights=(50, 35, 15, 10)[:max_extras + 1])[0]
    for pattern in rng.sample(extras, min(count, len(extras))):
        extra = _fill(rng, profile, pattern)
        if words + len(extra.split()) <= 30:
            text = f"{text} {extra}"
            words += len(extra.split())
    return text


def _fill(rng: random.Random, profile: _Profile, pattern: str) -> str:
    return pattern.format_map(_Slots(rng, profile)) if "{" in pattern else pattern


class _Slots(dict):
    """Slot values made on first use from the request's generator (a slot repeated in a pattern repeats)."""

    def __init__(self, rng: random.Random, profile: _Profile) -> None:
        super().__init__()
        self.rng = rng
        self.profile = profile

    def __missing__(self, key: str) -> str:
        value = _SLOT_MAKERS[key](self.rng, self.profile, self)
        self[key] = value
        return value


def _period(rng: random.Random) -> str:
    return rng.choice((
        "last month", "last quarter", "this year", f"the last {rng.choice((7, 14, 30, 60, 90))} days",
        f"the last {rng.randint(2, 12)} weeks", f"Q{rng.randint(1, 4)} {rng.choice((2024, 2025))}",
        f"{rng.choice(_MONTHS)} {rng.choice((2024, 2025))}", f"fiscal year {rng.choice((2024, 2025, 2026))}",
    ))


def _other(pool: tuple[str, ...], rng: random.Random, taken: str | None) -> str:
    choices = [p for p in pool if p != taken] or list(pool)
    return rng.choice(choices)


_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")
_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_PARTIES = ("supplier", "customer", "licensee", "licensor", "contractor", "service provider", "client")
_FIRST_NAMES = ("anna", "ben", "carla", "deepak", "elena", "farid", "grace", "hiro", "ines", "jonas", "kemal", "lucia")
_LAST_NAMES = ("meyer", "okafor", "rossi", "nguyen", "silva", "kowalski", "dubois", "tanaka", "berg", "haddad")
_COUNTERPARTIES = ("Hooli", "Vandelay Industries", "Soylent Corp", "Umbrella Ltd", "Stark Freight", "Wayne Analytics",
                   "Tyrell Systems", "Wonka Foods", "Dunder Mifflin", "Massive Dynamic", "Pied Piper", "Oscorp")

_SLOT_MAKERS: dict[str, Callable[[random.Random, _Profile, _Slots], str]] = {
    "order": lambda r, p, s: f"{p.order_prefix}{r.randint(10000, 99999)}",
    "invoice": lambda r, p, s: f"INV-{r.choice((2024, 2025, 2026))}-{r.randint(1, 9999):04d}",
    "amount": lambda r, p, s: f"{p.symbol}{r.randint(5, 900)}.{r.randint(0, 99):02d}",
    "amount_k": lambda r, p, s: str(r.randint(10, 900)),
    "currency": lambda r, p, s: p.currency,
    "weekday": lambda r, p, s: r.choice(_WEEKDAYS),
    "month": lambda r, p, s: r.choice(_MONTHS),
    "year": lambda r, p, s: str(r.choice((2024, 2025, 2026))),
    "day": lambda r, p, s: str(r.randint(1, 28)),
    "day2": lambda r, p, s: str(r.randint(1, 28)),
    "days": lambda r, p, s: str(r.randint(2, 45)),
    "minutes": lambda r, p, s: str(r.randint(5, 120)),
    "count": lambda r, p, s: str(r.randint(2, 250)),
    "percent": lambda r, p, s: str(r.randint(2, 95)),
    "code": lambda r, p, s: r.choice(("500", "502", "503", "504", "429", "403", "E1042", "E2210")),
    "time": lambda r, p, s: f"{r.randint(0, 23):02d}:{r.choice((0, 5, 10, 15, 20, 30, 40, 45, 50)):02d}",
    "email": lambda r, p, s: f"{r.choice(_FIRST_NAMES)}.{r.choice(_LAST_NAMES)}@{r.choice(p.domains)}",
    "feature": lambda r, p, s: r.choice(p.features),
    "product": lambda r, p, s: r.choice(p.products),
    "city": lambda r, p, s: r.choice(p.cities),
    "plan": lambda r, p, s: r.choice(p.plans),
    "region": lambda r, p, s: r.choice(p.regions),
    "region2": lambda r, p, s: _other(p.regions, r, s.get("region")),
    "clause": lambda r, p, s: f"{r.randint(2, 24)}.{r.randint(1, 9)}",
    "party": lambda r, p, s: r.choice(_PARTIES),
    "other": lambda r, p, s: _other(_PARTIES, r, s.get("party")),
    "subject": lambda r, p, s: r.choice(("the use of the deliverables", "any breach of data protection law",
                                         "the negligence of its staff", "infringement of third-party rights",
                                         "late delivery of the services", "defects in the goods")),
    "counterparty": lambda r, p, s: r.choice(_COUNTERPARTIES),
    "contract": lambda r, p, s: r.choice(("master services agreement", "NDA", "supply agreement",
                                          "reseller agreement", "licence agreement", "framework agreement")),
    "jurisdiction": lambda r, p, s: r.choice(("England and Wales", "New York", "Switzerland", "Singapore",
                                              "Ireland", "Ontario", "Sweden")),
    "country": lambda r, p, s: r.choice(("India", "the United States", "Brazil", "the Philippines", "Serbia")),
    "months": lambda r, p, s: str(r.choice((6, 12, 18, 24, 36))),
    "k": lambda r, p, s: str(r.randint(3, 20)),
    "period": lambda r, p, s: _period(r),
    "category": lambda r, p, s: r.choice(("electronics", "office supplies", "furniture", "software",
                                          "accessories", "services", "spare parts")),
    "language": lambda r, p, s: r.choice(("German", "French", "Spanish", "Japanese", "Dutch", "Polish")),
    "version": lambda r, p, s: f"{r.randint(2, 6)}.{r.randint(0, 20)}.{r.randint(0, 9)}",
    "n": lambda r, p, s: str(r.randint(2, 7)),
    "a": lambda r, p, s: str(r.randint(12, 999)),
    "b": lambda r, p, s: str(r.randint(12, 999)),
    "concept": lambda r, p, s: r.choice(("consistent hashing", "a KV cache", "backpressure", "idempotent retries",
                                         "prefix caching", "rate limiting", "two-phase commit",
                                         "exponential backoff", "a write-ahead log")),
    "topic": lambda r, p, s: r.choice(("the new pricing", "a planned maintenance window", "our spring sale",
                                       "the office move", "a security update", "the quarterly results")),
    "sentence": lambda r, p, s: _sentence(r, p),
    "sentence2": lambda r, p, s: _sentence(r, p),
    "review": lambda r, p, s: (f"The {r.choice(p.products)} arrived after {r.randint(1, 20)} days and "
                               f"{r.choice(_OUTCOMES)}."),
}

_OUTCOMES = ("works perfectly", "stopped working within a week", "was not what the photos showed",
             "is fine but support never answered", "exceeded my expectations", "came with a missing part")


def _sentence(rng: random.Random, profile: _Profile) -> str:
    subject = rng.choice(("Our team", "The vendor", "The customer", "Finance", "The warehouse", "Marketing"))
    verb = rng.choice(("shipped", "approved", "cancelled", "invoiced", "returned", "ordered"))
    item = rng.choice(("laptops", "pallets", "licences", "chairs", "crates", "tickets", "monitors"))
    return (f"{subject} {verb} {rng.randint(2, 400)} {item} on {rng.choice(_MONTHS)} {rng.randint(1, 28)} "
            f"for {profile.symbol}{rng.randint(100, 90000):,}.")


_RAW_PATTERNS = (
    "Summarize in {n} bullet points: {sentence} {sentence2}",
    "Translate into {language}: {sentence}",
    "Write a short product description for a {product} in {n} sentences.",
    "Classify the sentiment of this review as positive, negative or neutral: {review}",
    "Extract every date and amount from this text: {sentence}",
    "Rewrite more formally: {sentence}",
    "Give me {n} subject lines for an email about {topic}.",
    "Explain {concept} in {n} sentences for a new engineer.",
    "What is {a} times {b}? Show the steps.",
)


# --------------------------------------------------------------------------------------------------
# Tenants.

@dataclass(frozen=True, slots=True)
class _Profile:
    brand: str
    entity: str
    description: str
    currency: str
    symbol: str
    plans: tuple[str, ...]
    hours: str
    order_prefix: str
    domains: tuple[str, ...]
    law: str
    contract_types: str
    cap: str
    payment_days: int
    regions: tuple[str, ...]
    fy_start: str
    extra_tables: str
    cities: tuple[str, ...]
    features: tuple[str, ...]
    products: tuple[str, ...]


_KNOWN_TENANTS = {"acme": "cloud", "globex": "logistics", "initech": "payroll"}


@lru_cache(maxsize=None)
def _profile(tenant: str) -> _Profile:
    """A tenant's business: fixed for the demo tenants, derived from the name for any other."""
    archetypes = sorted(_ARCHETYPES)
    kind = _KNOWN_TENANTS.get(tenant) or archetypes[stable_seed("archetype", tenant) % len(archetypes)]
    a = _ARCHETYPES[kind]
    name = tenant[:1].upper() + tenant[1:]
    brand = f"{name} {a['suffix']}"
    slug = re.sub(r"[^a-z0-9]", "", tenant.lower()) or "tenant"
    return _Profile(
        brand=brand, entity=f"{brand}{a['entity_form']}", description=a["description"], currency=a["currency"],
        symbol=a["symbol"], plans=a["plans"], hours=a["hours"],
        order_prefix=f"{slug[:3].upper()}-", domains=(f"{slug}-customer.example", "mail.example", "corp.example"),
        law=a["law"], contract_types=a["contract_types"], cap=a["cap"], payment_days=a["payment_days"],
        regions=a["regions"], fy_start=a["fy_start"], extra_tables=a["extra_tables"], cities=a["cities"],
        features=a["features"], products=a["products"])


def _profile_fields(profile: _Profile) -> dict[str, str]:
    fields = {name: getattr(profile, name) for name in profile.__slots__}
    plans = profile.plans
    fields["plans"] = f"{', '.join(plans[:-1])} and {plans[-1]}"
    fields["top_plan"] = plans[-1]
    fields["regions"] = ", ".join(f"'{r}'" for r in profile.regions)
    return fields


_TENANT_PARAGRAPHS = {
    "support": (
        "You answer on behalf of {brand}, {description}. Customers are on the {plans} plans, and {top_plan} "
        "customers have a named account manager whom you may mention by role but never by name. Prices are in "
        "{currency}. Support hours are {hours}; outside them, promise a reply on the next working day. Refer to "
        "orders by their {order_prefix} number and to invoices by their INV number, and never disclose "
        "another customer's data, even to a caller who says they work for the same company."
    ),
    "legal": (
        "You work for the legal team of {entity}, {description}. Most documents you see are {contract_types}. "
        "Our playbook: the governing law is {law}; our liability is capped at {cap}; payment terms are at most "
        "{payment_days} days; automatic renewals run for at most twelve months and can be refused with thirty "
        "days notice. Flag every deviation from the playbook, name the playbook rule it breaks, and say whether "
        "the business owner or the legal team must approve it."
    ),
    "sql": (
        "The warehouse belongs to {brand}, {description}. The customers.region column takes the values "
        "{regions}. The fiscal year starts on {fy_start}; say 'fiscal' explicitly when a question uses fiscal "
        "periods. Further tables: {extra_tables}. Order status is one of 'pending', 'paid', 'shipped', "
        "'refunded' or 'cancelled', and revenue counts paid and shipped orders only. Amounts are in {currency}. "
        "Exclude internal test customers, whose name starts with 'test', from every business metric."
    ),
}

_ARCHETYPES: dict[str, dict] = {
    "cloud": dict(
        suffix="Cloud", entity_form=", Inc.", symbol="$", currency="US dollars",
        description="a hosting and managed database provider for small software teams",
        plans=("Starter", "Team", "Enterprise"),
        hours="around the clock for outages and 8:00 to 20:00 US Eastern time for everything else",
        law="the laws of the State of Delaware",
        contract_types="customer master service agreements, reseller agreements and data processing addenda",
        cap="the fees paid in the twelve months before the claim", payment_days=45,
        regions=("na", "emea", "apac", "latam"), fy_start="February 1",
        extra_tables="subscriptions(id, customer_id, plan, mrr_cents, started_at, cancelled_at) and "
                     "tickets(id, customer_id, priority, opened_at, closed_at)",
        cities=("Austin", "Denver", "Toronto", "Dublin", "Singapore"),
        features=("dashboard", "API", "CLI", "database console", "billing page", "log viewer"),
        products=("managed Postgres instance", "object storage bucket", "load balancer", "backup add-on",
                  "dedicated runner")),
    "logistics": dict(
        suffix="Logistics", entity_form=" B.V.", symbol="€", currency="euros",
        description="a freight forwarding and warehousing company operating across Europe",
        plans=("Basic", "Business", "Premium"), hours="Monday to Friday, 7:00 to 19:00 Central European Time",
        law="the laws of the Netherlands, with the courts of Rotterdam",
        contract_types="carriage agreements, warehousing contracts and supplier framework agreements",
        cap="the freight charges of the affected shipment", payment_days=60,
        regions=("benelux", "dach", "nordics", "iberia", "uk"), fy_start="January 1",
        extra_tables="shipments(id, order_id, carrier, weight_kg, shipped_at, delivered_at) and "
                     "warehouses(id, city, capacity_pallets)",
        cities=("Rotterdam", "Hamburg", "Antwerp", "Lyon", "Gdansk"),
        features=("tracking page", "booking portal", "customs module", "label printer integration", "invoice portal"),
        products=("pallet shipment", "express parcel", "container booking", "cold storage slot",
                  "customs declaration")),
    "payroll": dict(
        suffix="Payroll", entity_form=" Inc.", symbol="$", currency="US dollars",
        description="a payroll and HR software vendor for mid-sized companies",
        plans=("Essentials", "Plus", "Premier"),
        hours="Monday to Friday, 9:00 to 18:00 US Central time, with extended hours in the last three business "
              "days of each month",
        law="the laws of the State of Texas",
        contract_types="software subscription agreements, payroll service agreements and vendor contracts",
        cap="the fees paid in the twelve months before the claim", payment_days=30,
        regions=("south", "midwest", "west", "northeast"), fy_start="July 1",
        extra_tables="payroll_runs(id, customer_id, employees, gross_cents, run_date) and "
                     "seats(customer_id, product, seats, updated_at)",
        cities=("Dallas", "Columbus", "Phoenix", "Raleigh", "Boston"),
        features=("payroll run screen", "time tracking app", "tax filing module", "employee portal", "benefits page"),
        products=("payroll run", "W-2 filing", "benefits enrolment", "time tracking add-on", "contractor payment")),
    "retail": dict(
        suffix="Retail", entity_form=" Ltd", symbol="£", currency="pounds sterling",
        description="an online retailer of home and garden products in the United Kingdom",
        plans=("Standard", "Plus", "Trade"), hours="every day from 8:00 to 22:00 UK time",
        law="the laws of England and Wales",
        contract_types="supplier agreements, marketplace terms and logistics contracts",
        cap="the value of the order concerned", payment_days=60,
        regions=("london", "south", "midlands", "north", "scotland"), fy_start="April 1",
        extra_tables="returns(id, order_id, reason, created_at) and "
                     "promotions(id, code, discount_pct, starts_at, ends_at)",
        cities=("Leeds", "Bristol", "Glasgow", "Manchester", "Cardiff"),
        features=("checkout", "order history page", "mobile app", "gift card page", "returns portal"),
        products=("garden bench", "patio heater", "lawn mower", "planter set", "outdoor lights")),
    "health": dict(
        suffix="Health", entity_form=" GmbH", symbol="€", currency="euros",
        description="a telehealth scheduling platform for clinics in Germany and Austria",
        plans=("Praxis", "Klinik", "Verbund"), hours="Monday to Friday, 8:00 to 18:00 Central European Time",
        law="the laws of Germany, with the courts of Munich",
        contract_types="clinic subscription agreements, data processing agreements and hosting contracts",
        cap="twice the annual fees", payment_days=30,
        regions=("bayern", "berlin", "nrw", "austria"), fy_start="January 1",
        extra_tables="appointments(id, customer_id, clinic_id, starts_at, status) and "
                     "clinics(id, name, city, seats)",
        cities=("Munich", "Berlin", "Cologne", "Vienna", "Hamburg"),
        features=("booking calendar", "video consultation", "patient app", "reminder emails", "billing export"),
        products=("clinic seat", "video minutes package", "SMS reminder bundle", "calendar sync add-on",
                  "onboarding session")),
}


# --------------------------------------------------------------------------------------------------
# Per-adapter content: intents, retrieved documents, few-shot examples, user-part patterns.

@dataclass(frozen=True, slots=True)
class _Intent:
    name: str
    guidance: tuple[str, ...]
    questions: tuple[str, ...]
    docs: tuple[str, ...]
    """Titles of the retrievable documents about this intent."""


@dataclass(frozen=True, slots=True)
class _Content:
    lead: str
    answer_label: str
    doc_prefix: str
    intents: tuple[_Intent, ...]
    rag_preambles: tuple[str, ...]
    docs: tuple[tuple[str, str], ...]
    formats: tuple[str, ...]
    examples: tuple[tuple[str, str], ...]
    extras: tuple[str, ...]
    misc: tuple[str, ...]


_SUPPORT = _Content(
    lead="Customer", answer_label="Assistant", doc_prefix="KB-",
    intents=(
        _Intent("refund request", (
            "Confirm the order number and the amount before promising a refund.",
            "Refunds go back to the original payment method and take five to seven business days.",
            "Orders older than ninety days are not refundable; offer account credit instead.",
            "For a partial refund, list the line items that will be refunded.",
        ), (
            "Please refund order {order}, I was charged {amount} but cancelled on {weekday}.",
            "I want my money back for {order}, the {product} arrived broken.",
            "Can I get a refund for the {plan} plan? We stopped using it after {days} days.",
        ), ("Refund policy",)),
        _Intent("duplicate charge", (
            "Ask whether one of the charges is still pending before escalating.",
            "Pending card authorisations disappear within three business days.",
            "If both charges have settled, open a billing ticket and give the customer its number.",
            "Never ask for the full card number; the last four digits are enough.",
        ), (
            "I see two charges of {amount} for invoice {invoice} on my card.",
            "You billed us twice in {month}, once on the {day} and again on the {day2}.",
            "Why was my card charged {n} times for the same order {order}?",
        ), ("Duplicate charges", "Billing cycle")),
        _Intent("outage report", (
            "Check the status page for an open incident and link it by its id.",
            "Apologise once for the inconvenience and do not guess the cause.",
            "If no incident is open, ask for the time, the region and a screenshot of the error.",
            "Do not give a resolution time that the status page does not give.",
        ), (
            "The {feature} has been timing out for {minutes} minutes, is there an outage?",
            "Everything in {city} returns error {code} since {time} UTC.",
            "Is the {feature} down? Our whole team of {count} people is blocked.",
        ), ("Incidents and the status page",)),
        _Intent("account access", (
            "Never ask for a password or a one-time code.",
            "Two-factor resets must be started by the account owner from the login page.",
            "Confirm the account email before giving any account-specific detail.",
            "An account locked after five failed attempts unlocks by itself after thirty minutes.",
        ), (
            "I lost my phone and cannot pass the two-factor login for {email}.",
            "Our only admin left the company last {weekday}, how do we get access to the account?",
            "The login page says my account is locked after {n} attempts.",
        ), ("Resetting two-factor authentication", "Single sign-on")),
        _Intent("plan change", (
            "Upgrades take effect immediately and are prorated to the day.",
            "Downgrades take effect at the end of the billing period.",
            "Mention which features the new plan adds or removes.",
            "Quote prices only from the pricing page, never from memory.",
        ), (
            "How much would it cost to move {count} users from {plan} to the next plan?",
            "Please downgrade us to the {plan} plan from next month.",
            "If I upgrade today, is the {month} invoice prorated?",
        ), ("Changing plans", "Billing cycle")),
        _Intent("delivery delay", (
            "Look up the shipment by its order number and give the carrier's latest status.",
            "Standard shipments take three to five business days, express ones one to two.",
            "Refund the shipping fee if an express shipment arrives late.",
            "Offer to reship only after the carrier confirms the parcel is lost.",
        ), (
            "Order {order} was supposed to arrive on {weekday} and it still has not.",
            "The tracking for {order} has not changed for {days} days.",
            "I paid for express shipping on {order} and it took {days} days.",
        ), ("Delivery times",)),
        _Intent("data export", (
            "Exports are compressed CSV files that stay available for seven days.",
            "Large exports are split into parts of one million rows.",
            "A failed export can be restarted from the settings page.",
            "Exports include deleted records only if the customer asks for them explicitly.",
        ), (
            "My export of {count} thousand records stopped at {percent} percent.",
            "Where can I download the export I started on {weekday}?",
            "Can I export all invoices since {month} {year} in one file?",
        ), ("Exporting data",)),
        _Intent("invoice correction", (
            "Company name, billing address and tax id can be corrected for the last twelve months.",
            "A corrected invoice gets a new number and the original is cancelled.",
            "Ask for the tax id in writing before changing it.",
            "Corrections never change the amount; amount disputes are billing tickets.",
        ), (
            "Invoice {invoice} has our old address, we moved to {city} in {month}.",
            "Please add our VAT number to all invoices since {month} {year}.",
            "The company name on invoice {invoice} is misspelled, can you fix it?",
        ), ("Invoice corrections", "Billing cycle")),
    ),
    rag_preambles=(
        "Answer the customer using only the help center articles below. Cite each article you use by its id in "
        "square brackets. If the articles do not cover the question, say so and offer to escalate to a human agent.",
        "The retrieval system found the following help center articles for this conversation. Prefer them over "
        "general knowledge, quote policy wording exactly, and cite the article id after each step that relies on it.",
        "Relevant knowledge base entries are listed below, most relevant first. Base your numbered steps on them "
        "and do not invent policy that they do not state.",
    ),
    docs=(
        ("Refund policy", "Refunds are issued to the original payment method within five to seven business days. "
         "Orders older than ninety days are not refundable, but the customer can receive account credit instead."),
        ("Billing cycle", "Invoices are issued on the first day of each month and cover the previous month. Plan "
         "changes made mid-month are prorated to the day and appear as a separate line on the next invoice."),
        ("Duplicate charges", "A duplicate charge usually means the card issuer shows a pending authorisation next "
         "to the real charge. Pending authorisations disappear within three business days."),
        ("Resetting two-factor authentication", "Agents cannot disable two-factor authentication. The account "
         "owner starts a reset from the login page, confirms the account email and waits twenty-four hours."),
        ("Incidents and the status page", "During an incident the status page is updated every thirty minutes. "
         "Agents must not guess the cause or give an estimate that the status page does not give."),
        ("Changing plans", "Upgrades take effect immediately and are prorated. Downgrades take effect at the end "
         "of the billing period, and features above the new plan's limits are disabled, not deleted."),
        ("Exporting data", "Exports are produced as compressed CSV files and are available for seven days. Large "
         "exports are split into parts of one million rows each."),
        ("Closing an account", "Only the account owner can close an account. Data is kept for thirty days after "
         "closure and then deleted; invoices stay available for seven years."),
        ("Delivery times", "Standard shipments arrive within three to five business days, express shipments "
         "within one to two. The shipping fee is refunded if an express shipment arrives late."),
        ("Single sign-on", "Single sign-on is available on the top plan. The identity provider must send the "
         "email address as the name identifier."),
        ("API rate limits", "The API allows one hundred requests per second per account. Clients above the limit "
         "receive status 429 with a Retry-After header."),
        ("Invoice corrections", "Company name, billing address and tax id can be corrected on invoices from the "
         "last twelve months. Corrected invoices get a new number."),
    ),
    formats=(
        "Reply in the customer's language and keep the reply under 150 words.",
        "Use the standard greeting and at most four numbered steps.",
        "End with the ticket category in square brackets on its own line.",
    ),
    examples=(
        ("I was charged twice for order {order} this month.",
         "Hello, and thank you for reaching out. You were charged twice for order {order}. 1. Check whether one "
         "charge is pending. 2. Pending charges disappear within three business days. 3. If both settled, reply "
         "and we refund one. Next step: check your statement on {weekday}."),
        ("How do I reset my two-factor authentication?",
         "Hello, thanks for asking. You need a new two-factor device. 1. Open the login page and choose 'Lost "
         "device'. 2. Confirm the email we send you. 3. Wait twenty-four hours. Next step: start the reset today."),
        ("The {feature} is not loading, is something down?",
         "Hello, and sorry for the trouble. The {feature} does not load for you. 1. Check the status page for an "
         "open incident. 2. If there is one, follow its updates. 3. If not, send us a screenshot. Next step: "
         "check the status page."),
        ("Can I downgrade my plan today?",
         "Hello, thank you for your message. You want a smaller plan. 1. Open Billing and choose Change plan. 2. "
         "The downgrade applies at the end of the billing period. Next step: pick the new plan in Billing."),
        ("My export failed halfway.",
         "Hello, sorry about that. Your export stopped before it finished. 1. Open Settings, then Exports. 2. "
         "Choose Restart on the failed export. 3. Large exports arrive in parts. Next step: restart the export."),
        ("My order {order} is late.",
         "Hello, thanks for your patience. Order {order} has not arrived yet. 1. The carrier's latest status is "
         "on the tracking page. 2. Standard shipments take three to five business days. Next step: we check "
         "with the carrier on {weekday}."),
        ("Please fix the address on invoice {invoice}.",
         "Hello, thank you for letting us know. Invoice {invoice} shows an old address. 1. Send the new address in "
         "writing. 2. We issue a corrected invoice with a new number. Next step: reply with the address."),
    ),
    extras=(
        "This is urgent.", "Thanks in advance.", "We are on the {plan} plan.", "My account email is {email}.",
        "I already tried logging out and in again.", "The order number is {order}.",
        "Please answer today, {count} users are waiting.", "I wrote to you about this on {weekday} already.",
    ),
    misc=(
        "Do you have a discount for non-profits? We are a team of {count}.",
        "Can you send me your security whitepaper and the latest audit report?",
        "Is the {feature} available in {language}?",
        "Who do I talk to about a partnership with {counterparty}?",
        "Your mobile app crashes when I open the {feature} on version {version}.",
        "Can I pay invoice {invoice} by bank transfer instead of card?",
        "How do I add a second billing contact, {email}, to our account?",
    ),
)

_LEGAL = _Content(
    lead="Request", answer_label="Analysis", doc_prefix="PB-",
    intents=(
        _Intent("termination review", (
            "Identify who may terminate, on what grounds and with how much notice.",
            "Compare the notice period with the playbook minimum of sixty days for convenience.",
            "Check whether prepaid fees are refunded on termination.",
            "Note any termination fee or minimum commitment that survives termination.",
        ), (
            "Clause {clause}: either party may terminate for convenience with {days} days written notice.",
            "Clause {clause}: the {party} may terminate immediately if the {other} breaches any obligation.",
            "Can we leave the {counterparty} {contract} before the end of its {months}-month term?",
        ), ("Termination",)),
        _Intent("liability review", (
            "State the cap, what it is measured against, and the carve-outs.",
            "Compare the cap with the playbook cap.",
            "Flag any unlimited liability outside fraud, wilful misconduct and personal injury.",
            "Check whether indirect and consequential losses are excluded for both parties.",
        ), (
            "Clause {clause}: the total liability of the {party} shall not exceed {amount_k} thousand {currency}.",
            "Clause {clause}: neither party excludes liability for indirect or consequential loss.",
            "Is the liability cap in clause {clause} of the {counterparty} {contract} acceptable?",
        ), ("Limitation of liability",)),
        _Intent("indemnity review", (
            "Name the indemnifying party, the covered claims and any conditions.",
            "We indemnify only for intellectual property claims about our own products.",
            "Check that claims must be notified promptly and that the indemnifier controls the defence.",
            "Flag indemnities that are not subject to the liability cap.",
        ), (
            "Clause {clause}: the {party} shall indemnify the {other} against all claims arising from {subject}.",
            "Clause {clause}: the {party} shall hold the {other} harmless from any loss, without limit.",
            "Does the indemnity in clause {clause} of the {counterparty} {contract} cover data breaches?",
        ), ("Indemnities",)),
        _Intent("renewal check", (
            "State the renewal term and the deadline to object.",
            "Renewal terms longer than twelve months deviate from the playbook.",
            "Compute the last day to object if the start date is given.",
            "Check whether prices may increase on renewal and by how much.",
        ), (
            "Clause {clause}: this agreement renews automatically for successive {months}-month terms unless "
            "terminated {days} days before renewal.",
            "When is the last day to cancel the {counterparty} renewal if the term started on {month} {day}?",
            "Clause {clause}: prices may increase by up to {percent} percent on each renewal.",
        ), ("Automatic renewal",)),
        _Intent("payment terms check", (
            "State the payment period, the currency and any late interest.",
            "Payment periods longer than the playbook maximum must be flagged.",
            "Late interest above one percent per month deviates from the playbook.",
            "Check when the supplier may suspend services for late payment.",
        ), (
            "Clause {clause}: invoices are payable within {days} days of receipt.",
            "Clause {clause}: late payments bear interest of {n} percent per month.",
            "Clause {clause}: the supplier may suspend the services if any invoice is {days} days overdue.",
        ), ("Payment terms",)),
        _Intent("exclusivity review", (
            "State what is exclusive, for whom, where and for how long.",
            "We do not accept exclusivity that restricts sales to other customers.",
            "Non-solicitation of employees is acceptable for up to twelve months.",
            "Check whether the restriction survives termination.",
        ), (
            "Clause {clause}: the {party} shall not provide similar services to any competitor of the {other}.",
            "Clause {clause}: neither party shall solicit the other's employees for {months} months after "
            "termination.",
            "Is the exclusivity in the {counterparty} {contract} limited to {country}?",
        ), ("Exclusivity",)),
        _Intent("data processing review", (
            "Identify the controller, the processor and the categories of personal data.",
            "Sub-processors need thirty days prior notice and a right to object.",
            "Transfers outside the European Economic Area need standard contractual clauses.",
            "Check the breach notification deadline; more than seventy-two hours must be flagged.",
        ), (
            "Clause {clause}: the processor may engage sub-processors without prior notice.",
            "Clause {clause}: personal data may be transferred to {country} for support purposes.",
            "Clause {clause}: the processor shall notify personal data breaches within {days} days.",
        ), ("Data processing",)),
        _Intent("governing law check", (
            "State the governing law, the courts or arbitration seat, and the rules.",
            "Compare them with the playbook governing law.",
            "Arbitration is acceptable only if the seat and the rules are named.",
            "Flag clauses that split governing law and jurisdiction between countries.",
        ), (
            "Clause {clause}: this agreement is governed by the laws of {jurisdiction}.",
            "Clause {clause}: all disputes shall be settled by arbitration in {city}.",
            "Can we accept {jurisdiction} law in the {counterparty} {contract}?",
        ), ("Governing law and venue",)),
    ),
    rag_preambles=(
        "The following playbook excerpts were retrieved for this review. Compare the clause with them and state, "
        "for each excerpt, whether the clause complies, deviates or is silent.",
        "Use the retrieved playbook rules below as the standard. Quote the rule id whenever you flag a deviation, "
        "and do not rely on rules that are not listed.",
        "Retrieved context from the contract playbook follows. Treat it as authoritative for this review.",
    ),
    docs=(
        ("Limitation of liability", "Liability must be capped at the fees paid in the twelve months before the "
         "claim. Carve-outs only for fraud, wilful misconduct, personal injury and breach of confidentiality."),
        ("Indemnities", "We give an intellectual property indemnity for our own products only, not for the "
         "counterparty's data, their modifications, or combinations with products we did not supply."),
        ("Termination", "Termination for convenience requires at least sixty days written notice. Termination "
         "for material breach requires a thirty day cure period."),
        ("Automatic renewal", "Automatic renewal is acceptable for terms of up to twelve months if either party "
         "can object at least thirty days before the renewal date, email included."),
        ("Payment terms", "Invoices are payable within the playbook payment period. Late interest may not exceed "
         "one percent per month, and suspension needs a second written reminder."),
        ("Assignment", "Either party may assign to an affiliate or to a successor in a merger without consent. "
         "Any other assignment needs prior written consent, not unreasonably withheld."),
        ("Exclusivity", "We do not accept exclusivity that restricts our sales to other customers. Employee "
         "non-solicitation is acceptable for up to twelve months after the agreement ends."),
        ("Data processing", "Personal data is processed only on documented instructions. Sub-processors need "
         "thirty days prior notice, and the customer may object on reasonable grounds."),
        ("Governing law and venue", "Our home law and courts are preferred. Arbitration is acceptable for foreign "
         "counterparties if the seat and the rules are named."),
        ("Confidentiality", "Confidentiality lasts five years after disclosure, and indefinitely for trade "
         "secrets. Disclosure to advisers and affiliates under similar duties is allowed."),
        ("Mutual NDA term", "The mutual NDA runs for two years; obligations survive for three years after it "
         "ends, and information must be returned or destroyed on request."),
    ),
    formats=(
        "Answer in at most three short paragraphs, then list open questions for the counterparty.",
        "Give a one-line verdict first: acceptable, negotiate, or reject.",
        "Use the headings Obligation, Party, Deadline, Remedy and Flags.",
    ),
    examples=(
        ("Clause 7.2: either party may terminate for convenience with 30 days notice.",
         "Obligation: give notice before ending the agreement early. Party: either party. Deadline: 30 days "
         "before termination. Remedy: none stated. Flags: termination for convenience; 30 days is below the "
         "playbook minimum of 60 days. Verdict: negotiate."),
        ("Clause 12: the supplier shall indemnify the customer against third-party IP claims.",
         "Obligation: defend and pay third-party IP claims. Party: the supplier. Deadline: none stated. Remedy: "
         "indemnity. Flags: indemnity with no cap and no notice duty. Verdict: negotiate a cap and conduct rules."),
        ("Clause 9.1: this agreement renews automatically for successive 24-month terms.",
         "Obligation: stay bound for each renewal term. Party: both parties. Deadline: none stated to object. "
         "Remedy: none. Flags: automatic renewal longer than twelve months. Verdict: negotiate to 12 months."),
        ("Clause 4.3: invoices are payable within 90 days of receipt.",
         "Obligation: pay invoices. Party: the customer. Deadline: 90 days after receipt. Remedy: none stated. "
         "Flags: payment term longer than the playbook maximum. Verdict: negotiate."),
        ("Clause 15: the customer's total liability shall not exceed {amount_k} thousand {currency}.",
         "Obligation: none; this limits a remedy. Party: the customer. Deadline: none. Remedy: damages up to the "
         "cap. Flags: limitation of liability, one-sided. Verdict: ask for a mutual cap."),
        ("Clause 21: this agreement is governed by the laws of {jurisdiction}.",
         "Obligation: none. Party: both. Deadline: none. Remedy: none. Flags: governing law differs from the "
         "playbook and no venue is named. Verdict: negotiate our home law or named arbitration."),
    ),
    extras=(
        "The counterparty is {counterparty}.", "This is their paper, not ours.", "We want to sign by {weekday}.",
        "The contract value is about {amount_k} thousand {currency}.", "Please keep it short.",
        "The business owner is worried about this one.",
    ),
    misc=(
        "Summarise the main risks in the {counterparty} {contract} in five bullets.",
        "What is the difference between a warranty and an indemnity in clause {clause}?",
        "Draft a polite email asking {counterparty} to move the governing law to {jurisdiction}.",
        "Is a {months}-month notice period usual for a {contract}?",
        "Which clauses of a {contract} usually survive termination?",
    ),
)

_SQL = _Content(
    lead="Question", answer_label="Answer", doc_prefix="DOC-",
    intents=(
        _Intent("monthly revenue query", (
            "Revenue counts paid and shipped orders only.",
            "Group by month with date_trunc on orders.created_at in UTC.",
            "Divide total_cents by 100.0 and round to two decimals.",
            "Use the monthly_revenue view only for complete past months.",
        ), (
            "Monthly revenue for {period}.",
            "Revenue per month in the {region} region for {period}, excluding refunds.",
            "How did revenue change month over month during {period}?",
        ), ("Metric: net revenue", "View: monthly_revenue")),
        _Intent("top products query", (
            "Join order_items to products on sku and report the current product name.",
            "Rank by quantity unless the question asks for revenue.",
            "Aggregate in a CTE and apply LIMIT in the outer query.",
            "Break ties by product name so that results are stable.",
        ), (
            "Top {k} products by quantity sold in {period}.",
            "Which {k} products in the {category} category earned the most in {period}?",
            "Best selling product per region for {period}.",
        ), ("Table note: order_items",)),
        _Intent("churn query", (
            "A churned customer ordered in the previous ninety days window but not in the current one.",
            "Exclude customers created less than ninety days ago.",
            "Report churn as a count and as a share of the customers active in the previous window.",
            "Use NOT EXISTS rather than NOT IN for the anti-join.",
        ), (
            "How many customers churned in the {region} region during {period}?",
            "List customers with no orders since {month} {year}.",
            "Churn rate per region for {period}.",
        ), ("Metric: churned customer",)),
        _Intent("regional sales query", (
            "Join orders to customers and group by customers.region.",
            "Revenue counts paid and shipped orders only.",
            "Show regions with no sales as zero with a LEFT JOIN from the region list.",
            "Order the result by revenue, descending.",
        ), (
            "Total revenue per region for {period}.",
            "Compare order counts in {region} and {region2} for {period}.",
            "Which region grew fastest in {period}?",
        ), ("Metric: net revenue", "Convention: test accounts")),
        _Intent("average order value query", (
            "Average order value is net revenue divided by the number of paid and shipped orders.",
            "Compute both in one CTE so numerator and denominator use the same filter.",
            "Report the value in currency units with two decimals.",
            "Basket size counts order_items.quantity, not lines.",
        ), (
            "Average order value per month for {period}.",
            "Average basket size in items per order in the {region} region for {period}.",
            "Average order value of new versus returning customers in {period}.",
        ), ("Metric: average order value",)),
        _Intent("order status breakdown", (
            "Count orders per status with a FILTER clause or GROUP BY status.",
            "Shares are counts divided by the total of the same period, as percentages.",
            "Pending orders older than the question's threshold are computed from created_at.",
            "Refund rate is refunded orders over paid, shipped and refunded orders.",
        ), (
            "Share of orders per status for {period}.",
            "How many orders are still pending after {days} days?",
            "Refund rate per product category for {period}.",
        ), ("Metric: refund rate",)),
        _Intent("new customers query", (
            "New customers are counted by customers.created_at, not by their first order.",
            "Group by week with date_trunc('week', ...) when the question asks for weeks.",
            "First order value needs a window function or DISTINCT ON per customer.",
            "Exclude internal test customers.",
        ), (
            "How many new customers signed up in the {region} region during {period}?",
            "New customers per week for {period}.",
            "Average first order value of customers created in {period}.",
        ), ("Metric: active customer", "Convention: test accounts")),
    ),
    rag_preambles=(
        "The following warehouse documentation was retrieved for this question. Follow its metric definitions "
        "exactly, even where a simpler query would look correct.",
        "Use the data dictionary entries below. If an entry defines the metric in the question, implement that "
        "definition; otherwise use the schema above.",
        "Retrieved documentation from the analytics wiki follows. Apply its conventions for time windows and "
        "exclusions.",
    ),
    docs=(
        ("Metric: net revenue", "Net revenue is the sum of orders.total_cents for orders with status 'paid' or "
         "'shipped', minus refunded amounts, divided by 100.0, grouped by created_at month in UTC."),
        ("Metric: active customer", "A customer is active in a month if they placed at least one paid or shipped "
         "order in that month. Customers created in the same month count as new, not active."),
        ("Metric: churned customer", "A customer has churned when they ordered in the previous ninety days window "
         "but not in the current one. Exclude customers created less than ninety days ago."),
        ("Metric: average order value", "Average order value is net revenue divided by the number of paid and "
         "shipped orders in the same period, with two decimals."),
        ("Convention: time windows", "'Last month' is the previous calendar month in UTC. 'Last N days' ends "
         "yesterday at midnight UTC. Quarters are calendar quarters unless the question says fiscal."),
        ("Table note: order_items", "order_items.price_cents is the unit price at order time; multiply by quantity "
         "for the line total. Join products on sku and report the current name."),
        ("Metric: refund rate", "Refund rate is orders with status 'refunded' divided by orders with status "
         "'paid', 'shipped' or 'refunded' created in the same period."),
        ("Metric: repeat purchase rate", "Repeat purchase rate is the share of customers with two or more paid or "
         "shipped orders among all customers with at least one, within the period."),
        ("View: monthly_revenue", "monthly_revenue(month, region, revenue_cents, orders) is refreshed nightly and "
         "covers complete months only. For the current month, query orders directly."),
        ("Convention: test accounts", "Customers whose name starts with 'test' are internal test accounts and "
         "are excluded from every business metric."),
    ),
    formats=(
        "Return only the query in a fenced code block, then one sentence.",
        "Prefer CTEs and name them after what they hold.",
        "Add a comment line above each CTE that says what it computes.",
    ),
    examples=(
        ("Total revenue per region for last month.",
         "```sql\nSELECT c.region, SUM(o.total_cents) / 100.0 AS revenue\nFROM orders o\nJOIN customers c ON "
         "c.id = o.customer_id\nWHERE o.status IN ('paid', 'shipped')\n  AND o.created_at >= date_trunc('month', "
         "now()) - interval '1 month'\n  AND o.created_at < date_trunc('month', now())\nGROUP BY c.region;\n```\n"
         "Sums paid and shipped orders per region for the previous month."),
        ("Top {k} products by quantity sold this year.",
         "```sql\nSELECT p.name, SUM(oi.quantity) AS sold\nFROM order_items oi\nJOIN orders o ON o.id = "
         "oi.order_id\nJOIN products p ON p.sku = oi.sku\nWHERE o.created_at >= date_trunc('year', now())\n"
         "GROUP BY p.name\nORDER BY sold DESC, p.name\nLIMIT {k};\n```\nRanks products by units sold this year."),
        ("Number of new customers per month in {year}.",
         "```sql\nSELECT date_trunc('month', c.created_at) AS month, COUNT(*) AS new_customers\nFROM customers c\n"
         "WHERE c.created_at >= '{year}-01-01' AND c.created_at < '{year}-01-01'::date + interval '1 year'\n"
         "GROUP BY 1\nORDER BY 1;\n```\nCounts customers by the month they were created."),
        ("Share of refunded orders last quarter.",
         "```sql\nSELECT AVG((o.status = 'refunded')::int) AS refund_rate\nFROM orders o\nWHERE o.status IN "
         "('paid', 'shipped', 'refunded')\n  AND o.created_at >= date_trunc('quarter', now()) - interval "
         "'3 months'\n  AND o.created_at < date_trunc('quarter', now());\n```\nRefunded over all settled orders."),
        ("Customers with no orders in the last {days} days.",
         "```sql\nSELECT c.id, c.name\nFROM customers c\nWHERE NOT EXISTS (\n  SELECT 1 FROM orders o\n  WHERE "
         "o.customer_id = c.id AND o.created_at >= now() - interval '{days} days'\n);\n```\nFinds customers "
         "without a recent order."),
        ("Average order value in the {region} region this year.",
         "```sql\nSELECT AVG(o.total_cents) / 100.0 AS avg_order_value\nFROM orders o\nJOIN customers c ON c.id "
         "= o.customer_id\nWHERE c.region = '{region}' AND o.status IN ('paid', 'shipped')\n  AND o.created_at >= "
         "date_trunc('year', now());\n```\nAverages settled orders for one region."),
    ),
    extras=(
        "Round to two decimals.", "Order by the total, descending.", "Exclude test accounts.", "Limit to {k} rows.",
        "Group by week instead of month.", "Use the monthly_revenue view if possible.",
    ),
    misc=(
        "Write a query that finds duplicate customers by name and region.",
        "Which table holds the date an order was shipped?",
        "Why does my query double count revenue when I join order_items to products?",
        "Customers whose first and last orders are more than {days} days apart.",
        "Median order value per region in {period}.",
    ),
)

_CONTENT: dict[str, _Content] = {"support": _SUPPORT, "legal": _LEGAL, "sql": _SQL}
