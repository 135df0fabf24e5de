"""``GET /grpc-workers``: the gRPC worker listeners of the live models, ``{"workers": [{"model", "port"}, ...]}``,
the base model first; what a fleet registers with smg as ``grpc://<replica>:<port>`` workers. 404 when the front
serves none (``grpc_worker_port`` 0, and always in trust mode, where the listeners are refused)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from warmup_tools.front.errors import OpenAIError

router = APIRouter()


@router.get("/grpc-workers")
async def grpc_workers(request: Request) -> JSONResponse:
    workers = getattr(request.app.state, "grpc_workers", None)
    if workers is None:
        raise OpenAIError(404, "This replica serves no gRPC workers (grpc_worker_port is 0).", code="not_found")
    return JSONResponse({"workers": workers.workers()})
