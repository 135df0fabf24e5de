"""Sending a request through the smg router (or straight to a replica's front) as a streamed completion, its
answer as a client saw it, and the failures of a run counted by reason: what ``bench fleet``, ``fleet-scale`` and
``rollout`` send and print."""

from __future__ import annotations

import collections
import dataclasses
import json
from typing import Mapping, Sequence

import httpx

from warmup_tools.common.records import RequestRecord
from warmup_tools.sim.bench.support.openai_stream import StreamError, stream_completion
from warmup_tools.sim.bench.support.tables import markdown


@dataclasses.dataclass(frozen=True, slots=True)
class Answer:
    """One replayed request through the router."""

    ts: float
    ttft_ms: float
    cached_tokens: int
    prompt_tokens: int
    error: str = ""
    #: A failure's HTTP status (0: none came: a transport error, or a failure after a 200).
    status: int = 0
    #: A failure's kind: the OpenAI error's ``code`` (else its ``type``) from the body or a mid-stream event, the
    #: exception's class for a transport error (``ReadTimeout``, ``RemoteProtocolError``), ``no_usage``.
    kind: str = ""
    #: The worker that answered, as the router names it (:data:`ROUTED_WORKER_HEADER`; "" when it does not say).
    worker: str = ""



#: The response header in which the smg router names the worker it routed a request to.
ROUTED_WORKER_HEADER = "x-smg-routed-worker-id"



def error_kind(body: str) -> str:
    """The ``code`` (else the ``type``) of an OpenAI error body; ``""`` when ``body`` is not one."""
    try:
        data = json.loads(body)
    except ValueError:
        return ""
    info = data.get("error") if isinstance(data, dict) else None
    if isinstance(info, dict):
        return str(info.get("code") or info.get("type") or "")
    return str(info) if isinstance(info, str) else ""



def failure_tally(answers: Sequence[Answer], replica_of: Mapping[str, str] | None = None) -> list[tuple[int, str,
                                                                                                       str, int]]:
    """The failed answers counted by (status, kind, replica), most first: ``replica_of`` maps a replica's URL to
    its name (the router names a worker by its URL, a replica's front URL and ``/m/<model>``); a worker of no
    replica it knows is kept as named, ``-`` when none was named."""
    counts: collections.Counter[tuple[int, str, str]] = collections.Counter()
    for a in answers:
        if a.error:
            counts[(a.status, a.kind or "-", replica_named(a.worker, replica_of or {}) or "-")] += 1
    return [(status, kind, replica, n) for (status, kind, replica), n in
            sorted(counts.items(), key=lambda item: (-item[1], item[0]))]



def replica_named(worker: str, replica_of: Mapping[str, str]) -> str:
    """The replica whose URL ``worker`` (as the router names it) is or is under; ``worker`` itself otherwise."""
    for url, name in replica_of.items():
        if worker == url or worker.startswith(url.rstrip("/") + "/"):
            return name
    return worker



def failures_table(answers: Sequence[Answer], replica_of: Mapping[str, str] | None = None) -> str:
    """:func:`failure_tally` as a Markdown table with one example message per reason (``""``: none failed)."""
    tally = failure_tally(answers, replica_of)
    if not tally:
        return ""
    example: dict[tuple[int, str], str] = {}
    for a in answers:
        if a.error:
            example.setdefault((a.status, a.kind or "-"), a.error)
    return markdown(("HTTP status", "error kind", "replica", "failed", "example"),
                    [(str(status or "-"), kind, replica, str(n), example[(status, kind)][:160].replace("|", "/"))
                     for status, kind, replica, n in tally])



def send(client: httpx.Client, url: str, record: RequestRecord, max_tokens: int = 1) -> Answer:
    """``record`` as a streamed completion: ms to the first event with text, and the usage it reports. The tenant
    goes in ``user`` as well as ``X-Tenant-Id``: smg 1.13 forwards the body and not that header, and a request
    without a tenant is served as ``default``, whose KV blocks no plan for the log's tenants holds."""
    body = {"model": record.adapter or "base", "prompt": record.prompt or "", "max_tokens": max_tokens}
    if record.tenant:
        body["user"] = record.tenant
    headers = {"X-Tenant-Id": record.tenant} if record.tenant else {}
    try:
        streamed = stream_completion(client, f"{url}/v1/completions", body, headers)
    except StreamError as exc:
        return Answer(record.ts, 0.0, 0, 0, str(exc), exc.status, error_kind(exc.text) or f"http_{exc.status}",
                      exc.headers.get(ROUTED_WORKER_HEADER, ""))
    except httpx.HTTPError as exc:
        return Answer(record.ts, 0.0, 0, 0, f"{type(exc).__name__}: {exc}", 0, type(exc).__name__)
    worker = streamed.headers.get(ROUTED_WORKER_HEADER, "")
    if streamed.error is not None:
        kind = str(streamed.error.get("code") or streamed.error.get("type") or "stream_error")
        return Answer(record.ts, 0.0, 0, 0, f"error in the stream: {str(streamed.error.get('message', ''))[:300]}",
                      200, kind, worker)
    if not streamed.usage:
        return Answer(record.ts, 0.0, 0, 0, "no usage in the stream", 200, "no_usage", worker)
    return Answer(record.ts, (streamed.ttft_s or streamed.total_s) * 1000, streamed.cached_tokens,
                  int(streamed.usage.get("prompt_tokens", 0)), worker=worker)
