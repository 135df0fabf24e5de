"""The OpenAI request and response models the front reads and writes (pydantic), in one module.

Requests are validated strictly (a string is not a number); fields OpenAI defines that the front does not
use are ignored, as OpenAI ignores unknown ones (docs/openai.md lists them). Parameters the engine cannot
honour (``n`` > 1, ``logprobs``, ``echo``, ``best_of`` > 1) are refused with a 400 that says so.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from warmup_tools.common.wire import sampling_values

#: Sampling bounds as OpenAI documents them (the engine accepts a subset: see ``sampling_inputs``).
MAX_TEMPERATURE = 2.0
MAX_SEED = 2**64 - 1
#: The largest max_tokens a request may name before the engine's own limit answers (a 400 either way).
MAX_TOKENS_FIELD = 1 << 20
#: The most characters one stop string may have.
MAX_STOP_CHARS = 256


def _valid_unicode(value: Any) -> Any:
    """A text field (or each string of a list, or each content part's ``text``) as given, or a ``ValueError`` when
    UTF-8 cannot encode it."""
    for index, item in enumerate(value if isinstance(value, list) else [value]):
        text = item.get("text") if isinstance(item, dict) else item
        if isinstance(text, str) and not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                where = f" (item {index})" if isinstance(value, list) else ""
                raise ValueError(f"must be valid Unicode text{where}: it holds a lone surrogate (a JSON escape "
                                 "\\ud800 to \\udfff not in a pair), which UTF-8 cannot encode") from None
    return value


#: The check of every text field of a request (``Annotated[<its type>, UNICODE]``): JSON's ``"\ud800"`` escape
#: decodes to a lone surrogate that no part of the front or the engine can encode as UTF-8 (it failed deep in
#: the engine, a 500), so it is a 400 here that names the field and never echoes the text (app.py's handler).
#: NOTE: before the field's own type, so that a union (a string or a list) or a length bound reports this once.
UNICODE = BeforeValidator(_valid_unicode)


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class TextPart(_Request):
    type: Literal["text"]
    text: Annotated[str, UNICODE]


class ChatMessage(_Request):
    #: ``developer`` is OpenAI's newer name for ``system`` and is rendered as one.
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str | list[TextPart] | None, UNICODE] = None
    name: Annotated[str | None, UNICODE] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _SamplingRequest(_Request):
    model: Annotated[str, UNICODE, Field(min_length=1, max_length=256)]
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    #: vLLM's extra parameter (not OpenAI's); its bound is the engine's (common/wire.py).
    repetition_penalty: float | None = None
    #: vLLM's extra parameter (not OpenAI's).
    ignore_eos: bool | None = None
    stop: Annotated[str | list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] | None,
                    UNICODE] = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Annotated[str | None, UNICODE, Field(max_length=256)] = None

    def sampling(self) -> dict[str, Any]:
        """The sampling inputs of the generate request (common/wire.py) this request sets: a field named like
        one goes to the engine as that input, whose table bounds it."""
        return sampling_values(self)

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_FIELD)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_FIELD)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    def sampling(self) -> dict[str, Any]:
        values = super().sampling()
        if self.max_completion_tokens is not None:  # OpenAI's newer name wins
            values["max_tokens"] = self.max_completion_tokens
        return values


class CompletionRequest(_SamplingRequest):
    prompt: Annotated[str | list[str], UNICODE]
    #: OpenAI's default for completions is 16 tokens.
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_FIELD)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool | None = False
    best_of: Annotated[int, Field(ge=1, le=128)] | None = None
    suffix: Annotated[str | None, UNICODE] = None


# ------------------------------------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str = ""


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str = ""
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """Both the whole answer (``text_completion``) and, with ``stream``, each chunk (the same object)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "warmup_tools"
    #: vLLM's convention: an adapter names its base model as parent; the base model has none.
    parent: str | None = None
    root: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
