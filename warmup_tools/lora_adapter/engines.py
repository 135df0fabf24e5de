"""Which engine class serves ``lora_adapter``, by its ``engine`` parameter."""

from __future__ import annotations

from typing import Callable, Mapping

from warmup_tools.lora_adapter.engine import LoraEngine
from warmup_tools.lora_adapter.serving import ServingEngine
from warmup_tools.lora_adapter.settings import EngineConfig
from warmup_tools.lora_adapter.simulated import SimulatedEngine

#: One class per ``engine`` value (:data:`~warmup_tools.lora_adapter.settings.ENGINE_KINDS`; a test keeps them equal).
ENGINES: Mapping[str, Callable[[EngineConfig], ServingEngine]] = {"real": LoraEngine, "simulated": SimulatedEngine}


def make_engine(config: EngineConfig) -> ServingEngine:
    """The engine ``config.kind`` names."""
    return ENGINES[config.kind](config)
