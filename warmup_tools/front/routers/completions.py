"""``POST /v1/completions``: a raw prompt, streamed or not."""

from __future__ import annotations

import json
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from warmup_tools.front.engine.engine import GenerateInput
from warmup_tools.front.errors import OpenAIError, bad_request
from warmup_tools.front.generation import CLIENT_GONE_STATUS, DONE, Generation, GenerationStream, sse, watched
from warmup_tools.front.schemas import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
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


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> JSONResponse | StreamingResponse:
    state = front_state(request)
    caller = caller_of(request, body.user)
    state.tenants.check(caller.tenant, caller.key is not None)  # NOTE: a tenant over its bound costs no more work
    await check_ready(state)
    check_common(state, body)
    if body.logprobs is not None:
        raise bad_request("logprobs are not supported by this server", param="logprobs")
    if body.echo:
        raise bad_request("echo is not supported by this server", param="echo")
    if body.best_of not in (None, 1):
        raise bad_request("best_of must be 1: this server returns one choice per request", param="best_of")
    if body.suffix:
        raise bad_request("suffix is not supported by this server", param="suffix")
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if len(prompts) != 1:
        raise bad_request("prompt must be one string (a list of exactly one): batches are not supported",
                          param="prompt")
    prompt = prompts[0]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    adapter = await resolve_model(state, body.model)
    check_prompt_size(state, prompt, "prompt")
    generate = GenerateInput(prompt=prompt, adapter=adapter, tenant=caller.tenant, tenant_key=caller.key,
                             sampling=body.sampling(), trace=trace_of(state, request))
    generation = Generation(state.engine, generate, body.stop_strings(), body.model, state.in_flight,
                            state.tenants)
    request_id, created = completion_id("cmpl"), now()
    if not await watched(request, generation, generation.start()):
        return JSONResponse({}, status_code=CLIENT_GONE_STATUS)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return GenerationStream(generation, _events(generation, request_id, created, body.model, include_usage))
    if not await watched(request, generation, generation.drain()):
        return JSONResponse({}, status_code=CLIENT_GONE_STATUS)
    out = generation.outcome
    answer = CompletionResponse(
        id=request_id, created=created, model=body.model,
        choices=[CompletionChoice(text="".join(out.text), finish_reason=out.finish_reason)],
        usage=Usage.of(out.prompt_tokens, out.completion_tokens, out.cached_tokens))
    return JSONResponse(answer.model_dump())


async def _events(generation: Generation, request_id: str, created: int, model: str,
                  include_usage: bool) -> AsyncIterator[bytes]:
    def chunk(text: str, finish_reason: str | None = None) -> bytes:
        return sse(CompletionResponse(id=request_id, created=created, model=model,
                                      choices=[CompletionChoice(text=text, finish_reason=finish_reason)]
                                      ).model_dump_json())

    # NOTE: built once, filled per token (see the chat router).
    head, _, tail = chunk("\0").decode().partition('"\\u0000"')
    try:
        async for piece in generation.pieces():
            yield (head + json.dumps(piece, ensure_ascii=False) + tail).encode()
    except OpenAIError as exc:
        yield sse(exc.body())
        yield DONE
        return
    out = generation.outcome
    yield chunk("", out.finish_reason)
    if include_usage:
        usage = Usage.of(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
        yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                     usage=usage).model_dump_json())
    yield DONE
