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

import json
import math
import random
import re
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from pathlib import Path

from warmup_tools.common.digests import prompt_digest, stable_seed
from warmup_tools.common.errors import ConfigError
from warmup_tools.common.jsonl import read_json_lines, write_json_lines
from warmup_tools.common.records import RequestRecord
from warmup_tools.demo.prompts import SYSTEM_PROMPTS

DAY_SECONDS = 86_400
#: The generator's word lists and content tables (real-looking filler, no model of its own).
WORDS_FILE = Path(__file__).with_name("traffic_words.json")
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
        check_common(self, "traffic", ("zipf_s", "long_tail_share", "raw_share", "burst_probability", "drift",
                                       "start"))
        _check_int("templates_per_adapter", self.templates_per_adapter, minimum=1)
        if not self.adapters:
            raise ConfigError(f"traffic adapters must be distinct and non-empty, got {self.adapters!r}")
        unknown = [a for a in self.adapters if a not in _CONTENT]
        if unknown:
            raise ConfigError(f"no traffic content for adapters {unknown}; known: {sorted(_CONTENT)}")
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


def check_common(config: object, label: str, numbers: Iterable[str]) -> None:
    """The checks every traffic config shares: tenant and adapter names (distinct, ``_NAME``, made
    tuples), seed, days and requests per day, and ``numbers`` finite; ``label`` starts each message."""
    for name in ("tenants", "adapters"):
        value = getattr(config, name)
        if isinstance(value, str) or not isinstance(value, Iterable):
            raise ConfigError(f"{label} {name} must be a sequence of names, got {value!r}")
        object.__setattr__(config, name, tuple(value))
    _check_int("seed", config.seed, minimum=None, label=label)
    _check_int("days", config.days, minimum=1, label=label)
    _check_int("requests_per_day", config.requests_per_day, minimum=1, label=label)
    if not config.tenants or len(set(config.tenants)) != len(config.tenants):
        raise ConfigError(f"{label} tenants must be distinct and non-empty, got {config.tenants!r}")
    if len(set(config.adapters)) != len(config.adapters):
        raise ConfigError(f"{label} adapters must be distinct, got {config.adapters!r}")
    for kind, names in (("tenant", config.tenants), ("adapter", config.adapters)):
        for name in names:
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                raise ConfigError(f"{label} {kind} {name!r} must match {_NAME.pattern}")
    for name in numbers:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{label} {name} must be a finite number, got {value!r}")


def _check_int(name: str, value: object, *, minimum: int | None, label: str = "traffic") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ConfigError(f"{label} {name} must be an integer{bound}, got {value!r}")


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
            for pair, template, extra in bursts[minute]:  # noqa: B007 (used after the break)
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


def _sentence(rng: random.Random, profile: _Profile) -> str:
    subject = rng.choice(("Our team", "The vendor", "The customer", "Finance", "The warehouse", "Marketing"))
    verb = rng.choice(("shipped", "approved", "cancelled", "invoiced", "returned", "ordered"))
    item = rng.choice(("laptops", "pallets", "licences", "chairs", "crates", "tickets", "monitors"))
    return (f"{subject} {verb} {rng.randint(2, 400)} {item} on {rng.choice(_MONTHS)} {rng.randint(1, 28)} "
            f"for {profile.symbol}{rng.randint(100, 90000):,}.")


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


def _load_words() -> dict[str, object]:
    """Read the word lists: JSON lists become tuples, typed objects become :class:`_Content` / :class:`_Intent`."""
    types = {"_Content": _Content, "_Intent": _Intent}

    def decode(value: object) -> object:
        if isinstance(value, list):
            return tuple(decode(v) for v in value)
        if isinstance(value, dict):
            kind = value.get("__type__")
            fields = {k: decode(v) for k, v in value.items() if k != "__type__"}
            return types[kind](**fields) if kind else fields
        return value

    return {name: decode(value) for name, value in json.loads(WORDS_FILE.read_text(encoding="utf-8")).items()}


#: The generator's word lists and content tables (package data: :data:`WORDS_FILE`).
_WORDS = _load_words()
_MONTHS = _WORDS["_MONTHS"]
_WEEKDAYS = _WORDS["_WEEKDAYS"]
_PARTIES = _WORDS["_PARTIES"]
_FIRST_NAMES = _WORDS["_FIRST_NAMES"]
_LAST_NAMES = _WORDS["_LAST_NAMES"]
_COUNTERPARTIES = _WORDS["_COUNTERPARTIES"]
_OUTCOMES = _WORDS["_OUTCOMES"]
_RAW_PATTERNS = _WORDS["_RAW_PATTERNS"]
_TENANT_PARAGRAPHS = _WORDS["_TENANT_PARAGRAPHS"]
_ARCHETYPES = _WORDS["_ARCHETYPES"]
_SUPPORT = _WORDS["_SUPPORT"]
_LEGAL = _WORDS["_LEGAL"]
_SQL = _WORDS["_SQL"]
_CONTENT: dict[str, _Content] = {"support": _SUPPORT, "legal": _LEGAL, "sql": _SQL}
