"""Which forward serves ``lora_adapter``, by its ``engine`` and ``engine_forward`` parameters: the packed one
(:class:`~warmup_tools.lora_adapter.packed.PackedEngine`, the default), the Hugging Face reference
(:class:`~warmup_tools.lora_adapter.hf.HfEngine`) or the simulated one
(:class:`~warmup_tools.lora_adapter.simulated.SimulatedEngine`); each is a
:class:`~warmup_tools.lora_adapter.engine_api.SequenceEngine` and a
:class:`~warmup_tools.lora_adapter.serving.ServingEngine`."""

from __future__ import annotations

import logging
from typing import Callable, Mapping

from warmup_tools.lora_adapter.hf import HfEngine
from warmup_tools.lora_adapter.packed import PackedEngine, model_packed_support
from warmup_tools.lora_adapter.serving import ServingEngine
from warmup_tools.lora_adapter.settings import EngineConfig
from warmup_tools.lora_adapter.simulated import SimulatedEngine

LOGGER = logging.getLogger(__name__)


def _real(config: EngineConfig) -> ServingEngine:
    if config.forward == "packed":
        reason = model_packed_support(config.base_model) if (config.base_model / "config.json").exists() else None
        if reason is None:
            return PackedEngine(config)
        LOGGER.warning("engine_forward=packed: %s; this model runs the Hugging Face forward", reason)
    return HfEngine(config)


#: One factory per ``engine`` value (:data:`~warmup_tools.lora_adapter.settings.ENGINE_KINDS`; a test keeps them equal).
ENGINES: Mapping[str, Callable[[EngineConfig], ServingEngine]] = {"real": _real, "simulated": SimulatedEngine}


def make_engine(config: EngineConfig) -> ServingEngine:
    """The engine ``config.kind`` (and for the real one ``config.forward``) names."""
    return ENGINES[config.kind](config)
