"""The ``VllmEngine`` RPCs of one model (the base model or one adapter), on the front's Triton engine.

What each answers (docs/fleet.md, "smg's gRPC worker protocol"): ``Generate`` streams token ids from lora_adapter
(:meth:`~warmup_tools.front.engine.triton_engine.TritonEngine.generate_tokens`) under the tenant ``default``;
``Abort`` cancels running generations by request id; ``HealthCheck`` succeeds only while the replica is ready
(warm) and the model live, and otherwise fails the call (smg ignores the ``healthy`` field when it registers a
worker); ``GetModelInfo`` names the listener's model with no ``model_path`` (so smg never reaches for a hub);
``GetServerInfo`` gives lora_adapter's KV block size; ``GetLoads`` the scheduler's gauges; ``GetTokenizer`` the
LM tokenizer's zip; ``SubscribeKvEvents`` the instance's event stream (:mod:`.kv_proxy`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from warmup_tools.common.regular_file import read_regular
from warmup_tools.common.tracing import context_from_metadata
from warmup_tools.common.wire import ErrorKind
from warmup_tools.front.engine.engine import EngineError
from warmup_tools.front.errors import OpenAIError
from warmup_tools.front.serving import FrontState
from warmup_tools.front.smg_grpc.kv_proxy import KvEventsProxy
from warmup_tools.front.smg_grpc.log_text import LogText
from warmup_tools.front.smg_grpc.sampling import GenerateArgs, GenerateLimits, Refusal, generate_args
from warmup_tools.front.smg_grpc.tokenizer_bundle import TokenizerBundle

LOGGER = logging.getLogger(__name__)

#: What smg reads as this worker's kind (GetServerInfo.server_type).
SERVER_TYPE = "warmup-triton-grpc"
#: The only tenant of the gRPC path: smg passes no tenant identity to a worker (trust mode refuses the path).
TENANT = "default"
#: Request ids one Abort may name.
MAX_ABORT_IDS = 1024

#: The gRPC status of each error kind (common/wire.py), whatever the words of its message.
STATUS_OF_KIND: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT, ErrorKind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND, ErrorKind.TOO_LARGE: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.BUSY: grpc.StatusCode.RESOURCE_EXHAUSTED, ErrorKind.RATE_LIMITED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE, ErrorKind.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorKind.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED, ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}
#: What a caller is told of a failure on the server's side (tritonserver's own text goes to the log only).
_SERVER_SIDE = {
    grpc.StatusCode.INTERNAL: "internal error while serving this request; it was not completed",
    grpc.StatusCode.UNAVAILABLE: "this replica cannot serve the request now; it was not completed: retry, another "
                                 "worker may serve it",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the request did not complete within the server's deadline",
    grpc.StatusCode.CANCELLED: "the request was cancelled",
}


def refusal_of(exc: EngineError) -> Refusal:
    """The gRPC status and message of an engine error (a model's own message about the request is kept)."""
    code = STATUS_OF_KIND.get(exc.kind, grpc.StatusCode.INTERNAL)
    if code in _SERVER_SIDE:
        LOGGER.warning("a gRPC worker request failed on tritonserver (%s): %s", exc.kind, exc.message)
        return Refusal(code, _SERVER_SIDE[code])
    return Refusal(code, exc.message)


@dataclasses.dataclass(frozen=True, slots=True)
class LmInfo:
    """What GetModelInfo says of the LM (its config.json and tokenizer_config.json)."""

    max_context_length: int = 0
    vocab_size: int = 0
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int = 0
    pad_token_id: int = 0
    model_type: str = ""
    architectures: tuple[str, ...] = ()

    @classmethod
    def from_folder(cls, folder: Path) -> LmInfo:
        config = _json(folder / "config.json")
        tokenizer = _json(folder / "tokenizer_config.json")
        eos = config.get("eos_token_id")
        eos_ids = tuple(int(t) for t in (eos if isinstance(eos, list) else [eos]) if isinstance(t, int))
        context = config.get("max_position_embeddings") or tokenizer.get("model_max_length") or 0
        return cls(max_context_length=int(context) if isinstance(context, int) and 0 < context < 2**31 else 0,
                   vocab_size=_int(config.get("vocab_size")), eos_token_ids=eos_ids[:64],
                   bos_token_id=_int(config.get("bos_token_id")), pad_token_id=_int(config.get("pad_token_id")),
                   model_type=str(config.get("model_type", ""))[:64],
                   architectures=tuple(str(a)[:128] for a in config.get("architectures") or () if a)[:8])


def _json(path: Path) -> dict[str, Any]:
    try:
        data, _ = read_regular(path, 4 << 20, follow_symlinks=True)
        value = json.loads(data)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31 else 0


@dataclasses.dataclass(slots=True)
class Running:
    """A generation in flight: its task, whether Abort cancelled it, and its response being written (None: none).

    NOTE: Abort cancels the task, which may be inside a write; a write cancelled mid-way is still in gRPC's core
    queue, and the abort's own response written on top of it failed (``GRPC_CALL_ERROR_TOO_MANY_OPERATIONS``), the
    stream never ended. So a write is shielded from the cancellation (:meth:`write`) and the abort's response waits
    for it (:meth:`written`)."""

    task: asyncio.Task | None = None
    aborted: bool = False
    writing: asyncio.Future | None = None

    async def write(self, context: Any, message: Any) -> None:
        self.writing = asyncio.ensure_future(context.write(message))
        # its failure is the call's (the client left): read here, so that it is never logged as unretrieved
        self.writing.add_done_callback(lambda done: done.cancelled() or done.exception())
        await asyncio.shield(self.writing)

    async def written(self) -> None:
        """Once the response being written (if any) is out, or failed."""
        if self.writing is not None and not self.writing.done():
            await asyncio.wait([self.writing])


class WorkerContext:
    """What every listener of a front shares: the front's state and engine, the bounds, the facts of the
    replica, the running generations (by request id, for Abort), the tokenizer bundle, the event relay."""

    def __init__(self, state: FrontState, limits: GenerateLimits, lm: LmInfo, *, block_size: int,
                 max_num_seqs: int, tokenizer_path: Path | None, kv: KvEventsProxy) -> None:
        self.state = state
        self.engine: Any = state.engine
        self.limits = limits
        self.lm = lm
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.tokenizer_path = tokenizer_path
        self.kv = kv
        self.running: dict[str, Running] = {}
        self.started = time.time()
        self.last_receive = 0.0
        self._bundle: TokenizerBundle | None = None
        self._bundle_lock = asyncio.Lock()
        #: The prompt's text for lora_adapter's request log (None: logged without text).
        self.log_text = LogText.from_folder(tokenizer_path)

    async def bundle(self) -> TokenizerBundle:
        """The tokenizer's zip, built once (off the event loop)."""
        async with self._bundle_lock:
            if self._bundle is None:
                if self.tokenizer_path is None:
                    raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, "this replica has no tokenizer folder")
                self._bundle = await asyncio.to_thread(TokenizerBundle.from_folder, self.tokenizer_path)
            return self._bundle

    async def ready(self) -> tuple[bool, str]:
        state = self.state
        if state.drain.draining:
            return False, "the replica is shutting down"
        readiness = await self.engine.readiness()
        if not readiness.ready:
            readiness = await self.engine.readiness(refresh=True)
        return readiness.ready, readiness.reason

    async def live(self, adapter: str | None) -> bool:
        if adapter is None:
            return True
        models = await self.engine.models()
        if models.adapters.get(adapter, "unknown") is not None:
            models = await self.engine.models(refresh=True)
        return adapter in models.adapters and models.adapters[adapter] is None

    def abort(self, request_ids: Any) -> int:
        """Cancel the running generations of ``request_ids`` (unknown ones are ignored): how many."""
        count = 0
        for request_id in list(request_ids)[:MAX_ABORT_IDS]:
            running = self.running.get(request_id)
            if running is not None and running.task is not None and not running.task.done():
                running.aborted = True
                running.task.cancel()
                count += 1
        return count


