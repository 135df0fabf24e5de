"""Flags derived from what a command takes, as vLLM derives its arguments from its config dataclasses.

A command names the settings classes it reads (:func:`add_settings`) and the function it calls
(:func:`add_arguments`); each field or annotated keyword parameter becomes one flag:

* its name: the field's (``--probe-interval-s``), or the ``flag`` its declaration gives (``--front-port``);
* its type, choices and ``--x/--no-x`` for a boolean: from the field's type and bound;
* its help: the doc, the bound and the default, and for a setting its ``WARMUP_*`` variable;
* its default: None, always, so that the settings class (or the function's signature) owns the default and
  a flag given overrides the file and the environment only when it is given.

:func:`settings_from_args` then builds the settings with :func:`warmup_tools.common.settings.load_settings`:
defaults, the class's file flag (``--front-config``), the environment, what the command knows, the flags.
"""

from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import inspect
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from warmup_tools.common.errors import ConfigError
from warmup_tools.common.settings import Spec, coerce, env_name, load_settings, parameter_rows, spec_of


def file_flag(cls: type) -> str:
    """The flag naming a JSON file of ``cls``'s fields: ``--config``, ``--front-config``, ``--sidecar-config``."""
    section = getattr(cls, "section", "")
    return f"--{section.lower()}-config" if section else "--config"


def flag_of(name: str, spec: Spec) -> str:
    return "--" + (spec.flag or name.replace("_", "-"))


def add_settings(parser: argparse.ArgumentParser, cls: type, *, only: Iterable[str] | None = None,
                 exclude: Iterable[str] = (), aliases: Mapping[str, str] | None = None, file: bool = True) -> None:
    """A flag for each field of ``cls`` (``only`` those, less ``exclude``), and with ``file`` its JSON file's."""
    group = parser.add_argument_group(f"{cls.__name__} (docs/parameters.md)")
    if file:
        group.add_argument(file_flag(cls), type=Path, metavar="JSON",
                           help=f"JSON file of {cls.__name__} fields, below the environment and the flags")
    rows = {row.parameter: row for row in parameter_rows(cls)}
    hints = typing.get_type_hints(cls)
    wanted = None if only is None else set(only)
    for field in dataclasses.fields(cls):
        spec = spec_of(field)
        if spec is None or field.name in exclude or (wanted is not None and field.name not in wanted):
            continue
        row = rows[field.name]
        facts = [f"default {row.default}"] + ([row.bound] if row.bound and not spec.choices else [])
        help_text = f"{spec.doc} ({'; '.join(facts)}; {env_name(cls, field.name)})"
        names = [flag_of(field.name, spec)] + ([(aliases or {})[field.name]] if field.name in (aliases or {}) else [])
        _add(group, names, field.name, hints[field.name], spec, help_text)


def settings_from_args(cls: type, args: argparse.Namespace, *, known: Mapping[str, Any] | None = None,
                       env: Mapping[str, str] | None = None) -> Any:
    """``cls`` from its defaults, its file flag, the environment, ``known`` (what the command knows: the
    server's addresses), then the flags of :func:`add_settings` that were given."""
    flags = {**(known or {})}
    for field in dataclasses.fields(cls):
        spec = spec_of(field)
        dest = _dest(flag_of(field.name, spec)) if spec is not None else ""
        if spec is not None and getattr(args, dest, None) is not None:
            flags[field.name] = getattr(args, dest)
    return load_settings(cls, getattr(args, _dest(file_flag(cls)), None), flags, env=env)


def add_arguments(parser: argparse.ArgumentParser, func: Callable[..., Any]) -> None:
    """A flag for each keyword parameter of ``func`` annotated ``Annotated[type, arg(doc)]``."""
    for name, kind, spec, default in _annotated(func):
        shown = "none" if default is None else ",".join(map(str, default)) if isinstance(default, tuple) else default
        _add(parser, [flag_of(name, spec)], name, kind, spec, f"{spec.doc} (default {shown})", dest=name)


def function_kwargs(func: Callable[..., Any], args: argparse.Namespace) -> dict[str, Any]:
    """The flags of :func:`add_arguments` that were given, as ``func``'s keyword arguments."""
    return {name: getattr(args, name) for name, *_ in _annotated(func) if getattr(args, name, None) is not None}


def _annotated(func: Callable[..., Any]) -> list[tuple[str, Any, Spec, Any]]:
    hints = typing.get_type_hints(func, include_extras=True)
    found = []
    for name, param in inspect.signature(func).parameters.items():
        kind = hints.get(name)
        specs = [m for m in getattr(kind, "__metadata__", ()) if isinstance(m, Spec)]
        if specs:
            found.append((name, typing.get_args(kind)[0], specs[0], param.default))
    return found


def _add(group: Any, names: list[str], name: str, kind: Any, spec: Spec, help_text: str, dest: str = "") -> None:
    dest = dest or _dest(names[0])
    base = _base(kind)
    if base is bool:
        group.add_argument(*names, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                           help=help_text.replace("%", "%%"))
        return
    parse = spec.parse or (_sequence(kind) if base in (tuple, Sequence) else _typed(name, kind))
    metavar = "{" + ",".join(spec.choices) + "}" if spec.choices else _METAVARS.get(base, "VALUE")
    group.add_argument(*names, dest=dest, type=reported(parse), choices=spec.choices or None, default=None,
                       metavar=metavar, help=help_text.replace("%", "%%"))


_METAVARS = {int: "N", float: "X", str: "TEXT", Path: "PATH", tuple: "A,B", Sequence: "A,B"}


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


_UNIONS = (typing.Union, types.UnionType)


def _optional(kind: Any) -> Any:
    """``int | None`` -> ``int``."""
    while typing.get_origin(kind) in _UNIONS:
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    return kind


def _base(kind: Any) -> Any:
    origin = typing.get_origin(_optional(kind)) or _optional(kind)
    return Sequence if origin in (Sequence, collections.abc.Sequence) else origin


def _typed(name: str, kind: Any) -> Callable[[str], Any]:
    """The flag's text as ``kind``; an empty text stays "" (given: the loader makes it None or refuses it)."""
    return lambda text: coerce(name, kind, text) if text else text


def _sequence(kind: Any) -> Callable[[str], Any]:
    """``1,4,8`` as a tuple of the sequence's item type (names for a tuple of texts)."""
    item = (typing.get_args(_optional(kind)) or (str,))[0]
    return lambda text: tuple(item(part.strip()) for part in text.split(",") if part.strip())


def reported(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` whose ValueError or ConfigError argparse reports with its own message."""
    def typed(text: str) -> Any:
        try:
            return parse(text)
        except (ValueError, ConfigError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    typed.__name__ = getattr(parse, "__name__", "value")
    return typed
