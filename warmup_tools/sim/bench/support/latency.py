"""What the concurrency benchmarks share: the streams' prompts, closed-loop levels, one level's result,
percentiles, the table row and the 8-vs-1 ratios against the concurrency targets. Imports nothing that
needs a server or a client."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, ContextManager, Sequence

from warmup_tools.demo.prompts import SYSTEM_PROMPTS, USER_QUESTIONS

#: (adapter_id, system prompt scope) per request, in turn; None is the base model.
SCOPES: tuple[tuple[str | None, str], ...] = (("support", "support"), ("legal", "legal"), ("sql", "sql"),
                                              (None, "support"))

#: The concurrency targets: 8 streams against 1.
TARGETS = {"tokens_per_s": 3.0, "ttft_p95": 3.0, "itl_p95": 2.5}


@dataclasses.dataclass(frozen=True, slots=True)
class LevelResult:
    streams: int
    requests: int
    errors: int
    output_tokens: int
    wall_s: float
    ttft_ms: list[float]
    itl_ms: list[float]
    error_messages: tuple[str, ...] = ()

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0


def stream_prompt(index: int, i: int) -> tuple[str | None, str]:
    """The adapter and prompt of stream ``index``'s request ``i``: scopes in turn, each a warm system prompt
    and a distinct question."""
    adapter, scope = SCOPES[(index + i) % len(SCOPES)]
    question = USER_QUESTIONS[scope][(index + i) % len(USER_QUESTIONS[scope])]
    return adapter, f"{SYSTEM_PROMPTS[scope]}User: {question} (stream {index}, request {i})\nAssistant:"


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    """One request as its client saw it."""

    ttft_ms: float
    itl_ms: list[float]
    output_tokens: int

    @classmethod
    def from_arrivals(cls, submitted: float, arrivals: Sequence[float]) -> Sample:
        """From the submit time and each token's arrival time (``perf_counter`` seconds)."""
        return cls((arrivals[0] - submitted) * 1000, [(b - a) * 1000 for a, b in zip(arrivals, arrivals[1:])],
                   len(arrivals))


#: Opens stream ``index`` (a connection, or nothing in process) and yields its ``request(i)``, which sends
#: the stream's ``i``-th request and returns its :class:`Sample` or raises what its client would see.
StreamOpener = Callable[[int], ContextManager[Callable[[int], Sample]]]


def run_streams(streams: int, rounds: int, open_stream: StreamOpener) -> LevelResult:
    """``streams`` closed-loop streams, each sending ``rounds`` requests back to back; all streams start
    together (after each has opened), the level's wall time runs from that start to the last answer."""
    lock = threading.Lock()
    samples: list[Sample] = []
    errors: list[str] = []
    start_line = threading.Barrier(streams + 1)

    def stream(index: int) -> None:
        with open_stream(index) as request:
            start_line.wait()
            for i in range(rounds):
                try:
                    sample = request(i)
                except Exception as exc:  # noqa: BLE001 - counted and shown, as the client saw it
                    with lock:
                        errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                with lock:
                    samples.append(sample)

    threads = [threading.Thread(target=stream, args=(i,), name=f"stream-{i}") for i in range(streams)]
    for thread in threads:
        thread.start()
    start_line.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    return level_result(streams, streams * rounds, samples, errors, time.perf_counter() - began)


def level_result(streams: int, requests: int, samples: Sequence[Sample], errors: Sequence[str],
                 wall_s: float) -> LevelResult:
    """One level's figures from its requests' samples and errors."""
    return LevelResult(streams, requests, len(errors), sum(s.output_tokens for s in samples), wall_s,
                       [s.ttft_ms for s in samples], [g for s in samples for g in s.itl_ms], tuple(errors))


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def format_row(r: LevelResult, label: str | None = None) -> str:
    return (f"  {label or f'{r.streams:2d} streams'}: {r.tokens_per_s:7.1f} output tokens/s  "
            f"TTFT p50/p95/p99 {pct(r.ttft_ms, .5):7.1f} {pct(r.ttft_ms, .95):7.1f} {pct(r.ttft_ms, .99):7.1f} ms  "
            f"ITL p50/p95/p99 {pct(r.itl_ms, .5):6.1f} {pct(r.itl_ms, .95):6.1f} {pct(r.itl_ms, .99):6.1f} ms  "
            f"requests {r.requests}, errors {r.errors}")


def format_ratios(results: Sequence[LevelResult]) -> str:
    by_streams = {r.streams: r for r in results}
    one, eight = by_streams.get(1), by_streams.get(8)
    if one is None or eight is None or not one.ttft_ms or not eight.ttft_ms:
        return "8 vs 1 streams: not measured"
    ratios = {
        "tokens_per_s": eight.tokens_per_s / one.tokens_per_s,
        "ttft_p95": pct(eight.ttft_ms, 0.95) / pct(one.ttft_ms, 0.95),
        "itl_p95": pct(eight.itl_ms, 0.95) / pct(one.itl_ms, 0.95),
    }
    met = {
        "tokens_per_s": ratios["tokens_per_s"] >= TARGETS["tokens_per_s"],
        "ttft_p95": ratios["ttft_p95"] <= TARGETS["ttft_p95"],
        "itl_p95": ratios["itl_p95"] <= TARGETS["itl_p95"],
    }
    return (f"8 vs 1 streams: tokens/s x{ratios['tokens_per_s']:.2f} (target >= {TARGETS['tokens_per_s']}: "
            f"{'met' if met['tokens_per_s'] else 'NOT met'}), TTFT p95 x{ratios['ttft_p95']:.2f} "
            f"(target <= {TARGETS['ttft_p95']}: {'met' if met['ttft_p95'] else 'NOT met'}), ITL p95 "
            f"x{ratios['itl_p95']:.2f} (target <= {TARGETS['itl_p95']}: {'met' if met['itl_p95'] else 'NOT met'})")
