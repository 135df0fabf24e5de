"""Which forward serves ``lora_adapter``, by its ``engine`` and ``engine_forward`` parameters: the packed one
(:class:`~warmup_tools.lora_adapter.packed.PackedEngine`, the default), the Hugging Face reference
(:class:`~warmup_tools.lora_adapter.hf.HfEngine`) or the simulated one
(:class:`~warmup_tools.lora_adapter.simulated.SimulatedEngine`); each is a
:class:`~warmup_tools.lora_adapter.engine_api.SequenceEngine` and a
:class:`~warmup_tools.lora_adapter.serving.ServingEngine`.

Each forward's module is imported when that forward is made: the real ones import torch, and a simulated
instance's process never does."""

from __future__ import annotations

import logging
from typing import Callable, Mapping

from warmup_tools.lora_adapter.serving import ServingEngine
from warmup_tools.lora_adapter.settings import EngineConfig

LOGGER = logging.getLogger(__name__)


def _real(config: EngineConfig) -> ServingEngine:
    from warmup_tools.lora_adapter.hf import HfEngine
    from warmup_tools.lora_adapter.packed import PackedEngine, model_packed_support

    if config.forward == "packed":
        reason = model_packed_support(config.base_model) if (config.base_model / "config.json").exists() else None
        if reason is None:
            return PackedEngine(config)
        LOGGER.warning("engine_forward=packed: %s; this model runs the Hugging Face forward", reason)
    return HfEngine(config)


def _simulated(config: EngineConfig) -> ServingEngine:
    from warmup_tools.lora_adapter.simulated import SimulatedEngine

    return SimulatedEngine(config)


#: One factory per ``engine`` value (:data:`~warmup_tools.lora_adapter.settings.ENGINE_KINDS`; a test keeps them equal).
ENGINES: Mapping[str, Callable[[EngineConfig], ServingEngine]] = {"real": _real, "simulated": _simulated}


def make_engine(config: EngineConfig) -> ServingEngine:
    """The engine ``config.kind`` (and for the real one ``config.forward``) names."""
    return ENGINES[config.kind](config)
