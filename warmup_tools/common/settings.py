"""Settings objects: every knob defined once, as a dataclass field with its parameter name, bound and doc.

Each model's settings (``tokenizer_cache``, ``embedding_cache``, ``lora_adapter``) and the sidecar's are frozen
dataclasses whose fields are declared with :func:`setting`. From that one declaration:

* :func:`read_settings` builds the object from a model's ``config.pbtxt`` parameters (an absent or empty
  parameter means the field's default; the cast follows the field's type);
* :func:`check_settings` (called by each class's ``__post_init__``) refuses a value outside the field's bound,
  naming the parameter, however the object was built (parameters, a JSON file, code);
* :func:`parameter_rows` lists every parameter with its type, default, bound and doc: ``docs/parameters.md``
  is generated from it (``python -m warmup_tools parameters``), and a test keeps the two equal.

Engines, schedulers and services take these objects and keep no defaults of their own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

from warmup_tools.common.errors import ConfigError

_SPEC = "warmup_setting"


class Parameters(Protocol):
    """What :func:`read_settings` reads: :class:`warmup_tools.triton.params.ModelParameters`."""

    model_name: str

    def get(self, name: str, cast: Any = str, default: Any = ...) -> Any: ...

    def path(self, name: str, default: str | None = None) -> Path: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Spec:
    """What :func:`setting` records about one field."""

    doc: str
    #: Its name among the model's parameters; "" when the field is not a parameter (set by code only).
    parameter: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] = ()
    #: Turns the parameter's value (a path for ``Path`` fields) into the field's value (a file's content).
    load: Callable[[Any], Any] | None = None
    #: How the value is shown in the docs when it is not the default's ``repr`` ("a JSON list of texts").
    kind: str = ""

    def bound(self) -> str:
        """The bound in words: ``>= 1``, ``> 0 and <= 1``, ``one of fp, int8``; "" without one."""
        if self.choices:
            return "one of " + ", ".join(self.choices)
        parts = [f"{op} {_number(v)}" for op, v in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
                 if v is not None]
        return " and ".join(parts)

    def violated(self, value: Any) -> bool:
        if self.choices:
            return value not in self.choices
        if value is None or not isinstance(value, (int, float)):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return True
        return ((self.ge is not None and not value >= self.ge) or (self.gt is not None and not value > self.gt)
                or (self.le is not None and not value <= self.le) or (self.lt is not None and not value < self.lt))


def setting(default: Any = dataclasses.MISSING, doc: str = "", *, parameter: str | None = None,
            ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
            choices: Sequence[str] = (), load: Callable[[Any], Any] | None = None, kind: str = "") -> Any:
    """A settings field: its default (none: required), doc, parameter name (default: the field's name; ""
    for a field that is not a parameter), bound (``ge``/``gt``/``le``/``lt`` or ``choices``)."""
    if not doc:
        raise ValueError("every setting has a doc")
    spec = Spec(doc, "\0" if parameter is None else parameter, ge, gt, le, lt, tuple(choices), load, kind)
    return dataclasses.field(default=default, metadata={_SPEC: spec})


def spec_of(field: dataclasses.Field) -> Spec | None:
    return field.metadata.get(_SPEC)


def _parameter_name(field: dataclasses.Field, spec: Spec) -> str:
    return field.name if spec.parameter == "\0" else spec.parameter


def is_settings(cls: Any) -> bool:
    """Whether ``cls`` is a settings dataclass (every field declared with :func:`setting` or nested)."""
    return isinstance(cls, type) and dataclasses.is_dataclass(cls) and any(
        spec_of(f) is not None for f in dataclasses.fields(cls))


def check_settings(obj: Any) -> None:
    """Refuse a field outside its bound; the error names the parameter, its bound and the value."""
    for field in dataclasses.fields(obj):
        spec = spec_of(field)
        if spec is None:
            continue
        value = getattr(obj, field.name)
        if spec.violated(value):
            name = _parameter_name(field, spec) or field.name
            raise ConfigError(f"{name} must be {spec.bound()}, not {value!r}")


def read_settings(cls: type, params: Parameters) -> Any:
    """``cls`` built from ``params``: each parameter read once, cast by the field's type, defaults for absent or
    empty ones; nested settings classes are read from the same parameters. Errors name the model."""
    try:
        return cls(**_read_fields(cls, params))
    except ConfigError as exc:
        message = str(exc)
        prefix = f"model '{params.model_name}'"
        raise ConfigError(message if message.startswith(prefix) else f"{prefix}: parameter {message}") from None


def _read_fields(cls: type, params: Parameters) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        if is_settings(kind):
            values[field.name] = kind(**_read_fields(kind, params))
            continue
        spec = spec_of(field)
        if spec is None or not _parameter_name(field, spec):
            continue
        name = _parameter_name(field, spec)
        base, _ = _unwrap(kind)
        if field.default is dataclasses.MISSING:
            value = params.path(name) if base is Path else params.get(name, _CASTS[base])
        elif spec.load is not None:  # the parameter names a file; the field holds what it reads
            value = spec.load(params.path(name)) if params.get(name, str, "") else field.default
        elif base is Path:
            value = params.path(name) if params.get(name, str, "") else field.default
        else:
            value = params.get(name, _CASTS[base], field.default)
        values[field.name] = value
    return values


def _unwrap(kind: Any) -> tuple[Any, bool]:
    """``Path | None`` -> ``(Path, True)``; ``tuple[str, ...]`` -> ``(tuple, False)``."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return _unwrap(rest[0])[0], True
    return (typing.get_origin(kind) or kind), False


