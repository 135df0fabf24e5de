"""The generate request on the wire, defined once: its inputs, its outputs, the ensemble's wiring, error kinds.

Every user reads this module: ``lora_adapter`` parses its inputs from it (lora_adapter/requests.py), both clients
build their tensors with :func:`input_tensors` (server/client.py, front/engine/triton_engine.py), the front drives
the composing models by :data:`ENSEMBLE_STEPS`, and a unit test checks ``model_repository/ensemble/config.pbtxt``
and ``model_repository/lora_adapter/config.pbtxt`` against it (the config files stay static text Triton reads).

A sampling parameter is one field of :class:`SamplingParams`, declared with :func:`sampling_input` (its wire type,
default, bound and doc): from it requests.py parses and checks the value, the clients build its tensor, and the
test asks for it in both config.pbtxt files, as TensorRT-LLM's ensemble takes each sampling input as a tensor of
its own (``temperature``, ``top_p``, ``repetition_penalty``, ...).

Errors: a model's error message starts with its :class:`ErrorKind` as a tag, ``[kind] message``
(:func:`tag`), which the front reads back (:func:`untag`) and maps to an HTTP status. NOTE: a code cannot carry
the kind: a gRPC stream's error carries a message without a code, Triton's codes have no "busy" or
"unauthenticated", and through the ensemble Triton 2.51's HTTP generate endpoint answers a step's NOT_FOUND
with 400, as it does INVALID_ARG (docs/openai.md, "Errors").
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any, Callable, Iterable, Mapping

import numpy as np


# ------------------------------------------------------------------------------------------------ error kinds
class ErrorKind(str, enum.Enum):
    """What an error means to a client, whatever its words: the front maps each to one HTTP status."""

    INVALID = "invalid"  # a bad value in the request (400)
    UNAUTHENTICATED = "unauthenticated"  # the tenant is not proven (401)
    NOT_FOUND = "not_found"  # the adapter is unknown or not live (404)
    TOO_LARGE = "too_large"  # the request is larger than a bound (413)
    BUSY = "busy"  # the instance's queue is full: retry later (429)
    RATE_LIMITED = "rate_limited"  # this tenant holds its share of the instance: retry once its requests end (429)
    UNAVAILABLE = "unavailable"  # the replica cannot serve now: retry elsewhere (503)
    CANCELLED = "cancelled"  # the client cancelled the request (nobody reads the answer)
    TIMEOUT = "timeout"  # no answer within the deadline (504)
    INTERNAL = "internal"  # a fault on the server's side (500)

    def __str__(self) -> str:
        return self.value


#: ``[kind] `` at the start of a model's message (after tritonserver's own prefixes).
_TAG = re.compile(r"^\[(" + "|".join(kind.value for kind in ErrorKind) + r")\] ")


def tag(kind: ErrorKind, message: str) -> str:
    """``message`` as a model sends it: its kind first, as ``[kind] message``."""
    return f"[{kind.value}] {message}"


def untag(message: str) -> tuple[ErrorKind | None, str]:
    """The kind and the text of a tagged message; ``(None, message)`` for one without a tag (tritonserver's own)."""
    match = _TAG.match(message)
    if match is None:
        return None, message
    return ErrorKind(match.group(1)), message[match.end():]


# ------------------------------------------------------------------------------------------------ inputs
#: Triton's datatype of each wire type, its ``config.pbtxt`` spelling, numpy dtype and Python type.
DATATYPES: dict[str, tuple[str, Any, type]] = {
    "INT32": ("TYPE_INT32", np.int32, int),
    "UINT64": ("TYPE_UINT64", np.uint64, int),
    "FP32": ("TYPE_FP32", np.float32, float),
    "BOOL": ("TYPE_BOOL", np.bool_, bool),
    "BYTES": ("TYPE_STRING", np.object_, str),
}


@dataclasses.dataclass(frozen=True, slots=True)
class WireInput:
    """One input tensor of the generate request."""

    name: str
    #: Triton's datatype (a key of :data:`DATATYPES`).
    dtype: str
    doc: str
    dims: tuple[int, ...] = (1,)
    optional: bool = True
    #: A client of ``ensemble`` sends it (an input of the ensemble, mapped by name to the steps that take it).
    ensemble: bool = True
    #: What ``lora_adapter``'s input is mapped from in the ensemble: an ensemble input or an earlier step's
    #: output (``_input_ids``); None: not mapped (set only by a direct client or a warm-up sample).
    lora_source: str | None = None
    #: ``lora_adapter`` takes it.
    lora: bool = True
    default: Any = None
    #: What a valid value is, in words (the end of the message that refuses one), and the check.
    bound: str = ""
    valid: Callable[[Any], bool] | None = dataclasses.field(default=None, compare=False)
    #: A field of :class:`SamplingParams`.
    sampling: bool = False

    @property
    def cast(self) -> type:
        return DATATYPES[self.dtype][2]

    def check(self, value: Any) -> str | None:
        """Why ``value`` is out of this input's bound (the message a client reads), or None when it is valid."""
        if self.valid is None or self.valid(value):
            return None
        return f"input '{self.name}' is out of range: use {self.bound}"


def sampling_input(default: Any, dtype: str, doc: str, *, bound: str = "",
                   valid: Callable[[Any], bool] | None = None) -> Any:
    """A field of :class:`SamplingParams`: its default, its wire type and its bound (the one place each is written)."""
    return dataclasses.field(default=default, metadata={"wire": (dtype, doc, bound, valid)})


#: Largest seed a request may carry (``UINT64``), and the bounds of the sampling inputs.
MAX_SEED = 2**64 - 1
MAX_TEMPERATURE = 100.0
#: The lowest sampling temperature (0 is greedy). NOTE: sampling divides the float32 logits by the
#: temperature (lora_adapter/sampling.py); a temperature that is subnormal in float32 (below 1.2e-38, such
#: as 1e-40) or small enough that a logit over it passes float32's 3.4e38 turns the scores into inf and the
#: distribution into NaN. At 0.01 a logit of 3.4e36 would still fit, and a gap of 0.5 between two logits
#: already gives odds of e^-50: below it sampling is greedy in all but name (vLLM raises smaller ones to
#: 0.01 for the same reason). The bound is the FP32 value nearest 0.01, since the input is FP32.
MIN_TEMPERATURE = float(np.float32(0.01))
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token. ``temperature == 0`` (the default) is greedy decoding.

    Each field is an input of the generate request (:data:`SAMPLING_INPUTS`), in ``ensemble`` and ``lora_adapter``.
    """

    max_tokens: int = sampling_input(16, "INT32", "New tokens to generate at most (the deployment's "
                                     "default_max_tokens when absent, at most its max_tokens_limit).")
    temperature: float = sampling_input(
        0.0, "FP32", "Sampling temperature; 0 is greedy decoding.", bound=f"0 (greedy) or {MIN_TEMPERATURE:.2g} "
        f"to {MAX_TEMPERATURE:g}", valid=lambda v: v == 0.0 or MIN_TEMPERATURE <= v <= MAX_TEMPERATURE)
    # NOTE: some TensorRT-LLM clients send top_p=0 to mean "no nucleus filtering"; taken literally it keeps
    # no token at all, so it is refused with the value to send instead rather than silently reinterpreted.
    top_p: float = sampling_input(1.0, "FP32", "Nucleus sampling: the smallest set of tokens whose probability "
                                  "reaches top_p.", bound="a value in (0, 1] (1 for no nucleus filtering)",
                                  valid=lambda v: 0.0 < v <= 1.0)
    top_k: int = sampling_input(0, "INT32", "Sample among the top_k most likely tokens; 0 for no limit.",
                                bound="0 (no limit) or a positive count", valid=lambda v: v >= 0)
    seed: int = sampling_input(0, "UINT64", "Seed of the request's random generator (sampling is reproducible).",
                               bound="0 to 2**64-1", valid=lambda v: 0 <= v <= MAX_SEED)
    # NOTE: at least 0.01 for the reason temperature is: a positive logit divided by a float32-subnormal penalty
    # is inf, and the distribution NaN.
    repetition_penalty: float = sampling_input(
        1.0, "FP32", "Divides the positive logits of tokens already in the prompt or the output and multiplies "
        "the negative ones (vLLM's and Hugging Face's repetition_penalty); 1 for none, above 1 repeats less.",
        bound=f"{MIN_REPETITION_PENALTY:g} to {MAX_REPETITION_PENALTY:g} (1 for no penalty)",
        valid=lambda v: MIN_REPETITION_PENALTY <= v <= MAX_REPETITION_PENALTY)
    ignore_eos: bool = sampling_input(
        False, "BOOL", "Keep generating after an end-of-sequence token, up to max_tokens (vLLM's ignore_eos: "
        "benchmarks compare servers at the same output length).")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _sampling_rows() -> tuple[WireInput, ...]:
    rows = []
    for field in dataclasses.fields(SamplingParams):
        dtype, doc, bound, valid = field.metadata["wire"]
        rows.append(WireInput(field.name, dtype, doc, lora_source=field.name, default=field.default, bound=bound,
                              valid=valid, sampling=True))
    return tuple(rows)


#: The sampling inputs, in the order of :class:`SamplingParams`' fields.
SAMPLING_INPUTS: tuple[WireInput, ...] = _sampling_rows()

#: Cluster ids are the embedding cache's semantic clusters (bounded by its max_clusters).
MAX_CLUSTER_ID = 1 << 20

#: The longest retention a planned KV block may carry (the warm-up sample's ``warmup_retention_s``, a plan
#: item's ``retention_s``): 30 days. NOTE: a bound, not a policy: a pin is a priority that expires, and a
#: retention no log could have measured is a mistake, not a plan.
MAX_RETENTION_S = 30 * 86400.0


def valid_retention(value: float) -> bool:
    """Whether ``value`` is a retention a planned block may carry: finite seconds in (0, MAX_RETENTION_S]."""
    return 0.0 < value <= MAX_RETENTION_S  # NOTE: NaN fails, +inf is above the bound


def plan_retention(value: Any) -> float | None:
    """A plan item's ``retention_s`` (a JSON value) as the seconds its sample would carry; None for none.
    ``ValueError`` with the bound for a value ``lora_adapter`` would refuse as ``warmup_retention_s`` (checked
    as the FP32 the sample carries, so a plan the live channel takes is one the stanzas take)."""
    if value is None:
        return None
    row = INPUTS["warmup_retention_s"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"retention_s must be {row.bound}")
    with np.errstate(over="ignore"):
        seconds = float(np.float32(value))
    if row.check(seconds) is not None:
        raise ValueError(f"retention_s must be {row.bound}")
    return seconds

#: Every input of the generate request: the ensemble's (``ensemble``) and lora_adapter's (``lora``).
GENERATE_INPUTS: tuple[WireInput, ...] = (
    WireInput("text_input", "BYTES", "The prompt text (lora_adapter: for the request log only).",
              lora_source="text_input"),
    WireInput("stream", "BOOL", "One response per token (true) or one with the whole text.",
              lora_source="stream", default=False),
    *SAMPLING_INPUTS,
    WireInput("adapter_id", "BYTES", "The LoRA adapter; none for the base model.", lora_source="adapter_id"),
    WireInput("tenant_id", "BYTES", "The tenant (trust mode: proven by tenant_key).", lora_source="tenant_id"),
    WireInput("tenant_key", "BYTES", "Trust mode: the key tokenizer_cache verifies tenant_id with.", lora=False),
    WireInput("tenant_token", "BYTES", "Trust mode: the first step's token for the later steps.", ensemble=False,
              lora_source="_tenant_token"),
    WireInput("input_ids", "INT32", "The prompt's token ids.", dims=(-1,), ensemble=False, optional=False,
              lora_source="_input_ids"),
    WireInput("cluster_id", "INT32", "The prompt's semantic cluster (embedding_cache); -1 for none.",
              ensemble=False, lora_source="_cluster_id", default=-1, bound=f"-1 (none) to {MAX_CLUSTER_ID}",
              valid=lambda v: -1 <= v <= MAX_CLUSTER_ID),
    WireInput("warmup_plan", "BYTES", "Set only by warm-up samples: the plan whose KV blocks they pin.",
              ensemble=False),
    WireInput("warmup_retention_s", "FP32", "Set only by warm-up samples that carry warmup_plan: how long the "
              "blocks they pin stay pinned, in seconds (absent: the model's kv_pin_retention_s); then they are "
              "ordinary blocks of the live eviction policy.", ensemble=False,
              bound=f"a number of seconds above 0 and at most {MAX_RETENTION_S:.0f} (30 days)",
              valid=valid_retention),
)
INPUTS: dict[str, WireInput] = {row.name: row for row in GENERATE_INPUTS}
#: The names ``lora_adapter`` reads and those a client of ``ensemble`` may send.
LORA_ADAPTER_INPUTS: tuple[str, ...] = tuple(row.name for row in GENERATE_INPUTS if row.lora)
ENSEMBLE_INPUTS: tuple[str, ...] = tuple(row.name for row in GENERATE_INPUTS if row.ensemble)

#: The outputs of ``lora_adapter`` and of ``ensemble`` (the same tensors): name and datatype.
GENERATE_OUTPUTS: tuple[tuple[str, str], ...] = (
    ("text_output", "BYTES"), ("cached_tokens", "INT32"), ("prompt_tokens", "INT32"), ("output_tokens", "INT32"),
    ("finish_reason", "BYTES"),
)
#: The outputs of ``lora_adapter`` alone (the ensemble does not map them): name and datatype, dims ``[-1]``.
#: ``token_ids``: the token ids of the response (one per streamed token; every token in a non-streamed answer),
#: for a client that detokenizes itself (smg's gRPC worker protocol: warmup_tools/front/smg_grpc).
LORA_ONLY_OUTPUTS: tuple[tuple[str, str], ...] = (("token_ids", "INT32"),)


@dataclasses.dataclass(frozen=True, slots=True)
class EnsembleStep:
    """One step of the ensemble: the model, its inputs from ensemble tensors, its outputs to ensemble tensors."""

    model: str
    #: ``{model input: ensemble tensor}`` (``input_map``).
    inputs: Mapping[str, str]
    #: ``{model output: ensemble tensor}`` (``output_map``).
    outputs: Mapping[str, str]


#: The ensemble's steps, in order (``ensemble_scheduling`` in ensemble/config.pbtxt). NOTE: prompt_tokens also
#: orders embedding_cache after tokenizer_cache (ensemble/config.pbtxt says why).
ENSEMBLE_STEPS: tuple[EnsembleStep, ...] = (
    EnsembleStep("tokenizer_cache",
                 {"text_input": "text_input", "tenant_id": "tenant_id", "tenant_key": "tenant_key"},
                 {"input_ids": "_input_ids", "input_length": "_input_length", "tenant_token": "_tenant_token"}),
    EnsembleStep("embedding_cache",
                 {"text_input": "text_input", "prompt_tokens": "_input_length", "tenant_id": "tenant_id",
                  "tenant_token": "_tenant_token", "adapter_id": "adapter_id"},
                 {"cluster_id": "_cluster_id"}),
    EnsembleStep("lora_adapter",
                 {row.name: row.lora_source for row in GENERATE_INPUTS if row.lora and row.lora_source},
                 {name: name for name, _ in GENERATE_OUTPUTS}),
)


def input_tensors(values: Mapping[str, Any]) -> list[tuple[str, str, np.ndarray]]:
    """``(name, datatype, array)`` of each input in ``values`` that is not None, as Triton takes it (shape [1];
    text as UTF-8 bytes), in the table's order. A name that is no input of the request raises ``KeyError``."""
    unknown = set(values) - set(INPUTS)
    if unknown:
        raise KeyError(f"not an input of the generate request: {sorted(unknown)}")
    tensors = []
    for row in GENERATE_INPUTS:
        value = values.get(row.name)
        if value is None:
            continue
        tensors.append((row.name, row.dtype, _array(row, value)))
    return tensors


def _array(row: WireInput, value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if row.dtype == "BYTES":
        return np.array([value if isinstance(value, bytes) else str(value).encode("utf-8")], dtype=np.object_)
    return np.array([value], dtype=DATATYPES[row.dtype][1])


def sampling_values(source: Any, names: Iterable[str] = ()) -> dict[str, Any]:
    """The sampling inputs ``source`` (an object with attributes of those names) sets, not None: what a client
    sends. ``names`` are further inputs to take (``stream``)."""
    wanted = [row.name for row in SAMPLING_INPUTS] + list(names)
    return {name: value for name in wanted if (value := getattr(source, name, None)) is not None}
