"""The gRPC worker listeners of a front: one ``grpc.aio`` server per model, started and stopped with the front.

The base model listens on ``grpc_worker_port``; each live adapter on ``grpc_worker_port + slot`` (:mod:`.slots`),
opened when it goes live and closed when it retires, at most ``grpc_worker_models`` listeners in all. A task
follows the engine's model state every ``poll_interval_s``. ``GET /grpc-workers`` lists the listeners of the live
models (:meth:`GrpcWorkers.workers`): what a fleet registers with smg as ``grpc://<replica>:<port>`` workers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import Mapping

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from warmup_tools.common.errors import ConfigError, ServerError
from warmup_tools.common.settings import read_settings
from warmup_tools.front.serving import FrontState
from warmup_tools.front.settings import FrontSettings
from warmup_tools.front.smg_grpc.kv_proxy import KvEventsProxy
from warmup_tools.front.smg_grpc.sampling import GenerateLimits
from warmup_tools.front.smg_grpc.servicer import LmInfo, ModelServicer, WorkerContext
from warmup_tools.front.smg_grpc.slots import SlotTable
from warmup_tools.kv.config import KVCacheConfig
from warmup_tools.lora_adapter.settings import SchedulerConfig
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.triton.inputs import MAX_PROMPT_TOKENS
from warmup_tools.triton.params import repository_parameters

LOGGER = logging.getLogger(__name__)

#: Seconds a closing listener gives the calls on it (a retired adapter's, the front's at stop).
CLOSE_GRACE_S = 2.0
#: Why trust mode refuses the listeners.
TRUST_REFUSAL = ("grpc_worker_port is set in trust mode (tenant_keys_file): smg 1.13 passes no tenant identity to a "
                 "gRPC worker, so a gRPC worker cannot prove a request's tenant; keep trust-mode fleets on the HTTP "
                 "path (docs/fleet.md, \"smg's gRPC worker protocol\") or leave grpc_worker_port 0")


@dataclasses.dataclass(frozen=True, slots=True)
class ReplicaFacts:
    """What the listeners say of the replica, from the model repository tritonserver serves."""

    block_size: int
    max_num_seqs: int


def replica_facts(settings: FrontSettings, environ: Mapping[str, str] | None = None) -> ReplicaFacts:
    """lora_adapter's KV block size and max_num_seqs in the repository (``${VAR}`` from ``environ``)."""
    repository = settings.model_repository or REPO_ROOT / "model_repository"
    parameters = repository_parameters(repository, "lora_adapter", environ)
    return ReplicaFacts(read_settings(KVCacheConfig, parameters).block_size,
                        read_settings(SchedulerConfig, parameters).max_num_seqs)


def check_trust(settings: FrontSettings) -> None:
    """ConfigError when the listeners are asked for in trust mode."""
    if settings.grpc_worker_port and settings.tenant_keys_file is not None:
        raise ConfigError(TRUST_REFUSAL)


class GrpcWorkers:
    """The listeners of one front (built when ``grpc_worker_port`` is set; started on the front's event loop)."""

    def __init__(self, settings: FrontSettings, facts: ReplicaFacts) -> None:
        check_trust(settings)
        self.settings = settings
        self.facts = facts
        self.slots = SlotTable(settings.grpc_worker_models)
        self._servers: dict[int, tuple[str, grpc.aio.Server]] = {}
        self._shared: WorkerContext | None = None
        self._follow: asyncio.Task | None = None

    def port_of(self, slot: int) -> int:
        return self.settings.grpc_worker_port + slot

    def workers(self) -> list[dict[str, object]]:
        """The live models with a listener: ``{"model", "port"}`` each, the base model first."""
        return [{"model": model, "port": self.port_of(slot)} for slot, (model, _) in sorted(self._servers.items())]

    async def start(self, state: FrontState) -> None:
        settings = self.settings
        tokenizer = Path(settings.tokenizer_path) if settings.tokenizer_path is not None else None
        lm = LmInfo.from_folder(tokenizer) if tokenizer is not None else LmInfo()
        limit = min(MAX_PROMPT_TOKENS, lm.max_context_length or MAX_PROMPT_TOKENS)
        limits = GenerateLimits(max_prompt_tokens=limit, max_stop=settings.max_stop,
                                vocab_size=lm.vocab_size or None)
        self._shared = WorkerContext(state, limits, lm, block_size=self.facts.block_size,
                                     max_num_seqs=self.facts.max_num_seqs, tokenizer_path=tokenizer,
                                     kv=KvEventsProxy(settings.kv_events_dir))
        try:
            await self._open(0, settings.served_model_name, None)
        except RuntimeError as exc:
            raise ServerError(f"the gRPC worker listener did not start on {settings.grpc_worker_host}:"
                              f"{settings.grpc_worker_port}: {exc}") from None
        await self.refresh()
        self._follow = asyncio.create_task(self._run(), name="grpc-workers")

    async def stop(self) -> None:
        if self._follow is not None:
            self._follow.cancel()
            await asyncio.gather(self._follow, return_exceptions=True)
            self._follow = None
        servers = [server for _, server in self._servers.values()]
        self._servers.clear()
        await asyncio.gather(*(server.stop(CLOSE_GRACE_S) for server in servers), return_exceptions=True)

    async def refresh(self) -> None:
        """Open the listeners of adapters gone live, close those of adapters gone."""
        assert self._shared is not None
        models = await self._shared.engine.models()
        changes = self.slots.update(models.live())
        for slot, adapter in changes.closed:
            entry = self._servers.pop(slot, None)
            if entry is not None:
                LOGGER.info("gRPC worker for adapter %s on port %d closed (the adapter is not live)", adapter,
                            self.port_of(slot))
                await entry[1].stop(CLOSE_GRACE_S)
        for slot, adapter in changes.opened:
            try:
                await self._open(slot, adapter, adapter)
            except RuntimeError as exc:
                LOGGER.warning("gRPC worker for adapter %s not opened on port %d: %s", adapter, self.port_of(slot),
                               exc)
        if self.slots.unplaced:
            LOGGER.debug("adapters without a gRPC worker (grpc_worker_models %d): %s", self.slots.size,
                         ", ".join(self.slots.unplaced[:8]))

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.poll_interval_s)
            try:
                await self.refresh()
            except Exception:  # the next round tries again
                LOGGER.warning("following the adapters for the gRPC workers failed", exc_info=True)

    async def _open(self, slot: int, model: str, adapter: str | None) -> None:
        assert self._shared is not None
        settings = self.settings
        # NOTE: so_reuseport off: a port another process holds is an error, never a shared listener.
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                          ("grpc.max_receive_message_length", settings.max_body_bytes),
                                          ("grpc.max_send_message_length", 64 << 20)],
                                 maximum_concurrent_rpcs=settings.max_connections)
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(ModelServicer(self._shared, model, adapter), server)
        port = server.add_insecure_port(f"{settings.grpc_worker_host}:{self.port_of(slot)}")
        if port != self.port_of(slot):
            raise RuntimeError(f"port {self.port_of(slot)} is not free")
        await server.start()
        self._servers[slot] = (model, server)
        LOGGER.info("gRPC worker for model %s on %s:%d", model, settings.grpc_worker_host, port)
