"""Messages to one prompt with the LM tokenizer's own chat template, rendered as transformers'
``apply_chat_template`` renders it (:class:`warmup_tools.common.tokenizer.FolderTokenizer`: no transformers).

Rendering with the model's template, never a format of the front's own, is what makes one application's
system prompt the same token prefix on every request, so it lands in the KV prefix cache once and the
planner sees chat traffic as the prompts the model really got. The role spans (which characters of the
prompt each message became) go to the request log beside the prompt.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Sequence

LOGGER = logging.getLogger(__name__)

#: Messages whose spans are recorded one by one; the rest of a longer conversation is one last span.
MAX_SPANS = 32
#: OpenAI's ``developer`` role is rendered as ``system`` (the templates of open models know only that).
_ROLE_NAMES = {"developer": "system"}


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (the template refused it, or the tokenizer has no template)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RenderedChat:
    prompt: str
    #: ``((role, start, end), ...)``: characters of ``prompt`` each message became, in order.
    roles: tuple[tuple[str, int, int], ...]


class ChatRenderer:
    """Renders conversations with one tokenizer's chat template (loaded once, at start)."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError("the LM tokenizer has no chat template: give it one (tokenizer_config.json or "
                                    "chat_template.jinja), or send raw prompts to /v1/completions")
        self._tokenizer = tokenizer
        # NOTE: the first render compiles the template; done here so that no request pays for it.
        self._apply([{"role": "user", "content": "warm-up"}], add_generation_prompt=True)

    @classmethod
    def from_path(cls, path: Path) -> "ChatRenderer":
        from warmup_tools.common.tokenizer import load_tokenizer

        return cls(load_tokenizer(path))

    def render(self, messages: Sequence[tuple[str, str]]) -> RenderedChat:
        """``messages`` as ``(role, text)`` pairs; the prompt ends with the template's generation prompt."""
        conversation = [{"role": _ROLE_NAMES.get(role, role), "content": text} for role, text in messages]
        prompt = self._apply(conversation, add_generation_prompt=True)
        return RenderedChat(prompt, self._spans(conversation, prompt))

    def _apply(self, conversation: list[dict[str, str]], *, add_generation_prompt: bool) -> str:
        try:
            rendered = self._tokenizer.apply_chat_template(conversation, tokenize=False,
                                                           add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 (a template raises what it likes: raise_exception, TypeError)
            raise ChatTemplateError(f"the model's chat template refused the conversation: {exc}") from None
        if not isinstance(rendered, str):
            raise ChatTemplateError("the model's chat template did not render text")
        return rendered

    def _spans(self, conversation: list[dict[str, str]], prompt: str) -> tuple[tuple[str, int, int], ...]:
        """Each message's span, from the renders of the conversation's prefixes (a template that does not
        render a prefix as a prefix of the whole gets no spans: the log then has the prompt alone)."""
        spans: list[tuple[str, int, int]] = []
        start = 0
        for count, message in enumerate(conversation[:MAX_SPANS], start=1):
            end = len(self._apply(conversation[:count], add_generation_prompt=False)) if count < len(
                conversation) else None
            if end is None:
                end = len(prompt)
            if end < start or end > len(prompt):
                return ()
            spans.append((message["role"], start, end))
            start = end
        if len(conversation) > MAX_SPANS and start < len(prompt):
            spans.append(("rest", start, len(prompt)))
        return tuple(spans)
