"""The request models' own checks (warmup_tools/front/schemas.py): every text field is valid Unicode."""

from __future__ import annotations

import typing

import pytest

from tests.front_bad_requests import BAD_REQUESTS
from warmup_tools.front import schemas
from warmup_tools.front.schemas import UNICODE, ChatCompletionRequest, CompletionRequest

SURROGATES = [case for case in BAD_REQUESTS if case[0].startswith("lone surrogate")]
#: The field each of them names (``param``): a message's fields are under ``messages``.
PARAMS = {"a prompt": "prompt", "a prompt list": "prompt", "a message": "messages", "a content part": "messages",
          "a message name": "messages", "a stop string": "stop", "a stop list": "stop", "the model": "model",
          "user": "user"}


def _holds_str(annotation) -> bool:
    return annotation is str or any(_holds_str(arg) for arg in typing.get_args(annotation))


def test_every_text_field_of_a_request_is_checked_by_the_one_unicode_check():
    models = [value for value in vars(schemas).values()
              if isinstance(value, type) and issubclass(value, schemas._Request) and value is not schemas._Request]
    unchecked = [f"{model.__name__}.{name}" for model in models for name, field in model.model_fields.items()
                 if _holds_str(field.annotation) and UNICODE not in field.metadata]
    assert unchecked == []
    assert {"ChatMessage", "TextPart", "CompletionRequest", "ChatCompletionRequest"} <= {m.__name__ for m in models}


@pytest.mark.parametrize("name, method, path, body, status", SURROGATES, ids=[c[0] for c in SURROGATES])
def test_a_lone_surrogate_is_a_400_naming_the_field_and_not_echoing_it(client, engine, name, method, path, body,
                                                                        status):
    response = client.request(method, path, content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] is None
    assert error["param"] == PARAMS[name.removeprefix("lone surrogate in ")]
    assert "lone surrogate" in error["message"] and "UTF-8 cannot encode" in error["message"]
    assert not [c for c in error["message"] if 0xD800 <= ord(c) <= 0xDFFF]  # the value is not echoed
    assert len(error["message"]) < 250  # one line, no traceback
    assert engine.requests == []


def test_a_surrogate_pair_and_other_text_pass():
    request = CompletionRequest.model_validate({"model": "base", "prompt": "\U0001F600 é 中", "stop": ["\u00e9"]})
    assert request.prompt == "\U0001F600 é 中"
    chat = ChatCompletionRequest.model_validate({"model": "base", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "\U0001F600"}]}]})
    assert chat.messages[0].text() == "\U0001F600"
    with pytest.raises(ValueError, match="item 1"):
        CompletionRequest.model_validate({"model": "base", "prompt": "x", "stop": ["a", "\ud800"]})
