"""Reading one request's input tensors, independent of Triton: strings and scalars, checked.

model.py files collect the input tensors of one request into a ``{name: numpy array or None}`` mapping
(:func:`warmup_tools.triton.io.collect_inputs`) and call a parser. Every problem raises an
:class:`~warmup_tools.common.errors.InvalidInputError` whose message tells the user what to change; the
model answers that request with the error and goes on.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from warmup_tools.common.errors import InvalidInputError

Inputs = Mapping[str, "np.ndarray | None"]


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


def parse_scalar(inputs: Inputs, name: str, cast: type, default: object) -> object:
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
