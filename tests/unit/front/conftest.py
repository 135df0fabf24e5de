"""A front over a scripted engine (no tritonserver): what the routers do with each answer of the engine."""

from __future__ import annotations

import dataclasses
from typing import AsyncIterator

import jinja2
import pytest
from fastapi.testclient import TestClient

from warmup_tools.demo.assets import CHAT_TEMPLATE
from warmup_tools.front.app import build_app
from warmup_tools.front.chat_template import ChatRenderer
from warmup_tools.front.engine.engine import (
    EngineError,
    GenerateChunk,
    GenerateInput,
    LoadSignals,
    ModelState,
    Readiness,
)
from warmup_tools.front.settings import FrontSettings


class TemplateTokenizer:
    """What ChatRenderer needs of a tokenizer: the demo LM's chat template, rendered by jinja2 as transformers does."""

    chat_template = CHAT_TEMPLATE

    def __init__(self) -> None:
        self._template = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(CHAT_TEMPLATE)

    def apply_chat_template(self, conversation, tokenize=False, add_generation_prompt=False):
        return self._template.render(messages=conversation, add_generation_prompt=add_generation_prompt)


@dataclasses.dataclass
class ScriptedEngine:
    """Answers each generation with ``pieces`` (the last with finish_reason), or raises ``error``."""

    pieces: list[str] = dataclasses.field(default_factory=lambda: ["Hel", "lo", " world"])
    error: EngineError | None = None
    error_after: int | None = None
    adapters: dict[str, str | None] = dataclasses.field(default_factory=lambda: {"sql": None,
                                                                                "legal": "adapter 'legal' is warming"})
    ready: bool = True
    requests: list[GenerateInput] = dataclasses.field(default_factory=list)
    closed: int = 0
    started: bool = False

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.started = False

    async def generate(self, request: GenerateInput) -> AsyncIterator[GenerateChunk]:
        self.requests.append(request)
        if self.error is not None and self.error_after is None:
            raise self.error
        try:
            for index, piece in enumerate(self.pieces, start=1):
                if self.error_after is not None and index > self.error_after:
                    raise self.error
                last = index == len(self.pieces)
                yield GenerateChunk(piece, prompt_tokens=40, cached_tokens=32, output_tokens=index,
                                    finish_reason="length" if last else "")
        finally:
            self.closed += 1

    async def models(self, refresh: bool = False) -> ModelState:
        return ModelState(dict(self.adapters))

    async def readiness(self, refresh: bool = False) -> Readiness:
        return Readiness(self.ready, "" if self.ready else "lora_adapter failing its probes",
                         **getattr(self, "temperature", {}))

    async def load(self) -> LoadSignals:
        return LoadSignals(running=3, waiting=1, kv_usage=0.25)


@pytest.fixture()
def engine() -> ScriptedEngine:
    return ScriptedEngine()


def make_client(engine: ScriptedEngine, **settings) -> TestClient:
    app = build_app(FrontSettings(**settings), engine, ChatRenderer(TemplateTokenizer()))
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture()
def client(engine):
    with make_client(engine) as test_client:
        yield test_client
