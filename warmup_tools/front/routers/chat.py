"""``POST /v1/chat/completions``: messages rendered with the model's chat template, streamed or not."""

from __future__ import annotations

import json
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from warmup_tools.front.chat_template import ChatTemplateError
from warmup_tools.front.engine.engine import GenerateInput
from warmup_tools.front.errors import OpenAIError, bad_request
from warmup_tools.front.generation import CLIENT_GONE_STATUS, DONE, Generation, GenerationStream, sse, watched
from warmup_tools.front.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    Delta,
    Usage,
    completion_id,
    now,
)
from warmup_tools.front.serving import (
    caller_of,
    check_common,
    check_prompt_size,
    check_ready,
    front_state,
    resolve_model,
    trace_of,
)

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    state = front_state(request)
    caller = caller_of(request, body.user)
    state.tenants.check(caller.tenant, caller.key is not None)  # NOTE: a tenant over its bound costs no more work
    await check_ready(state)
    check_common(state, body)
    if body.logprobs or body.top_logprobs:
        raise bad_request("logprobs are not supported by this server", param="logprobs")
    if len(body.messages) > state.settings.max_messages:
        raise OpenAIError(413, f"messages holds {len(body.messages)} messages; this server takes at most "
                               f"{state.settings.max_messages}", param="messages", code="too_many_messages")
    adapter = await resolve_model(state, body.model)
    if state.renderer is None:
        raise bad_request("this model has no chat template: send a raw prompt to /v1/completions", param="messages")
    try:
        chat = state.renderer.render([(m.role, m.text()) for m in body.messages])
    except ChatTemplateError as exc:
        raise bad_request(str(exc), param="messages") from None
    check_prompt_size(state, chat.prompt, "messages")
    generate = GenerateInput(prompt=chat.prompt, adapter=adapter, tenant=caller.tenant, tenant_key=caller.key,
                             sampling=body.sampling(), roles=chat.roles, trace=trace_of(state, request))
    generation = Generation(state.engine, generate, body.stop_strings(), body.model, state.in_flight,
                            state.tenants)
    request_id, created = completion_id("chatcmpl"), now()
    if not await watched(request, generation, generation.start()):
        return JSONResponse({}, status_code=CLIENT_GONE_STATUS)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return GenerationStream(generation, _events(generation, request_id, created, body.model, include_usage))
    if not await watched(request, generation, generation.drain()):
        return JSONResponse({}, status_code=CLIENT_GONE_STATUS)
    out = generation.outcome
    answer = ChatCompletionResponse(
        id=request_id, created=created, model=body.model,
        choices=[ChatChoice(message=AssistantMessage(content="".join(out.text)), finish_reason=out.finish_reason)],
        usage=Usage.of(out.prompt_tokens, out.completion_tokens, out.cached_tokens))
    return JSONResponse(answer.model_dump())


async def _events(generation: Generation, request_id: str, created: int, model: str,
                  include_usage: bool) -> AsyncIterator[bytes]:
    def chunk(delta: Delta, finish_reason: str | None = None) -> bytes:
        return sse(ChatCompletionChunk(id=request_id, created=created, model=model,
                                       choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)]
                                       ).model_dump_json(exclude_none=False))

    # NOTE: a content chunk differs from the first only in its delta: built once, filled per token (this
    # runs once per token, and a pydantic model per token costs more than the rest of the front's path).
    head, _, tail = chunk(Delta(content="\0")).decode().partition('"\\u0000"')
    yield chunk(Delta(role="assistant", content=""))
    try:
        async for piece in generation.pieces():
            yield (head + json.dumps(piece, ensure_ascii=False) + tail).encode()
    except OpenAIError as exc:
        yield sse(exc.body())
        yield DONE
        return
    out = generation.outcome
    yield chunk(Delta(), out.finish_reason)
    if include_usage:
        usage = Usage.of(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
        yield sse(ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                      usage=usage).model_dump_json())
    yield DONE
