"""The validated request of the ``lora_adapter`` model: token ids, adapter, tenant, sampling, warm-up tag."""

from __future__ import annotations

import dataclasses

from warmup_tools.common.errors import ConfigError, InvalidInputError
from warmup_tools.common.settings import check_settings, setting
from warmup_tools.common.wire import (  # noqa: F401 (SamplingParams and the bounds are imported from here too)
    INPUTS,
    MAX_CLUSTER_ID,
    MAX_SEED,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    SAMPLING_INPUTS,
    SamplingParams,
    WireInput,
)
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
    #: With ``plan_id``: seconds the blocks it pins stay pinned (None: the cache's ``kv_pin_retention_s``).
    retention_s: float | None = None

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
    sampling = parse_sampling(inputs, limits)
    stream = parse_scalar(inputs, "stream", bool, INPUTS["stream"].default)
    cluster_id = _checked(inputs, INPUTS["cluster_id"], INPUTS["cluster_id"].default)
    # NOTE: the ``warmup_plan`` input is three-state on the wire (absent: live; "": warm-up, not pinned;
    # a plan id: warm-up pinned under that plan); inside the package it is two explicit fields.
    warmup_tag = inputs.get("warmup_plan")
    plan_id = parse_optional_string(inputs, "warmup_plan", "", MAX_IDENTITY_BYTES) or None
    retention_s = parse_retention(inputs, pinned=plan_id is not None)
    return GenerateRequest(
        prompt_ids=prompt_ids,
        adapter=adapter,
        tenant=tenant,
        stream=stream,
        sampling=sampling,
        cluster_id=cluster_id,
        source=BlockSource.LIVE if warmup_tag is None else BlockSource.WARMUP,
        plan_id=plan_id,
        retention_s=retention_s,
    )


def parse_retention(inputs: Inputs, *, pinned: bool) -> float | None:
    """``warmup_retention_s``: how long the blocks a plan's sample pins stay pinned (None when absent).

    Only a sample that pins (``warmup_plan`` names a plan) may carry it: a retention of nothing is a mistake in
    the stanzas, refused so that it shows when the model loads, not later as pins that never expire."""
    row = INPUTS["warmup_retention_s"]
    value = parse_scalar(inputs, row.name, row.cast, None)
    if value is None:
        return None
    problem = row.check(value)  # NOTE: NaN and inf fail the bound
    if problem is not None:
        raise InvalidInputError(problem)
    if not pinned:
        raise InvalidInputError("input 'warmup_retention_s' is how long a plan's blocks stay pinned: send it "
                                "only with a non-empty 'warmup_plan'")
    return value


def parse_sampling(inputs: Inputs, limits: RequestLimits) -> SamplingParams:
    """The sampling inputs (:data:`~warmup_tools.common.wire.SAMPLING_INPUTS`), each checked against its bound;
    ``max_tokens`` against the deployment's limits."""
    values = {}
    for row in SAMPLING_INPUTS:
        if row.name == "max_tokens":  # NOTE: its default and bound are the deployment's
            values[row.name] = max_tokens = parse_scalar(inputs, row.name, int, limits.default_max_tokens)
            if not 1 <= max_tokens <= limits.max_tokens_limit:
                raise InvalidInputError(f"input 'max_tokens' is out of range: use 1 to {limits.max_tokens_limit}")
        else:
            values[row.name] = _checked(inputs, row, row.default)
    return SamplingParams(**values)


def _checked(inputs: Inputs, row: WireInput, default: object) -> object:
    value = parse_scalar(inputs, row.name, row.cast, default)
    problem = row.check(value)  # NOTE: a NaN fails every bound
    if problem is not None:
        raise InvalidInputError(problem)
    return value
