"""The validated request of the ``lora_adapter`` model: token ids, adapter, tenant, sampling, warm-up tag."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from warmup_tools.common.errors import ConfigError, InvalidInputError
from warmup_tools.common.settings import check_settings, setting
from warmup_tools.kv.blocks import BlockSource
from warmup_tools.triton.inputs import (
    MAX_IDENTITY_BYTES,
    MAX_PROMPT_TOKENS,
    Inputs,
    check_text_size,
    parse_identity,
    parse_optional_string,
    parse_scalar,
)

#: Largest seed a request may carry (``UINT64``), and the range of each sampling input.
MAX_SEED = 2**64 - 1
MAX_TEMPERATURE = 100.0
#: The lowest sampling temperature (0 is greedy). NOTE: sampling divides the float32 logits by the
#: temperature (lora_adapter/sampling.py); a temperature that is subnormal in float32 (below 1.2e-38, such
#: as 1e-40) or small enough that a logit over it passes float32's 3.4e38 turns the scores into inf and the
#: distribution into NaN. At 0.01 a logit of 3.4e36 would still fit, and a gap of 0.5 between two logits
#: already gives odds of e^-50: below it sampling is greedy in all but name (vLLM raises smaller ones to
#: 0.01 for the same reason). The bound is the FP32 value nearest 0.01, since the input is FP32.
MIN_TEMPERATURE = float(np.float32(0.01))
#: Cluster ids are the embedding cache's semantic clusters (bounded by its max_clusters).
MAX_CLUSTER_ID = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token. ``temperature == 0`` (the default) is greedy decoding."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclasses.dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One validated request to the ``lora_adapter`` model."""

    prompt_ids: tuple[int, ...]
    adapter: str | None
    tenant: str
    stream: bool
    sampling: SamplingParams
    cluster_id: int = -1
    #: LIVE for client traffic; WARMUP stores the prompt's KV within the warm-up share of the budget.
    source: BlockSource = BlockSource.LIVE
    #: With ``source`` WARMUP: the plan that pins the blocks while it is active (None: not pinned).
    plan_id: str | None = None

    @property
    def is_warmup(self) -> bool:
        return self.source is BlockSource.WARMUP


@dataclasses.dataclass(frozen=True, slots=True)
class RequestLimits:
    """Bounds a deployment puts on requests (``lora_adapter`` parameters; the vocabulary from the model)."""

    max_tokens_limit: int = setting(512, "The most new tokens one request may ask for (max_tokens).", ge=1)
    default_max_tokens: int = setting(16, "New tokens of a request that sets no max_tokens; at most "
                                          "max_tokens_limit.", ge=1)
    #: Token ids a prompt may hold are below this (the model's vocabulary); None: not checked.
    vocab_size: int | None = setting(None, "The model's vocabulary size.", parameter="")

    def __post_init__(self) -> None:
        check_settings(self)
        if self.default_max_tokens > self.max_tokens_limit:
            raise ConfigError(f"default_max_tokens ({self.default_max_tokens}) must be at most max_tokens_limit "
                              f"({self.max_tokens_limit})")


def parse_generate_request(inputs: Inputs, limits: RequestLimits, *, tenant: str | None = None) -> GenerateRequest:
    """Validate the ``lora_adapter`` inputs: token ids, adapter, tenant, stream and sampling.

    ``tenant``, when given, is the verified tenant (trust mode); otherwise ``tenant_id`` is taken.
    """
    ids = inputs.get("input_ids")
    if ids is None or ids.size == 0:
        raise InvalidInputError("input 'input_ids' is required and must hold at least one token id")
    if ids.ndim != 1 and not (ids.ndim == 2 and ids.shape[0] == 1):
        raise InvalidInputError(f"input 'input_ids' must have shape [n] or [1, n], got {list(ids.shape)}")
    if ids.size > MAX_PROMPT_TOKENS:
        raise InvalidInputError(f"input 'input_ids' holds {ids.size} token ids; at most {MAX_PROMPT_TOKENS} "
                                "are taken (the model's context is usually far shorter)")
    if ids.dtype.kind not in "iu":
        raise InvalidInputError(f"input 'input_ids' must be integer token ids (INT32 or INT64), got {ids.dtype}")
    prompt_ids = tuple(int(t) for t in ids.reshape(-1))
    if limits.vocab_size is not None:
        bad = [t for t in prompt_ids if t < 0 or t >= limits.vocab_size]
        if bad:
            raise InvalidInputError(
                f"input 'input_ids' holds token id {bad[0]} outside the vocabulary [0, {limits.vocab_size})"
            )
    adapter = parse_identity(inputs, "adapter_id", None)
    tenant = tenant if tenant is not None else parse_identity(inputs, "tenant_id", "default")
    # NOTE: the prompt text is only logged, but it is bounded like every model's (before any decoding).
    check_text_size(inputs, "text_input")
    max_tokens = parse_scalar(inputs, "max_tokens", int, limits.default_max_tokens)
    if not 1 <= max_tokens <= limits.max_tokens_limit:
        raise InvalidInputError(f"input 'max_tokens' is out of range: use 1 to {limits.max_tokens_limit}")
    temperature = parse_scalar(inputs, "temperature", float, 0.0)
    if not (temperature == 0.0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):  # NaN fails both
        raise InvalidInputError(f"input 'temperature' is out of range: use 0 (greedy) or {MIN_TEMPERATURE:.2g} "
                                f"to {MAX_TEMPERATURE:g}")
    top_p = parse_scalar(inputs, "top_p", float, 1.0)
    # NOTE: some TensorRT-LLM clients send top_p=0 to mean "no nucleus filtering"; taken literally it keeps
    # no token at all, so it is refused with the value to send instead rather than silently reinterpreted.
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise InvalidInputError("input 'top_p' is out of range: use a value in (0, 1] (1 for no nucleus filtering)")
    top_k = parse_scalar(inputs, "top_k", int, 0)
    if top_k < 0:
        raise InvalidInputError("input 'top_k' is out of range: use 0 (no limit) or a positive count")
    seed = parse_scalar(inputs, "seed", int, 0)
    if not 0 <= seed <= MAX_SEED:
        raise InvalidInputError("input 'seed' is out of range: use 0 to 2**64-1")
    stream = parse_scalar(inputs, "stream", bool, False)
    cluster_id = parse_scalar(inputs, "cluster_id", int, -1)
    if not -1 <= cluster_id <= MAX_CLUSTER_ID:
        raise InvalidInputError(f"input 'cluster_id'={cluster_id} is out of range: use -1 (none) to {MAX_CLUSTER_ID}")
    # NOTE: the ``warmup_plan`` input is three-state on the wire (absent: live; "": warm-up, not pinned;
    # a plan id: warm-up pinned under that plan); inside the package it is two explicit fields.
    warmup_tag = inputs.get("warmup_plan")
    plan_id = parse_optional_string(inputs, "warmup_plan", "", MAX_IDENTITY_BYTES) or None
    return GenerateRequest(
        prompt_ids=prompt_ids,
        adapter=adapter,
        tenant=tenant,
        stream=stream,
        sampling=SamplingParams(max_tokens, temperature, top_p, top_k, seed),
        cluster_id=cluster_id,
        source=BlockSource.LIVE if warmup_tag is None else BlockSource.WARMUP,
        plan_id=plan_id,
    )


