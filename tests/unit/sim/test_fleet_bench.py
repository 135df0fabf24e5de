"""``bench fleet``'s replay: every record sent once, by as many clients as asked, answers in record order."""

from __future__ import annotations

import threading

from warmup_tools.common.records import RequestRecord
from warmup_tools.sim.bench.fleet import Answer, figures, replay


def _records(n: int) -> list[RequestRecord]:
    return [RequestRecord(ts=float(i), prompt=f"prompt {i}", tenant="t") for i in range(n)]


def test_replay_sends_each_record_once_and_answers_in_record_order() -> None:
    sent: list[float] = []
    lock = threading.Lock()

    def sender(client, url, record):
        with lock:
            sent.append(record.ts)
        return Answer(record.ts, 1.0, 0, 4)

    records = _records(37)
    answers = replay("http://router", records, users=4, sender=sender)
    assert sorted(sent) == [r.ts for r in records]
    assert [a.ts for a in answers] == [r.ts for r in records]


def test_replay_by_one_client_keeps_the_log_order() -> None:
    sent: list[float] = []
    records = _records(10)
    replay("http://router", records, users=1, sender=lambda c, u, r: sent.append(r.ts) or Answer(r.ts, 1.0, 2, 4))
    assert sent == [r.ts for r in records]


def test_figures_count_cold_requests_and_failures() -> None:
    answers = [Answer(0, 10.0, 0, 8), Answer(1, 20.0, 8, 8), Answer(2, 0.0, 0, 0, "HTTP 503")]
    stats = figures("x", answers)
    assert (stats.requests, stats.failed, stats.cold_share, stats.cached_share) == (3, 1, 0.5, 0.5)
