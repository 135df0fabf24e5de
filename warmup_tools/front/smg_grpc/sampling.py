"""A ``VllmEngine.Generate`` request as the project's generate request: the prompt's token ids and the sampling
inputs by their wire names (common/wire.py's ``SamplingParams``), or a :class:`Refusal` that says what to change.

What the project does not do is refused, never silently dropped: several choices (``n``), log probabilities,
structured output, logit bias, min_p, frequency and presence penalties, min_tokens, prompt truncation,
multimodal and disaggregated (KV transfer) inputs, text input. What smg does on its side is taken and left to it:
stop strings and stop token ids (smg's stop decoder cuts the text it detokenizes, and ends the stream),
``skip_special_tokens``, ``spaces_between_special_tokens``, ``include_stop_str_in_output`` (detokenizing is smg's).
proto3 scalars without presence read 0 when unset: ``top_p``, ``top_k`` and ``repetition_penalty`` at 0 mean the
project's default (1, no limit, 1).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import grpc

from warmup_tools.common.wire import INPUTS
from warmup_tools.triton.inputs import MAX_PROMPT_TOKENS

#: The largest ``max_tokens`` a request may name before lora_adapter's own ``max_tokens_limit`` answers (the
#: HTTP front's bound: front/schemas.py).
MAX_TOKENS_FIELD = 1 << 20
#: The most characters one stop string may have (the HTTP front's bound), and the most stop token ids.
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
#: The longest request id (smg's are UUIDs with a prefix).
MAX_REQUEST_ID_CHARS = 256
#: Largest id a token may have on the wire (``input_ids`` is INT32).
_MAX_INT32 = 2**31 - 1


class Refusal(Exception):
    """A request refused before it reaches tritonserver: the gRPC status and the message the caller reads."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> Refusal:
    return Refusal(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclasses.dataclass(frozen=True, slots=True)
class GenerateLimits:
    """The bounds on one request (the HTTP front's, from its settings and the LM's config)."""

    #: Prompt tokens at most (the LM's context, at most lora_adapter's MAX_PROMPT_TOKENS).
    max_prompt_tokens: int = MAX_PROMPT_TOKENS
    #: Stop strings at most (the front's ``max_stop``).
    max_stop: int = 4
    #: Token ids are below it (the LM's vocabulary); None: not known here (lora_adapter checks it).
    vocab_size: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class GenerateArgs:
    """What the engine takes from one request."""

    request_id: str
    input_ids: tuple[int, ...]
    #: The sampling inputs the request sets, by their wire names.
    sampling: dict[str, Any]
    stream: bool


def generate_args(request: Any, limits: GenerateLimits) -> GenerateArgs:
    """The generation ``request`` (a ``vllm_engine_pb2.GenerateRequest``) asks for; :class:`Refusal` (INVALID_ARGUMENT)
    for what the project does not do or a value out of its bound."""
    request_id = request.request_id
    if not request_id or len(request_id) > MAX_REQUEST_ID_CHARS:
        raise invalid(f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} characters")
    if request.WhichOneof("input") != "tokenized":
        raise invalid("send the prompt as token ids (tokenized.input_ids): this worker does not tokenize text")
    for field, what in (("mm_inputs", "multimodal inputs"), ("media_refs", "media references"),
                        ("kv_transfer_params", "KV transfer (disaggregated prefill)")):
        if request.HasField(field):
            raise invalid(f"{what} are not supported: this worker serves a text-only LM")
    if len(request.extra_mm_inputs):
        raise invalid("multimodal inputs are not supported: this worker serves a text-only LM")
    if request.HasField("kv_transfer_params_json"):
        raise invalid("KV transfer (disaggregated prefill) is not supported")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise invalid("data_parallel_rank must be 0: this worker has one rank")
    ids = tuple(request.tokenized.input_ids)
    if not ids:
        raise invalid("tokenized.input_ids must hold at least one token id")
    if len(ids) > limits.max_prompt_tokens:
        raise invalid(f"the prompt holds {len(ids)} tokens; this worker takes at most {limits.max_prompt_tokens}")
    top = max(ids)
    bound = min(limits.vocab_size, _MAX_INT32 + 1) if limits.vocab_size else _MAX_INT32 + 1
    if top >= bound:
        raise invalid(f"tokenized.input_ids holds token id {top} outside the vocabulary [0, {bound})")
    return GenerateArgs(request_id, ids, sampling_inputs(request.sampling_params, limits), bool(request.stream))


def sampling_inputs(params: Any, limits: GenerateLimits) -> dict[str, Any]:
    """The wire sampling inputs of ``params`` (a ``SamplingParams``): those it sets, checked against their bounds."""
    _refuse_unsupported(params)
    stops = list(params.stop)
    if len(stops) > limits.max_stop:
        raise invalid(f"stop may hold at most {limits.max_stop} strings")
    if any(len(stop) > MAX_STOP_CHARS for stop in stops):
        raise invalid(f"a stop string may have at most {MAX_STOP_CHARS} characters")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise invalid(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids")
    values: dict[str, Any] = {}
    if params.HasField("max_tokens"):
        if not 1 <= params.max_tokens <= MAX_TOKENS_FIELD:
            raise invalid(f"max_tokens must be 1 to {MAX_TOKENS_FIELD}")
        values["max_tokens"] = int(params.max_tokens)
    if params.HasField("temperature"):
        values["temperature"] = float(params.temperature)
    if params.top_p != 0.0:
        values["top_p"] = float(params.top_p)
    if params.top_k != 0:
        if params.top_k > _MAX_INT32:
            raise invalid(f"top_k must be at most {_MAX_INT32}")
        values["top_k"] = int(params.top_k)
    if params.repetition_penalty != 0.0:
        values["repetition_penalty"] = float(params.repetition_penalty)
    if params.HasField("seed"):
        values["seed"] = int(params.seed)
    if params.ignore_eos:
        values["ignore_eos"] = True
    for name, value in values.items():
        reason = INPUTS[name].check(value)
        if reason is not None:
            raise invalid(f"{name} is out of range: use {INPUTS[name].bound}")
    return values


def _refuse_unsupported(params: Any) -> None:
    if params.n > 1:
        raise invalid("n must be 1: this worker returns one choice per request")
    if params.HasField("logprobs") or params.HasField("prompt_logprobs"):
        raise invalid("log probabilities are not supported by this worker")
    constraint = params.WhichOneof("constraint")
    if constraint is not None:
        raise invalid(f"structured output ({constraint}) is not supported by this worker")
    if len(params.logit_bias):
        raise invalid("logit_bias is not supported by this worker")
    if params.HasField("truncate_prompt_tokens"):
        raise invalid("truncate_prompt_tokens is not supported: send a prompt that fits")
    for name in ("min_p", "frequency_penalty", "presence_penalty"):
        if getattr(params, name) != 0.0:
            raise invalid(f"{name} is not supported by this worker: leave it 0")
    if params.min_tokens:
        raise invalid("min_tokens is not supported by this worker: leave it 0")
