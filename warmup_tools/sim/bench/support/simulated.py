"""A replica of the simulated engine, as the fleet benchmarks (``bench fleet-scale``, ``tenant-flood``) and the
sizing scripts start it: the variables that select the engine and its profile, and a replica's KV budget in a
trace's blocks."""

from __future__ import annotations

from warmup_tools.lora_adapter.profile import EngineProfile
from warmup_tools.sim.traces import TRACES

#: The real-text traffic's replicas get the KV budget of a trace of 512-token blocks (the same fleet).
REAL_TEXT_SOURCE_BLOCK = 512



def replica_kv_tokens(engine: EngineProfile, block_tokens: int, trace: str) -> int:
    """A replica's KV budget in tokens: the profile's device capacity in the trace's blocks, each ``block_tokens``
    tokens (the fleet's caches as full, relative to the scaled trace, as the modelled devices' would be)."""
    source_block = TRACES[trace].source_block if trace in TRACES else REAL_TEXT_SOURCE_BLOCK
    return engine.kv_capacity_tokens * block_tokens // source_block



def simulated_environment(profile: str, speedup: float, kv_bytes: int) -> dict[str, str]:
    """The variables that make a replica's ``lora_adapter`` the simulated engine of ``profile`` (its step times
    divided by ``speedup``) with a KV budget of ``kv_bytes`` (modelled bytes)."""
    return {"WARMUP_ENGINE": "simulated", "WARMUP_ENGINE_PROFILE": profile, "WARMUP_ENGINE_SPEEDUP": str(speedup),
            "WARMUP_KV_CACHE_BYTES": str(kv_bytes)}