def parse_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"{value!r} is not a boolean (use true or false)")


def _parse_names(value: str) -> tuple[str, ...] | None:
    """A comma-separated list of names; blank entries dropped; None when nothing is listed."""
    return tuple(n.strip() for n in value.split(",") if n.strip()) or None


_CASTS: dict[Any, Callable[[str], Any]] = {int: int, float: float, str: str, bool: parse_bool, tuple: _parse_names}


# ---------------------------------------------------------------------------------------------- docs
@dataclasses.dataclass(frozen=True, slots=True)
class ParameterRow:
    parameter: str
    type: str
    #: The default as the docs show it ("required", "empty", "16", "268435456 (256 MiB)").
    default: str
    bound: str
    doc: str
    #: The default as config.pbtxt would spell it ("" for none), to tell a value that restates it.
    spelled_default: str


def parameter_rows(cls: type) -> Iterator[ParameterRow]:
    """Every parameter of ``cls`` (nested settings in place), in declaration order."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        if is_settings(kind):
            yield from parameter_rows(kind)
            continue
        spec = spec_of(field)
        if spec is None or not _parameter_name(field, spec):
            continue
        base, _ = _unwrap(kind)
        type_name = spec.kind or {tuple: "names, comma-separated", Path: "path"}.get(base, base.__name__)
        yield ParameterRow(_parameter_name(field, spec), type_name, _shown_default(field, base), spec.bound(),
                           " ".join(spec.doc.split()), _spelled_default(field))


def _shown_default(field: dataclasses.Field, base: Any) -> str:
    if field.default is dataclasses.MISSING:
        return "required"
    value = field.default
    if value is None or value == () or value == "":
        return "empty"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value} ({value >> 20} MiB)"
    return _number(value) if isinstance(value, (int, float)) else str(value)


def _spelled_default(field: dataclasses.Field) -> str:
    value = field.default
    if value is dataclasses.MISSING or value is None or value == ():
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(value)
    return _number(value) if isinstance(value, (int, float)) else str(value)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else repr(value)


def markdown_table(rows: Sequence[ParameterRow], shipped: Mapping[str, str] | None = None) -> str:
    """The rows as a Markdown table; with ``shipped``, a last column of the values a shipped config gives them."""
    head = ["parameter", "type", "default", "bound", "what it does"]
    head += ["shipped config"] if shipped is not None else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [f"`{row.parameter}`", row.type, row.default, row.bound, row.doc]
        if shipped is not None:
            value = shipped.get(row.parameter)
            cells.append("not set" if value is None else f"`{value}`" if value else "empty")
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def environ_overrides(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` set in this process's environment for the block (the settings of the processes it starts,
    which inherit them); each variable's previous value, or its absence, is put back after."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