class ModelServicer(vllm_engine_pb2_grpc.VllmEngineServicer):
    """One model's listener: ``model`` is the id smg registers, ``adapter`` the LoRA adapter (None: the base)."""

    def __init__(self, shared: WorkerContext, model: str, adapter: str | None) -> None:
        self.shared = shared
        self.model = model
        self.adapter = adapter

    # ------------------------------------------------------------------------------------------ generation
    async def Generate(self, request: vllm_engine_pb2.GenerateRequest, context: Any) -> None:
        shared = self.shared
        shared.last_receive = time.time()
        drain = shared.state.drain
        if not drain.enter():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this replica is shutting down: send the request to "
                                                             "another worker")
            return
        place: str | None = None
        running: Running | None = None
        try:
            args = generate_args(request, shared.limits)
            if args.request_id in shared.running:
                raise Refusal(grpc.StatusCode.ALREADY_EXISTS, f"request {args.request_id!r} is already running")
            ready, reason = await shared.ready()
            if not ready:
                raise Refusal(grpc.StatusCode.UNAVAILABLE, f"this replica is not ready to serve: {reason}")
            if not await shared.live(self.adapter):
                raise Refusal(grpc.StatusCode.NOT_FOUND, f"the model '{self.model}' is not served here now")
            try:
                place = shared.state.tenants.acquire(TENANT, False)
            except OpenAIError as exc:
                raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, exc.message) from None
            trace = context_from_metadata(context.invocation_metadata()) if shared.state.traced else None
            running = shared.running[args.request_id] = Running()
            task = running.task = asyncio.ensure_future(self._generate(args, trace, context, running))
            try:
                await task
            except asyncio.CancelledError:
                if not running.aborted:
                    raise  # the call itself was cancelled (the client left, its deadline passed)
                await running.written()
                await context.write(vllm_engine_pb2.GenerateResponse(
                    complete=vllm_engine_pb2.GenerateComplete(finish_reason="abort")))
        except Refusal as exc:
            await context.abort(exc.code, exc.message)
        finally:
            if running is not None:
                if running.task is not None and not running.task.done():
                    running.task.cancel()
                if shared.running.get(request.request_id) is running:
                    del shared.running[request.request_id]
            shared.state.tenants.release(place)
            drain.leave()

    async def _generate(self, args: GenerateArgs, trace: Any, context: Any, running: Running) -> None:
        output: list[int] = []
        text = self.shared.log_text(args.input_ids) if self.shared.log_text is not None else None
        chunks = self.shared.engine.generate_tokens(args.input_ids, self.adapter, TENANT, args.sampling, trace,
                                                    text=text)
        try:
            async for chunk in chunks:
                output.extend(chunk.token_ids)
                if args.stream and chunk.token_ids:
                    await running.write(context, vllm_engine_pb2.GenerateResponse(
                        chunk=vllm_engine_pb2.GenerateStreamChunk(
                            token_ids=chunk.token_ids, prompt_tokens=chunk.prompt_tokens,
                            completion_tokens=chunk.output_tokens, cached_tokens=chunk.cached_tokens)))
                if chunk.finish_reason:
                    await running.write(context, vllm_engine_pb2.GenerateResponse(
                        complete=vllm_engine_pb2.GenerateComplete(
                            output_ids=output, finish_reason=chunk.finish_reason, prompt_tokens=chunk.prompt_tokens,
                            completion_tokens=chunk.output_tokens, cached_tokens=chunk.cached_tokens)))
                    return
        except EngineError as exc:
            raise refusal_of(exc) from None
        finally:
            await chunks.aclose()
        raise Refusal(grpc.StatusCode.INTERNAL, "the generation ended without its last response")

    async def Abort(self, request: vllm_engine_pb2.AbortRequest, context: Any) -> vllm_engine_pb2.AbortResponse:
        if len(request.request_ids) > MAX_ABORT_IDS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"one Abort names at most {MAX_ABORT_IDS} requests")
        self.shared.abort(request.request_ids)
        return vllm_engine_pb2.AbortResponse()

    # ------------------------------------------------------------------------------------------ state
    async def HealthCheck(self, request: vllm_engine_pb2.HealthCheckRequest,
                          context: Any) -> vllm_engine_pb2.HealthCheckResponse:
        ready, reason = await self.shared.ready()
        if not ready:
            # NOTE: the call fails: smg registers a worker whose HealthCheck call succeeds, whatever ``healthy`` says
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"not ready: {reason}")
        if not await self.shared.live(self.adapter):
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the model '{self.model}' is not live here")
        return vllm_engine_pb2.HealthCheckResponse(healthy=True, message="ready")

    async def GetModelInfo(self, request: vllm_engine_pb2.GetModelInfoRequest,
                           context: Any) -> vllm_engine_pb2.GetModelInfoResponse:
        lm = self.shared.lm
        return vllm_engine_pb2.GetModelInfoResponse(
            model_path="", is_generation=True, max_context_length=lm.max_context_length, vocab_size=lm.vocab_size,
            supports_vision=False, served_model_name=self.model, model_type=lm.model_type,
            architectures=lm.architectures, eos_token_ids=lm.eos_token_ids, pad_token_id=lm.pad_token_id,
            bos_token_id=lm.bos_token_id, max_req_input_len=self.shared.limits.max_prompt_tokens)

    async def GetServerInfo(self, request: vllm_engine_pb2.GetServerInfoRequest,
                            context: Any) -> vllm_engine_pb2.GetServerInfoResponse:
        shared = self.shared
        return vllm_engine_pb2.GetServerInfoResponse(
            active_requests=len(shared.running), is_paused=False, last_receive_timestamp=shared.last_receive,
            uptime_seconds=time.time() - shared.started, server_type=SERVER_TYPE, data_parallel_size=1,
            block_size=shared.block_size, max_num_seqs=shared.max_num_seqs)

    async def GetLoads(self, request: vllm_engine_pb2.GetLoadsRequest,
                       context: Any) -> vllm_engine_pb2.GetLoadsResponse:
        load = await self.shared.engine.load()
        running, waiting = int(load.running), int(load.waiting)
        record = vllm_engine_pb2.SchedulerLoad(
            dp_rank=0, num_running_reqs=running, num_waiting_reqs=waiting, num_total_reqs=running + waiting,
            token_usage=load.kv_usage or 0.0, utilization=load.kv_usage or 0.0,
            max_running_requests=self.shared.max_num_seqs)
        return vllm_engine_pb2.GetLoadsResponse(timestamp=datetime.now(timezone.utc).isoformat(),
                                                version=SERVER_TYPE, dp_rank_count=1, loads=[record])

    async def GetTokenizer(self, request: common_pb2.GetTokenizerRequest,
                           context: Any) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        try:
            bundle = await self.shared.bundle()
        except Refusal as exc:
            await context.abort(exc.code, exc.message)
            return
        except Exception as exc:  # noqa: BLE001 (a folder that cannot be bundled: the replica's fault, logged)
            LOGGER.warning("the tokenizer bundle was not built: %s", exc)
            await context.abort(grpc.StatusCode.INTERNAL, "the tokenizer bundle could not be built on this replica")
            return
        for data, digest in bundle.chunks():
            yield common_pb2.GetTokenizerChunk(data=data, sha256=digest)

    async def SubscribeKvEvents(self, request: common_pb2.SubscribeKvEventsRequest, context: Any) -> None:
        await self.shared.kv.relay(request, context, self.adapter or "")
