"""What ``bench soak`` judges, without a server: recovery windows and lost requests, whether a bad request
got a clear error, and whether a process's RSS, open files and threads stayed flat.

Times are seconds since the traffic started (``t_s``). Imports nothing that needs a server or a client.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Mapping, Sequence

from warmup_tools.common.errors import WarmupToolsError

#: The HTTP status Triton answers for each ``pb_utils.TritonError`` code (its HTTP frontend's mapping).
HTTP_STATUS: dict[str, int] = {"INVALID_ARG": 400, "NOT_FOUND": 404, "UNAVAILABLE": 503, "INTERNAL": 500}

#: Request outcomes as the client saw them.
OK, CANCELLED, ERROR, HUNG = "ok", "cancelled", "error", "hung"


# ----------------------------------------------------------------------------------------- settings
@dataclasses.dataclass(frozen=True, slots=True)
class SoakSettings:
    duration_s: float
    kill_every_s: float
    concurrency: int
    bad_share: float
    cancel_share: float
    direct_share: float
    settle_s: float
    sample_every_s: float
    grace_s: float
    max_tokens: int
    seed: int

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise WarmupToolsError("--concurrency must be at least 1")
        shares = (self.bad_share, self.cancel_share, self.direct_share)
        if not all(0.0 <= s <= 1.0 for s in shares) or sum(shares) > 1.0:
            raise WarmupToolsError("--bad-share, --cancel-share and --direct-share must be shares that sum to 1 "
                                   "or less")
        if not 1 <= self.max_tokens <= 512:
            raise WarmupToolsError("--max-tokens must be 1 to 512 (lora_adapter's max_tokens_limit)")

    def kill_times(self) -> list[float]:
        """Seconds after the traffic's start at which the stub is killed (every interval before the end)."""
        times, t = [], self.kill_every_s
        while t < self.duration_s:
            times.append(t)
            t += self.kill_every_s
        return times


# ------------------------------------------------------------------------------------------ windows
@dataclasses.dataclass(frozen=True, slots=True)
class Window:
    """A recovery window: from a stub's kill until the sidecar's ``/ready`` answered 200 again, plus a
    grace period (``end_s``). ``ready_s`` is None when ``/ready`` never came back before the run ended."""

    kill_s: float
    ready_s: float | None
    end_s: float
    not_ready_s: float | None = None

    @classmethod
    def after_kill(cls, kill_s: float, ready_s: float | None, grace_s: float, run_end_s: float,
                   not_ready_s: float | None = None) -> Window:
        end = ready_s + grace_s if ready_s is not None else run_end_s
        return cls(kill_s, ready_s, end, not_ready_s)


def overlaps(start_s: float, end_s: float, windows: Sequence[Window]) -> bool:
    """Whether a request that ran from ``start_s`` to ``end_s`` overlaps a recovery window."""
    return any(start_s <= w.end_s and end_s >= w.kill_s for w in windows)


def in_windows(t_s: float, windows: Sequence[Window]) -> bool:
    return any(w.kill_s <= t_s <= w.end_s for w in windows)


# ----------------------------------------------------------------------------------------- requests
@dataclasses.dataclass(frozen=True, slots=True)
class BadKind:
    """One kind of bad request and the error it must get.

    ``code`` is the Triton error class expected; over HTTP it is checked against the status, over a gRPC
    stream (where Triton sends the message alone) through ``fragment``, which only that error's message
    holds. ``secret`` is the part of the bad value the message must not echo (empty: nothing to check)."""

    name: str
    transport: str  # "http" (ensemble generate), "grpc" (ensemble stream) or "direct" (lora_adapter stream)
    code: str
    fragment: str
    secret: str = ""
    #: The HTTP status where Triton does not answer ``code``'s own (see the bad mix).
    http_status: int | None = None

    @property
    def expected_status(self) -> int:
        return self.http_status if self.http_status is not None else HTTP_STATUS[self.code]


@dataclasses.dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request of the soak: its class (``planned``, ``unplanned``, ``direct``, ``cancel``, ``bad``),
    when it ran, how it ended, the error's message and status (HTTP status, or None over gRPC)."""

    kind: str
    start_s: float
    end_s: float
    outcome: str
    adapter: str = ""
    tenant: str = ""
    error: str = ""
    status: int | str | None = None
    bad_kind: str = ""
    cached_tokens: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0


#: Verdicts on a bad request; only the first one is right.
ANSWERED, SUCCEEDED, WRONG_CLASS, UNCLEAR, ECHOED = ("answered", "succeeded", "wrong class", "unclear message",
                                                     "echoed the value")


