"""``GET /health`` (200 only when the replica is warm and ready, the sidecar's /ready, and not draining; with
the sidecar's service temperature of the replica and its adapters as the body) and ``GET /metrics`` (the load
signals routers read, under vLLM's names, fed from lora_adapter's scheduler gauges).

Both answer anyone (routers, load balancers and Prometheus probe them without a key). In trust mode what names
adapters (the temperature body, a not-ready reason, ``vllm:lora_requests_info``: which adapters are live and busy)
goes only to a caller with a tenant key; others get the status and the load figures alone."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from warmup_tools.front.errors import OpenAIError
from warmup_tools.front.serving import caller_of, front_state

router = APIRouter()


def _may_see_adapters(request: Request) -> bool:
    """Open mode: anyone; trust mode: a caller with a valid tenant key."""
    if not front_state(request).resolver.trusted:
        return True
    try:
        caller_of(request, None)
    except OpenAIError:
        return False
    return True


@router.get("/health")
async def health(request: Request) -> Response:
    if front_state(request).drain.draining:
        raise OpenAIError(503, "This replica is shutting down: it finishes the requests in flight and takes no "
                               "new ones.", code="draining")
    readiness = await front_state(request).engine.readiness(refresh=True)
    detailed = _may_see_adapters(request)
    if not readiness.ready:
        raise OpenAIError(503, "This replica is not ready to serve" + (f": {readiness.reason}" if detailed else "."),
                          code="not_ready")
    if not readiness.temperature or not detailed:
        return Response(status_code=200)
    # NOTE: a router may prefer hot replicas (the sidecar's service temperature); the status alone keeps
    # vLLM's meaning of /health.
    return JSONResponse({"temperature": readiness.temperature, "adapters": dict(readiness.adapters)})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = front_state(request)
    load = await state.engine.load()
    models = await state.engine.models()
    name = state.settings.served_model_name
    registry = CollectorRegistry()
    labels = ["model_name"]
    Gauge("vllm:num_requests_running", "Sequences in the running batches of lora_adapter's instances.", labels,
          registry=registry).labels(name).set(load.running)
    Gauge("vllm:num_requests_waiting", "Sequences waiting for a running slot on lora_adapter's instances.", labels,
          registry=registry).labels(name).set(load.waiting)
    if load.kv_usage is not None:
        Gauge("vllm:kv_cache_usage_perc", "Share of the KV budget the running sequences hold (1 = full), over "
              "instances (cached blocks they may evict are not counted, as in vLLM).",
              labels, registry=registry).labels(name).set(load.kv_usage)
    drain = state.drain
    Counter("warmup_front_requests", "Generation requests this front took (a replica's share of a fleet's "
            "traffic).", registry=registry).inc(drain.total)
    Gauge("warmup_front_requests_in_flight", "Generation requests in flight through this front (what a drain "
          "waits for).", registry=registry).set(drain.active)
    if not _may_see_adapters(request):
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
    info = Gauge("vllm:lora_requests_info", "LoRA adapters with requests running and waiting through this front; "
                 "the value is the time of the scrape.",
                 ["running_lora_adapters", "waiting_lora_adapters", "max_lora"], registry=registry)
    adapters = set(models.live())
    running = ",".join(sorted(m for m in state.in_flight.running if m in adapters))
    waiting = ",".join(sorted(m for m in state.in_flight.waiting if m in adapters))
    info.labels(running, waiting, str(len(adapters))).set(time.time())
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
