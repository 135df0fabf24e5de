"""Every ``tokenizer_cache`` parameter of ``config.pbtxt``, read once into one typed object."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

from warmup_tools.caches.policies.settings import EvictionSettings
from warmup_tools.caches.settings import SharedTierSettings, eviction_setting
from warmup_tools.common.settings import check_settings, setting
from warmup_tools.triton.metrics import MetricsSettings
from warmup_tools.triton.params import ModelSettings
from warmup_tools.triton.trust import TrustSettings

MODEL_NAME = "tokenizer_cache"


@dataclasses.dataclass(frozen=True, slots=True)
class TokenizerConfig:
    """The tokenizer and its local cache (:class:`~warmup_tools.tokenizer_cache.service.TokenizerService`)."""

    path: Path = setting(doc="Hugging Face tokenizer folder: the base model's own (tokenizer.json).",
                         parameter="tokenizer_path")
    cache_bytes: int = setting(64 << 20, "Bytes of the local tokenisation cache (keys and token ids).", ge=1)
    eviction: str = eviction_setting("slru")
    max_templates: int = setting(256, "Known templates (system prompts, RAG preambles) whose remainder is "
                                      "tokenised alone when that provably gives the same ids.", ge=0, le=65536)
    policy: EvictionSettings = dataclasses.field(default_factory=EvictionSettings)

    def __post_init__(self) -> None:
        check_settings(self)


@dataclasses.dataclass(frozen=True, slots=True)
class TokenizerCacheSettings(ModelSettings):
    """Every ``tokenizer_cache`` parameter (:meth:`from_parameters`)."""

    MODEL: ClassVar[str] = MODEL_NAME

    tokenizer: TokenizerConfig
    shared: SharedTierSettings = dataclasses.field(default_factory=SharedTierSettings)
    trust: TrustSettings = dataclasses.field(default_factory=TrustSettings)
    metrics: MetricsSettings = dataclasses.field(default_factory=MetricsSettings)

