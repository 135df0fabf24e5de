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


def test_a_request_names_its_tenant_in_the_body_which_the_router_forwards() -> None:
    import json

    import httpx

    from warmup_tools.sim.bench.fleet import send

    seen = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((json.loads(request.content), request.headers.get("x-tenant-id")))
        usage = {"prompt_tokens": 8, "prompt_tokens_details": {"cached_tokens": 4}}
        events = [{"choices": [{"text": "a"}]}, {"choices": [], "usage": usage}]
        return httpx.Response(200, text="".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n")

    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        got = send(client, "http://router", RequestRecord(ts=1.0, prompt="p", tenant="acme", adapter="sql"))
    (body, header), = seen
    assert (body["user"], header, body["model"]) == ("acme", "acme", "sql")
    assert (got.error, got.cached_tokens, got.prompt_tokens) == ("", 4, 8)
