"""Settings objects: every knob defined once, as a dataclass field with its parameter name, bound and doc.

Each model's settings (``tokenizer_cache``, ``embedding_cache``, ``lora_adapter``) and the sidecar's are frozen
dataclasses whose fields are declared with :func:`setting`. From that one declaration:

* :func:`read_settings` builds the object from a model's ``config.pbtxt`` parameters (an absent or empty
  parameter means the field's default; the cast follows the field's type);
* :func:`check_settings` (called by each class's ``__post_init__``) refuses a value outside the field's bound,
  naming the parameter, however the object was built (parameters, a JSON file, code);
* :func:`parameter_rows` lists every parameter with its type, default, bound and doc: ``docs/parameters.md``
  is generated from it (``python -m warmup_tools parameters``), and a test keeps the two equal;
* :func:`load_settings` builds a process's settings (the sidecar's, the front's, the fleet's, the server's) from
  its defaults, a JSON file, the environment and the command line's flags, in that order of precedence; the
  command line derives each flag, its type, choices and help from the same fields (``warmup_tools.common.flags``).

The environment variable of a process's setting is ``WARMUP_<SECTION>_<FIELD>``: the class's ``section``
(``FRONT``, ``FLEET``, ``SIDECAR``) and the field's name, upper case (:func:`env_name`). The server's settings
and the plan history have no section (``WARMUP_CONTROL_DIR``, ``WARMUP_PLAN_HISTORY_KEEP``): their names are
the ones the models' ``config.pbtxt`` files read.

Engines, schedulers and services take these objects and keep no defaults of their own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence, TypeVar

from warmup_tools.common.errors import ConfigError

_SPEC = "warmup_setting"
C = TypeVar("C")


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
    #: The command-line flag, without its dashes, when it is not the field's name (``front-port``).
    flag: str = ""
    #: Turns a flag's text into the value, for a value that is not spelled like its type (``30m``).
    parse: Callable[[str], Any] | None = None
    #: A list's flag may be given more than once (``--instance a --instance b``), each adding to the list.
    repeat: bool = False

    def bound(self) -> str:
        """The bound in words: ``>= 1``, ``> 0 and <= 1``, ``one of fp, int8``; "" without one."""
        if self.choices:
            return "one of " + ", ".join(self.choices)
        parts = [f"{op} {_number(v)}" for op, v in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
                 if v is not None]
        return " and ".join(parts)

    def violated(self, value: Any) -> bool:
        if self.choices:
            return value is not None and value not in self.choices  # None: an optional field left unset
        if value is None or not isinstance(value, (int, float)):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return True
        return ((self.ge is not None and not value >= self.ge) or (self.gt is not None and not value > self.gt)
                or (self.le is not None and not value <= self.le) or (self.lt is not None and not value < self.lt))


def setting(default: Any = dataclasses.MISSING, doc: str = "", *, parameter: str | None = None,
            ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
            choices: Sequence[str] = (), load: Callable[[Any], Any] | None = None, kind: str = "",
            flag: str = "", parse: Callable[[str], Any] | None = None, repeat: bool = False) -> Any:
    """A settings field: its default (none: required), doc, parameter name (default: the field's name; ""
    for a field that is not a parameter), bound (``ge``/``gt``/``le``/``lt`` or ``choices``), and its flag
    when that is not the field's name (``parse``: how the flag's text becomes the value; ``repeat``: a list's
    flag given once per item)."""
    if not doc:
        raise ValueError("every setting has a doc")
    spec = Spec(doc, "\0" if parameter is None else parameter, ge, gt, le, lt, tuple(choices), load, kind, flag,
                parse, repeat)
    return dataclasses.field(default=default, metadata={_SPEC: spec})


def arg(doc: str, *, flag: str = "", choices: Sequence[str] = (), ge: float | None = None,
        parse: Callable[[str], Any] | None = None) -> Spec:
    """What a function's keyword parameter says about itself, as ``Annotated[int, arg("doc")]``: the command
    line makes a flag of it (a benchmark's ``run()``), named after the parameter unless ``flag`` says, with
    the parameter's default as its default."""
    if not doc:
        raise ValueError("every argument has a doc")
    return Spec(doc, "", ge, None, None, None, tuple(choices), None, "", flag, parse)


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


# ---------------------------------------------------------------------------------------------- loading
ENV_PREFIX = "WARMUP_"


def env_name(cls: type, field: str) -> str:
    """The environment variable of ``cls``'s ``field``: ``WARMUP_<SECTION>_<FIELD>`` (no section:
    ``WARMUP_<FIELD>``)."""
    section = getattr(cls, "section", "")
    return ENV_PREFIX + (f"{section}_" if section else "") + field.upper()


def load_settings(cls: type[C], file: Path | None = None, flags: Mapping[str, Any] | None = None,
                  env: Mapping[str, str] | None = None) -> C:
    """``cls`` from its defaults, then the JSON object in ``file``, then the environment (``env``, default
    ``os.environ``; :func:`env_name`), then the non-None ``flags``. A key of the file or a flag ``cls`` does
    not have, and a value of the wrong type, are a :class:`ConfigError` that names it."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    values: dict[str, Any] = {}
    if file is not None:
        values.update(_read_file(file, fields))
    env = os.environ if env is None else env
    values.update({name: env[env_name(cls, name)] for name in fields if env_name(cls, name) in env})
    for name, value in (flags or {}).items():
        if name not in fields:
            raise ConfigError(f"unknown setting {name}")
        if value is not None:
            values[name] = value
    hints = typing.get_type_hints(cls)
    return cls(**{name: coerce(name, hints[name], value) for name, value in values.items()})


def _read_file(file: Path, fields: Mapping[str, dataclasses.Field]) -> dict[str, Any]:
    try:
        data = json.loads(Path(file).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read config file {file}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {file} must hold a JSON object")
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"config file {file}: unknown key(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    return data


def coerce(name: str, kind: Any, value: Any) -> Any:
    """``value`` (a flag's or a JSON file's value, or the text of a variable) as the type ``kind``; an empty
    text is None where ``kind`` allows it. ConfigError, naming ``name``, when it is not of that type."""
    base, optional = _unwrap(kind)
    if value is None or (value == "" and base is not str):
        if optional:
            return None
        raise ConfigError(f"{name} must be set")
    try:
        if isinstance(value, str) and base is not str:
            value = _CASTS.get(base, base)(value)
        elif base is Path and isinstance(value, str) or base is tuple and isinstance(value, list):
            value = base(value)
        elif base is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}={value!r}: {exc}") from None
    if not isinstance(value, base) or (base in (int, float) and isinstance(value, bool)):
        raise ConfigError(f"{name} must be {_TYPE_WORDS.get(base, base.__name__)}, not {value!r}")
    return value


_TYPE_WORDS = {int: "an integer", float: "a number", str: "a text", bool: "true or false", Path: "a path",
               tuple: "a list of names"}


def parse_duration(text: str) -> float:
    """``90s``, ``30m``, ``6h`` or ``2d`` (or plain seconds) as seconds; ValueError for anything else."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        value = float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{text!r} is not a duration such as 30m, 6h or 2d")
    return value


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
