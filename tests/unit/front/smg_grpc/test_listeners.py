"""The listeners follow the live models: one per model, an adapter's opened when it goes live and closed when it
retires, never more than grpc_worker_models (over a scripted engine; on a real replica:
tests/integration/test_smg_grpc_worker.py)."""

from __future__ import annotations

import asyncio

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from tests.unit.front.conftest import ScriptedEngine
from warmup_tools.front.auth import TenantResolver
from warmup_tools.front.serving import FrontState
from warmup_tools.front.settings import FrontSettings
from warmup_tools.front.smg_grpc.listeners import GrpcWorkers, ReplicaFacts
from warmup_tools.server.process import free_port_block


async def model_at(port: int) -> str | grpc.StatusCode:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            info = await vllm_engine_pb2_grpc.VllmEngineStub(channel).GetModelInfo(pb.GetModelInfoRequest(),
                                                                                  timeout=10)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return info.served_model_name


def test_adapters_get_listeners_while_live_within_the_bound():
    engine = ScriptedEngine(adapters={"sql": None, "legal": "adapter 'legal' is warming", "support": None})
    settings = FrontSettings(grpc_worker_port=free_port_block("127.0.0.1", 3), grpc_worker_models=3,
                             poll_interval_s=60)  # the test calls refresh() itself
    workers = GrpcWorkers(settings, ReplicaFacts(block_size=16, max_num_seqs=8))
    base = settings.grpc_worker_port

    async def scenario():
        await workers.start(FrontState(settings, engine, TenantResolver(None), None))
        try:
            assert workers.workers() == [{"model": "base", "port": base}, {"model": "sql", "port": base + 1},
                                         {"model": "support", "port": base + 2}]
            assert [await model_at(base + i) for i in range(3)] == ["base", "sql", "support"]
            engine.adapters = {"sql": "adapter 'sql' is retired", "legal": None, "support": None}
            await workers.refresh()
            # sql's listener is closed; legal takes the freed port (no unused one is left)
            assert workers.workers() == [{"model": "base", "port": base}, {"model": "legal", "port": base + 1},
                                         {"model": "support", "port": base + 2}]
            assert await model_at(base + 1) == "legal"
            engine.adapters = {"support": None}
            await workers.refresh()
            assert [w["model"] for w in workers.workers()] == ["base", "support"]
            assert await model_at(base + 1) == grpc.StatusCode.UNAVAILABLE  # nothing listens there now
        finally:
            await workers.stop()
        assert workers.workers() == []
        assert await model_at(base) == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())
