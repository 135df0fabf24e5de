"""``bench fleet``'s replay: every record sent once, by as many clients as asked, answers in record order."""

from __future__ import annotations

import threading

from warmup_tools.common.records import RequestRecord
from warmup_tools.sim.bench.fleet import figures, replay
from warmup_tools.sim.bench.support.sending import Answer


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

    from warmup_tools.sim.bench.support.sending import send

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


def test_a_failure_keeps_its_status_its_error_kind_and_the_worker_the_router_named() -> None:
    """Each way a request fails, answered by a stand-in server (the real router and replicas: the integration
    test of bench fleet-scale): an OpenAI error body, a plain one, an error event mid-stream, a stream without
    usage, a timeout."""
    import json

    import httpx

    from warmup_tools.sim.bench.support.sending import ROUTED_WORKER_HEADER, send

    def answer(request: httpx.Request) -> httpx.Response:
        prompt = json.loads(request.content)["prompt"]
        worker = {ROUTED_WORKER_HEADER: "w-7"}
        if prompt == "busy":
            body = {"error": {"message": "queue full", "type": "rate_limit_error", "code": "server_busy"}}
            return httpx.Response(429, json=body, headers=worker)
        if prompt == "plain":
            return httpx.Response(502, text="Bad Gateway")
        if prompt == "mid-stream":
            error = {"error": {"message": "internal error", "type": "internal_error", "code": None}}
            return httpx.Response(200, text=f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n", headers=worker)
        if prompt == "no usage":
            return httpx.Response(200, text='data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n')
        raise httpx.ReadTimeout("timed out", request=request)

    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        got = {p: send(client, "http://router", RequestRecord(ts=1.0, prompt=p))
               for p in ("busy", "plain", "mid-stream", "no usage", "slow")}
    assert (got["busy"].status, got["busy"].kind, got["busy"].worker) == (429, "server_busy", "w-7")
    assert "queue full" in got["busy"].error
    assert (got["plain"].status, got["plain"].kind, got["plain"].worker) == (502, "http_502", "")
    assert (got["mid-stream"].status, got["mid-stream"].kind, got["mid-stream"].worker) == (200, "internal_error",
                                                                                           "w-7")
    assert (got["no usage"].status, got["no usage"].kind) == (200, "no_usage")
    assert (got["slow"].status, got["slow"].kind) == (0, "ReadTimeout")
    assert all(a.error for a in got.values())


def test_failures_are_tallied_by_status_kind_and_replica_most_first() -> None:
    from warmup_tools.sim.bench.support.sending import error_kind, failure_tally, failures_table, replica_named

    r1, r2 = "http://127.0.0.1:1000", "http://127.0.0.1:100"
    answers = [Answer(0, 1.0, 0, 8), Answer(1, 0.0, 0, 0, "HTTP 503: not ready", 503, "not_ready", f"{r1}/m/base"),
               Answer(2, 0.0, 0, 0, "HTTP 503: not ready", 503, "not_ready", f"{r1}/m/sql"),
               Answer(3, 0.0, 0, 0, "ReadTimeout: timed out", 0, "ReadTimeout"),
               Answer(4, 0.0, 0, 0, "HTTP 503: not ready", 503, "not_ready", f"{r2}/m/base"),
               Answer(5, 0.0, 0, 0, "HTTP 500: x", 500, "internal_error", "w9")]
    by_url = {r1: "r1", r2: "r2"}
    tally = failure_tally(answers, by_url)
    assert tally == [(503, "not_ready", "r1", 2), (0, "ReadTimeout", "-", 1), (500, "internal_error", "w9", 1),
                     (503, "not_ready", "r2", 1)], "an unknown worker kept as the router named it"
    text = failures_table(answers, by_url)
    assert "| 503 | not_ready | r1 | 2 | HTTP 503: not ready |" in text
    assert "| - | ReadTimeout | - | 1 | ReadTimeout: timed out |" in text
    assert failures_table(answers[:1]) == "", "nothing failed: no table"
    assert replica_named("http://127.0.0.1:10000/m/base", by_url) == "http://127.0.0.1:10000/m/base", "not r1's"
    assert error_kind('{"error": {"type": "timeout", "code": null}}') == "timeout"
    assert error_kind("not json") == "" and error_kind('{"error": "upstream gone"}') == "upstream gone"