def judge_bad(kind: BadKind, record: RequestRecord) -> str:
    """Whether a bad request got the clear error it must get (:data:`ANSWERED`), or what went wrong."""
    if record.outcome == HUNG:
        return HUNG
    if record.outcome != ERROR:
        return SUCCEEDED
    if kind.transport == "http" and record.status != kind.expected_status:
        return WRONG_CLASS
    if kind.fragment not in record.error:
        return UNCLEAR
    if kind.secret and kind.secret in record.error:
        return ECHOED
    return ANSWERED


@dataclasses.dataclass(slots=True)
class Accounting:
    """The requests of a run, sorted out against the recovery windows."""

    sent: dict[str, int] = dataclasses.field(default_factory=dict)
    ok: dict[str, int] = dataclasses.field(default_factory=dict)
    cancelled: int = 0
    #: Good requests that failed or hung while overlapping a recovery window (expected, not lost).
    outage_failures: list[RequestRecord] = dataclasses.field(default_factory=list)
    #: Good requests that failed or hung outside every recovery window.
    lost: list[RequestRecord] = dataclasses.field(default_factory=list)
    bad_sent: dict[str, int] = dataclasses.field(default_factory=dict)
    bad_answered: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Bad requests outside the windows that did not get their clear error, with the verdict.
    bad_failed: list[tuple[RequestRecord, str]] = dataclasses.field(default_factory=list)
    #: Bad requests overlapping a window (not judged: the stub that would refuse them may be down).
    bad_in_window: int = 0

    @property
    def good_sent(self) -> int:
        return sum(n for kind, n in self.sent.items() if kind != "bad")


def account(records: Iterable[RequestRecord], windows: Sequence[Window],
            bad_kinds: Mapping[str, BadKind]) -> Accounting:
    """Sort each request out: served, cancelled, failed in a window, lost; each bad one judged."""
    result = Accounting()
    for record in records:
        result.sent[record.kind] = result.sent.get(record.kind, 0) + 1
        in_window = overlaps(record.start_s, record.end_s, windows)
        if record.kind == "bad":
            name = record.bad_kind
            result.bad_sent[name] = result.bad_sent.get(name, 0) + 1
            verdict = judge_bad(bad_kinds[name], record)
            if verdict == ANSWERED:
                result.bad_answered[name] = result.bad_answered.get(name, 0) + 1
            elif in_window:
                result.bad_in_window += 1
            else:
                result.bad_failed.append((record, verdict))
        elif record.outcome == OK:
            result.ok[record.kind] = result.ok.get(record.kind, 0) + 1
        elif record.outcome == CANCELLED:
            result.cancelled += 1
        elif in_window:
            result.outage_failures.append(record)
        else:
            result.lost.append(record)
    return result


def error_class(message: str, limit: int = 80) -> str:
    """A short, stable label of an error message for tables (numbers and quoted values blanked)."""
    text = re.sub(r"'[^']*'", "'…'", message)
    text = re.sub(r"\d+(\.\d+)?", "N", text)
    return text[:limit]


# --------------------------------------------------------------------------------------- processes
@dataclasses.dataclass(frozen=True, slots=True)
class ProcSample:
    """One process at one moment: ``age_s`` is how long the process had been running."""

    t_s: float
    role: str
    pid: int
    age_s: float
    rss_bytes: int
    fds: int
    threads: int


METRICS: tuple[str, ...] = ("rss_bytes", "fds", "threads")


@dataclasses.dataclass(frozen=True, slots=True)
class Tolerance:
    """Growth allowed per 10 minutes: the larger of ``relative`` times the level and ``absolute``."""

    relative: float
    absolute: float

    def allowed(self, level: float) -> float:
        return max(self.relative * abs(level), self.absolute)

    def describe(self, metric: str) -> str:
        unit = " MiB" if metric == "rss_bytes" else ""
        absolute = self.absolute / (1 << 20) if metric == "rss_bytes" else self.absolute
        relative = f"{self.relative:.0%} of the level or " if self.relative else ""
        return f"{relative}{absolute:g}{unit} per 10 min"


TOLERANCES: dict[str, Tolerance] = {
    "rss_bytes": Tolerance(0.02, 8 << 20),
    "fds": Tolerance(0.0, 2.0),
    "threads": Tolerance(0.0, 2.0),
}

#: Settled samples a fit needs, and the time they must span.
MIN_SAMPLES, MIN_SPAN_S = 3, 60.0

FLAT, GROWING, NO_DATA = "flat", "growing", "not enough data"


@dataclasses.dataclass(frozen=True, slots=True)
class Flatness:
    role: str
    metric: str
    at_settle: float | None
    max_after: float | None
    slope_per_10min: float | None
    allowed_per_10min: float | None
    samples: int
    processes: int
    verdict: str


