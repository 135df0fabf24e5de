"""``GET /v1/models`` and ``GET /v1/models/{model}``: the base model and every live adapter (vLLM's
convention: an adapter is a model name). An adapter that is registered but not live yet is not listed."""

from __future__ import annotations

from fastapi import APIRouter, Request

from warmup_tools.front.errors import model_not_found
from warmup_tools.front.schemas import ModelCard, ModelList, now
from warmup_tools.front.serving import caller_of, front_state

router = APIRouter()


async def _cards(request: Request) -> list[ModelCard]:
    state = front_state(request)
    created = now()
    base = state.settings.served_model_name
    models = await state.engine.models()
    return [ModelCard(id=base, created=created, root=base),
            *(ModelCard(id=name, created=created, parent=base, root=base) for name in models.live())]


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    caller_of(request, None)
    return ModelList(data=await _cards(request))


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> ModelCard:
    caller_of(request, None)
    for card in await _cards(request):
        if card.id == model:
            return card
    reason = (await front_state(request).engine.models()).adapters.get(model)
    raise model_not_found(f"The model '{model}' is not served yet: {reason}" if reason else
                          f"The model '{model}' does not exist: GET /v1/models lists the models served here")
