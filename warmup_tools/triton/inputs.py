"""Reading one request's input tensors, independent of Triton: strings and scalars, checked.

model.py files collect the input tensors of one request into a ``{name: numpy array or None}`` mapping
(:func:`warmup_tools.triton.io.collect_inputs`) and call a parser. Every problem raises an
:class:`~warmup_tools.common.errors.InvalidInputError` whose message tells the user what to change; the
model answers that request with the error and goes on.
"""

from __future__ import annotations

import re
from typing import Mapping

import numpy as np

from warmup_tools.common.errors import InvalidInputError

Inputs = Mapping[str, "np.ndarray | None"]

#: The largest prompt text any model takes, in UTF-8 bytes, checked before it is decoded. The demo LM's
#: context is 2,048 tokens (a few KiB of text); this leaves room for longer contexts and still bounds
#: what a client can make a model decode, tokenise, hash and log.
MAX_TEXT_BYTES = 256 << 10
#: The largest identity string (``tenant_id``, ``adapter_id``), in bytes: identities become cache keys,
#: metric labels and log fields, so they are short names, checked where they enter.
MAX_IDENTITY_BYTES = 64
#: The most token ids a request may carry (and a ``prompt_tokens`` count may say), checked before the
#: ids are converted; a model's context is the tighter bound, checked by the engine.
MAX_PROMPT_TOKENS = 1 << 17
IDENTITY_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_IDENTITY_RULE = (f"1 to {MAX_IDENTITY_BYTES} characters, letters, digits, '.', '_' and '-', starting with a "
                  "letter or digit")


def parse_text(inputs: Inputs, name: str = "text_input", max_bytes: int = MAX_TEXT_BYTES) -> str:
    """The single UTF-8 string in ``inputs[name]``; empty, missing, too long or invalid text is refused."""
    array = inputs.get(name)
    if array is None:
        raise InvalidInputError(f"input '{name}' is required: send the prompt as a BYTES tensor of shape [1]")
    text = _single_string(array, name, max_bytes)
    if not text.strip():
        raise InvalidInputError(f"input '{name}' is empty: send a non-empty prompt")
    return text


def parse_optional_text(inputs: Inputs, name: str = "text_input", max_bytes: int = MAX_TEXT_BYTES) -> str | None:
    """The prompt text when the request carries it (undecodable text is kept, with replacements); text
    longer than ``max_bytes`` is refused before it is decoded (:func:`check_text_size`)."""
    check_text_size(inputs, name, max_bytes)  # NOTE: also refuses anything but exactly one string
    array = inputs.get(name)
    if array is None:
        return None
    value = array.reshape(-1)[0]
    return value.decode("utf-8", errors="replace") if isinstance(value, (bytes, np.bytes_)) else str(value)


def check_text_size(inputs: Inputs, name: str = "text_input", max_bytes: int = MAX_TEXT_BYTES) -> None:
    """Refuse an optional text input that holds more than one string or a string longer than
    ``max_bytes``, without decoding it (the bound every model puts on prompt text)."""
    array = inputs.get(name)
    if array is None:
        return
    if array.size != 1:
        raise InvalidInputError(f"input '{name}' must hold exactly one string, got {array.size} elements")
    _check_length(array.reshape(-1)[0], name, max_bytes)


def parse_optional_string(inputs: Inputs, name: str, default: str = "", max_bytes: int = MAX_TEXT_BYTES) -> str:
    array = inputs.get(name)
    if array is None:
        return default
    return _single_string(array, name, max_bytes).strip() or default


def parse_identity(inputs: Inputs, name: str, default: str | None) -> str | None:
    """A tenant or adapter name: ``default`` when absent or empty, else a short name (``IDENTITY_PATTERN``)."""
    value = parse_optional_string(inputs, name, "")
    if not value:
        return default
    return check_identity(name, value)


def check_identity(name: str, value: str) -> str:
    """``value`` if it is a valid identity; else an error that states the rule (the value is not echoed)."""
    if len(value.encode("utf-8")) > MAX_IDENTITY_BYTES or not IDENTITY_PATTERN.fullmatch(value):
        raise InvalidInputError(f"input '{name}' is not a valid name: use {_IDENTITY_RULE}")
    return value


def parse_count(inputs: Inputs, name: str, default: int, maximum: int) -> int:
    """A non-negative integer count of at most ``maximum``."""
    value = parse_scalar(inputs, name, int, default)
    if not 0 <= value <= maximum:
        raise InvalidInputError(f"input '{name}'={value} is out of range: use 0 to {maximum}")
    return value


def _single_string(array: np.ndarray, name: str, max_bytes: int = MAX_TEXT_BYTES) -> str:
    if array.size != 1:
        raise InvalidInputError(f"input '{name}' must hold exactly one string, got {array.size} elements")
    value = array.reshape(-1)[0]
    _check_length(value, name, max_bytes)  # before decoding; refuses anything but str and bytes too
    # NOTE: a str (tests, in-process callers) goes through the same strict decode: a lone surrogate in it is
    # refused as its UTF-8 form (an encoded surrogate) is, not left to fail in whoever encodes it next.
    raw = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else bytes(value)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInputError(
            f"input '{name}' is not valid UTF-8 (byte {exc.start}: {exc.reason}); encode the text as UTF-8"
        ) from None


def _check_length(value: object, name: str, max_bytes: int) -> None:
    """Refuse a string element longer than ``max_bytes`` UTF-8 bytes (bytes are not decoded for it)."""
    if isinstance(value, str):
        too_long = len(value) > max_bytes or len(value.encode("utf-8", "surrogatepass")) > max_bytes
    elif isinstance(value, (bytes, np.bytes_)):
        too_long = len(value) > max_bytes
    else:
        raise InvalidInputError(f"input '{name}' must be a BYTES (string) tensor")
    if too_long:
        raise InvalidInputError(f"input '{name}' is longer than {max_bytes} bytes: send a shorter text")


def parse_scalar(inputs: Inputs, name: str, cast: type, default: object) -> object:
    array = inputs.get(name)
    if array is None:
        return default
    if array.size != 1:
        raise InvalidInputError(f"input '{name}' must hold exactly one value, got {array.size}")
    value = array.reshape(-1)[0]
    if isinstance(value, (bytes, np.bytes_, str)):
        # NOTE: Triton checks each input's data type against config.pbtxt; this keeps a caller that skips
        # that check (a test, another frontend) from turning a string into an INTERNAL error.
        raise InvalidInputError(f"input '{name}' must be a number, not a string")
    if cast is float:
        return float(value)
    if cast is bool:
        return bool(value)
    if isinstance(value, (float, np.floating)) and not float(value).is_integer():
        raise InvalidInputError(f"input '{name}' must be an integer")
    return int(value)