def settled(sample: ProcSample, settle_s: float, windows: Sequence[Window]) -> bool:
    """Whether a sample counts for the fit: ``settle_s`` after both the traffic's start and its process's
    start (a stub started by a recovery settles like the first one did), outside every recovery window."""
    return sample.t_s >= settle_s and sample.age_s >= settle_s and not in_windows(sample.t_s, windows)


def pooled_slope(groups: Mapping[int, Sequence[tuple[float, float]]]) -> float | None:
    """Least-squares slope (per second) of ``(t, y)`` points with one intercept per group (process) and one
    common slope: a process that replaced another starts at its own level, its growth is what counts."""
    num = den = 0.0
    for points in groups.values():
        if not points:
            continue
        t_mean = sum(t for t, _ in points) / len(points)
        y_mean = sum(y for _, y in points) / len(points)
        num += sum((t - t_mean) * (y - y_mean) for t, y in points)
        den += sum((t - t_mean) ** 2 for t, _ in points)
    return num / den if den > 0 else None


def flatness(samples: Sequence[ProcSample], role: str, metric: str, settle_s: float, windows: Sequence[Window],
             tolerance: Tolerance | None = None) -> Flatness:
    """One role's metric: the value at ``settle_s``, the max after, the slope over the settled samples
    per 10 minutes, and the verdict against ``tolerance`` (only growth fails: a level that falls is flat)."""
    tolerance = tolerance or TOLERANCES[metric]
    mine = sorted((s for s in samples if s.role == role), key=lambda s: s.t_s)
    after = [s for s in mine if s.t_s >= settle_s]
    at_settle = float(getattr(after[0], metric)) if after else None
    max_after = float(max(getattr(s, metric) for s in after)) if after else None
    groups: dict[int, list[tuple[float, float]]] = {}
    for s in mine:
        if settled(s, settle_s, windows):
            groups.setdefault(s.pid, []).append((s.t_s, float(getattr(s, metric))))
    points = [p for g in groups.values() for p in g]
    span = sum(max(t for t, _ in g) - min(t for t, _ in g) for g in groups.values())
    slope = pooled_slope(groups) if len(points) >= MIN_SAMPLES and span >= MIN_SPAN_S else None
    if slope is None:
        return Flatness(role, metric, at_settle, max_after, None, None, len(points), len(groups), NO_DATA)
    level = at_settle if at_settle is not None else sum(y for _, y in points) / len(points)
    per_10 = slope * 600.0
    allowed = tolerance.allowed(level)
    return Flatness(role, metric, at_settle, max_after, per_10, allowed, len(points), len(groups),
                    FLAT if per_10 <= allowed else GROWING)


def process_role(argv: Sequence[str]) -> str | None:
    """The role of a process of the stack from its command line: ``tritonserver``, a Python backend stub
    by its model instance (``lora_adapter_0_0``; the stub's arguments name it), else None."""
    if not argv:
        return None
    program = argv[0].rsplit("/", 1)[-1]
    if program == "tritonserver":
        return "tritonserver"
    if program != "triton_python_backend_stub" or len(argv) < 2:
        return None
    parts = argv[1].split("/")
    model = parts[-3] if len(parts) >= 3 else parts[-1]
    instance = re.compile(rf"^{re.escape(model)}_\d+_\d+$")
    return next((arg for arg in argv[2:] if instance.match(arg)), model)


# ------------------------------------------------------------------------------------------ report
def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / (1 << 20):.1f}"


def _num(value: float | None, metric: str) -> str:
    if value is None:
        return "-"
    return _mib(value) if metric == "rss_bytes" else f"{value:g}" if float(value).is_integer() else f"{value:.2f}"


def flatness_table(rows: Sequence[Flatness]) -> list[str]:
    lines = ["| process | metric | at settle | max after | slope per 10 min | allowed per 10 min | samples "
             "(processes) | verdict |", "|---|---|---|---|---|---|---|---|"]
    names = {"rss_bytes": "RSS MiB", "fds": "open files", "threads": "threads"}
    for r in rows:
        lines.append(f"| {r.role} | {names[r.metric]} | {_num(r.at_settle, r.metric)} | "
                     f"{_num(r.max_after, r.metric)} | {_signed(r.slope_per_10min, r.metric)} | "
                     f"{_num(r.allowed_per_10min, r.metric)} | {r.samples} ({r.processes}) | {r.verdict} |")
    return lines


def _signed(value: float | None, metric: str) -> str:
    if value is None:
        return "-"
    shown = value / (1 << 20) if metric == "rss_bytes" else value
    return f"{shown:+.2f}"
