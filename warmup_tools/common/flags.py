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
import os
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
        action = group.add_argument(file_flag(cls), type=Path, metavar="JSON",
                                    help=f"JSON file of {cls.__name__} fields, below the environment and the flags")
        action.derived_from = f"{cls.__name__} (its file)"  # type: ignore[attr-defined]
    _add_fields(group, cls, only=only, exclude=exclude, aliases=aliases or {}, env=True)


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """A flag for each field of a command's options class (:mod:`.options`): no file, no variable; a field
    without a default is a required flag."""
    _add_fields(parser, cls, only=None, exclude=(), aliases={}, env=False)


def _add_fields(group: Any, cls: type, *, only: Iterable[str] | None, exclude: Iterable[str],
                aliases: Mapping[str, str], env: bool) -> None:
    rows = {row.parameter: row for row in parameter_rows(cls)}
    hints = typing.get_type_hints(cls)
    wanted = None if only is None else set(only)
    for field in dataclasses.fields(cls):
        spec = spec_of(field)
        if spec is None or field.name in exclude or (wanted is not None and field.name not in wanted):
            continue
        row = rows[field.name]
        facts = [f"default {row.default}" if row.default != "required" else "required"] \
            + ([row.bound] if row.bound and not spec.choices else []) + ([env_name(cls, field.name)] if env else [])
        names = [flag_of(field.name, spec)] + ([aliases[field.name]] if field.name in aliases else [])
        _add(group, names, field.name, hints[field.name], spec, f"{spec.doc} ({'; '.join(facts)})",
             origin=f"{cls.__name__}.{field.name}", required=not env and field.default is dataclasses.MISSING)


def settings_from_args(cls: type, args: argparse.Namespace, *, known: Mapping[str, Any] | None = None,
                       env: Mapping[str, str] | None = None, only: Iterable[str] | None = None) -> Any:
    """``cls`` from its defaults, its file flag, the environment, ``known`` (what the command knows: the
    server's addresses), then the flags of :func:`add_settings` that were given. With ``only`` (the fields a
    command took as flags, without the file's), the environment is read for those fields alone."""
    flags = {**(known or {})}
    wanted = None if only is None else set(only)
    for field in dataclasses.fields(cls):
        spec = spec_of(field)
        dest = _dest(flag_of(field.name, spec)) if spec is not None else ""
        if wanted is not None and field.name not in wanted:
            continue
        if spec is not None and getattr(args, dest, None) is not None:
            flags[field.name] = getattr(args, dest)
    if wanted is None:
        return load_settings(cls, getattr(args, _dest(file_flag(cls)), None), flags, env=env)
    env = os.environ if env is None else env
    names = {env_name(cls, name) for name in wanted}
    return load_settings(cls, None, flags, env={k: v for k, v in env.items() if k in names})


def options_from_args(cls: type, args: argparse.Namespace) -> Any:
    """A command's options (:func:`add_options`): the class's defaults, then the flags that were given."""
    flags = {field.name: getattr(args, _dest(flag_of(field.name, spec)), None)
             for field in dataclasses.fields(cls) if (spec := spec_of(field)) is not None}
    return load_settings(cls, None, flags, env={})


def add_arguments(parser: argparse.ArgumentParser, func: Callable[..., Any]) -> None:
    """A flag for each keyword parameter of ``func`` annotated ``Annotated[type, arg(doc)]``."""
    for name, kind, spec, default in _annotated(func):
        shown = "none" if default is None else ",".join(map(str, default)) if isinstance(default, tuple) else default
        _add(parser, [flag_of(name, spec)], name, kind, spec, f"{spec.doc} (default {shown})", dest=name,
             origin=f"{getattr(func, '__qualname__', func)}({name})")


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


def _add(group: Any, names: list[str], name: str, kind: Any, spec: Spec, help_text: str, dest: str = "", *,
         origin: str, required: bool = False) -> None:
    """One flag; its action records the field or parameter it is derived from (``derived_from``): the tests tell
    a hand-written flag by its absence."""
    dest = dest or _dest(names[0])
    base = _base(kind)
    if base is bool:
        action = group.add_argument(*names, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                                    required=required, help=help_text.replace("%", "%%"))
    else:
        parse = spec.parse or (_repeated(kind) if spec.repeat else _sequence(kind) if base in (tuple, Sequence)
                               else _typed(name, kind))
        metavar = "{" + ",".join(spec.choices) + "}" if spec.choices else _METAVARS.get(base, "VALUE")
        action = group.add_argument(*names, dest=dest, type=reported(parse), choices=spec.choices or None,
                                    default=None, metavar=metavar, required=required,
                                    action="extend" if spec.repeat else "store", help=help_text.replace("%", "%%"))
    action.derived_from = origin  # type: ignore[attr-defined]


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


def _repeated(kind: Any) -> Callable[[str], Any]:
    """One item of a list whose flag is given once per item (its text whole: a prompt may hold commas)."""
    item = (typing.get_args(_optional(kind)) or (str,))[0]
    return lambda text: (item(text),)


def reported(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` whose ValueError or ConfigError argparse reports with its own message."""
    def typed(text: str) -> Any:
        try:
            return parse(text)
        except (ValueError, ConfigError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    typed.__name__ = getattr(parse, "__name__", "value")
    return typed
