"""Validation of the request tensors the models receive, independent of Triton.

model.py files collect the input tensors of one request into a ``{name: numpy array or None}`` mapping
and call a parser here. Every problem raises an :class:`~warmup_tools.common.errors.InvalidInputError` whose
message tells the user what to change; the model answers that request with the error and goes on.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import numpy as np

from warmup_tools.common.errors import InvalidInputError

Inputs = Mapping[str, "np.ndarray | None"]

#: Largest seed a request may carry (``UINT64``), and the range of each sampling input.
MAX_SEED = 2**64 - 1
MAX_TEMPERATURE = 100.0


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
    #: None for live traffic. Warm-up sets it: "" stores its KV as warm-up (within the warm-up share of
    #: the budget), a plan id also pins those blocks while that plan is active.
    warmup_plan: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class RequestLimits:
    """Bounds a deployment puts on requests (from the model's config.pbtxt parameters)."""

    max_tokens_limit: int = 512
    default_max_tokens: int = 16
    vocab_size: int | None = None


def parse_text(inputs: Inputs, name: str = "text_input") -> str:
    """The single UTF-8 string in ``inputs[name]``; empty, missing or invalid text is refused."""
    array = inputs.get(name)
    if array is None:
        raise InvalidInputError(f"input '{name}' is required: send the prompt as a BYTES tensor of shape [1]")
    text = _single_string(array, name)
    if not text.strip():
        raise InvalidInputError(f"input '{name}' is empty: send a non-empty prompt")
    return text


def parse_optional_text(inputs: Inputs, name: str = "text_input") -> str | None:
    """The prompt text when the request carries it (undecodable text is kept, with replacements)."""
    array = inputs.get(name)
    if array is None or array.size != 1:
        return None
    value = array.reshape(-1)[0]
    return value.decode("utf-8", errors="replace") if isinstance(value, (bytes, np.bytes_)) else str(value)


def parse_optional_string(inputs: Inputs, name: str, default: str = "") -> str:
    array = inputs.get(name)
    if array is None:
        return default
    return _single_string(array, name).strip() or default


def parse_generate_request(inputs: Inputs, limits: RequestLimits) -> GenerateRequest:
    """Validate the ``lora_adapter`` inputs: token ids, adapter, tenant, stream and sampling."""
    ids = inputs.get("input_ids")
    if ids is None or ids.size == 0:
        raise InvalidInputError("input 'input_ids' is required and must hold at least one token id")
    if ids.ndim != 1 and not (ids.ndim == 2 and ids.shape[0] == 1):
        raise InvalidInputError(f"input 'input_ids' must have shape [n] or [1, n], got {list(ids.shape)}")
    prompt_ids = tuple(int(t) for t in ids.reshape(-1))
    if limits.vocab_size is not None:
        bad = [t for t in prompt_ids if t < 0 or t >= limits.vocab_size]
        if bad:
            raise InvalidInputError(
                f"input 'input_ids' holds token id {bad[0]} outside the vocabulary [0, {limits.vocab_size})"
            )
    adapter = parse_optional_string(inputs, "adapter_id") or None
    tenant = parse_optional_string(inputs, "tenant_id", "default")
    max_tokens = _scalar(inputs, "max_tokens", int, limits.default_max_tokens)
    if not 1 <= max_tokens <= limits.max_tokens_limit:
        raise InvalidInputError(f"input 'max_tokens'={max_tokens} is out of range: use 1 to {limits.max_tokens_limit}")
    temperature = _scalar(inputs, "temperature", float, 0.0)
    if not math.isfinite(temperature) or not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise InvalidInputError(f"input 'temperature'={temperature} is out of range: use 0 (greedy) to {MAX_TEMPERATURE:g}")
    top_p = _scalar(inputs, "top_p", float, 1.0)
    if top_p == 0.0:
        top_p = 1.0  # NOTE: TensorRT-LLM clients send top_p=0 to mean "no nucleus filtering".
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise InvalidInputError(f"input 'top_p'={top_p} is out of range: use a value in (0, 1]")
    top_k = _scalar(inputs, "top_k", int, 0)
    if top_k < 0:
        raise InvalidInputError(f"input 'top_k'={top_k} is out of range: use 0 (no limit) or a positive count")
    seed = _scalar(inputs, "seed", int, 0)
    if not 0 <= seed <= MAX_SEED:
        raise InvalidInputError(f"input 'seed'={seed} is out of range: use 0 to 2**64-1")
    stream = _scalar(inputs, "stream", bool, False)
    cluster_id = _scalar(inputs, "cluster_id", int, -1)
    warmup_plan = parse_optional_string(inputs, "warmup_plan") or None
    return GenerateRequest(
        prompt_ids=prompt_ids,
        adapter=adapter,
        tenant=tenant,
        stream=stream,
        sampling=SamplingParams(max_tokens, temperature, top_p, top_k, seed),
        cluster_id=cluster_id,
        warmup_plan=warmup_plan,
    )


def _single_string(array: np.ndarray, name: str) -> str:
    if array.size != 1:
        raise InvalidInputError(f"input '{name}' must hold exactly one string, got {array.size} elements")
    value = array.reshape(-1)[0]
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInputError(
                f"input '{name}' is not valid UTF-8 (byte {exc.start}: {exc.reason}); encode the text as UTF-8"
            ) from None
    raise InvalidInputError(f"input '{name}' must be a BYTES (string) tensor")


def _scalar(inputs: Inputs, name: str, cast: type, default: object) -> object:
    array = inputs.get(name)
    if array is None:
        return default
    if array.size != 1:
        raise InvalidInputError(f"input '{name}' must hold exactly one value, got {array.size}")
    value = array.reshape(-1)[0]
    if cast is float:
        return float(value)
    if cast is bool:
        return bool(value)
    return int(value)
