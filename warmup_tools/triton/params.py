"""Reading a Triton model's ``config.pbtxt`` parameters inside model.py, with casts and defaults.

Every value may reference the environment (``${VAR}``, ``${VAR:-default}``), so one repository serves
several deployments (and benchmarks switch settings without editing configs).

``initialize(args)`` receives ``args["model_config"]`` as JSON; its ``parameters`` map holds
``{"name": {"string_value": "..."}}``. :class:`ModelParameters` reads them once, casts each to the
declared type, fills defaults, expands ``${ENV_VARS}`` in paths and refuses unknown keys, so a typo in a
config fails the load with a message that names the key.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping, TypeVar

from warmup_tools.common.errors import ConfigError
from warmup_tools.common.settings import read_settings

_UNSET = object()
S = TypeVar("S", bound="ModelSettings")
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def expand_path(value: str, base: Path | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """Expand ``$VAR``, ``${VAR}`` and ``${VAR:-default}``; relative results are taken relative to ``base``."""
    path = Path(expand_env(value, environ)).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    return path


def expand_env(value: str, environ: Mapping[str, str] | None = None) -> str:
    """``value`` with ``$VAR``, ``${VAR}`` and ``${VAR:-default}`` replaced from ``environ`` (the process's)."""
    env = os.environ if environ is None else environ

    def _sub(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(3)
        default = match.group(2)
        if env.get(name):
            return env[name]
        if default is not None:
            return default
        raise ValueError(f"environment variable {name} is not set (referenced by {value!r})")

    return _ENV_REF.sub(_sub, value)


class ModelParameters:
    """Typed access to a model config's ``parameters``; every key must be declared through :meth:`get`."""

    def __init__(self, model_config: Mapping[str, Any] | str, *, base_dir: Path | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        config = json.loads(model_config) if isinstance(model_config, str) else dict(model_config)
        self.model_name = str(config.get("name", "?"))
        raw = config.get("parameters") or {}
        self._raw: dict[str, str] = {k: str(v.get("string_value", "")) for k, v in raw.items()}
        self._declared: set[str] = set()
        self._base_dir = base_dir
        self._environ = environ

    def get(self, name: str, cast: Callable[[str], Any] = str, default: Any = _UNSET) -> Any:
        """The parameter ``name`` cast with ``cast``; ``default`` when absent or empty."""
        self._declared.add(name)
        try:
            value = expand_env(self._raw.get(name, ""), self._environ)
        except ValueError as exc:
            raise ConfigError(f"model '{self.model_name}': parameter '{name}': {exc}") from exc
        if value == "":
            if default is _UNSET:
                raise ConfigError(f"model '{self.model_name}': parameter '{name}' is required in config.pbtxt")
            return default
        try:
            return cast(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"model '{self.model_name}': parameter '{name}'={value!r}: {exc}") from exc

    def path(self, name: str, default: str | None = None) -> Path:
        """A path parameter (``${ENV}`` expanded), relative to the model folder."""
        value = self.get(name, str, default)
        if value is None:
            raise ConfigError(f"model '{self.model_name}': parameter '{name}' is required in config.pbtxt")
        return expand_path(value, self._base_dir, self._environ)

    def check_unknown(self) -> None:
        """Raise if the config sets a parameter nobody asked for (usually a typo)."""
        unknown = sorted(set(self._raw) - self._declared)
        if unknown:
            raise ConfigError(
                f"model '{self.model_name}': unknown parameter(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(self._declared))}"
            )


def repository_parameters(model_repository: Path, model: str,
                          environ: Mapping[str, str] | None = None) -> ModelParameters:
    """A model's ``config.pbtxt`` parameters as Triton hands them to ``initialize`` (paths relative to
    the model's folder, ``${ENV}`` expanded from this process's environment)."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    path = Path(model_repository) / model / "config.pbtxt"
    try:
        config = text_format.Parse(path.read_text(encoding="utf-8"), model_config_pb2.ModelConfig())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist; point --model-repository at a repository with {model}") from None
    except text_format.ParseError as exc:
        raise ConfigError(f"{path} does not parse: {exc}") from None
    data: dict[str, Any] = json_format.MessageToDict(config, preserving_proto_field_name=True)
    return ModelParameters(data, base_dir=path.parent, environ=environ)


class ModelSettings:
    """What each model's settings object adds to its fields: reading them from ``config.pbtxt``.

    A subclass is a frozen dataclass of :func:`~warmup_tools.common.settings.setting` fields (and nested settings
    objects) with ``MODEL`` naming its model.
    """

    __slots__ = ()
    MODEL: ClassVar[str]

    @classmethod
    def from_parameters(cls: type[S], params: ModelParameters) -> S:
        """Read and check every parameter; unknown ones are refused (a typo fails the load)."""
        settings = read_settings(cls, params)
        params.check_unknown()
        return settings

    @classmethod
    def from_repository(cls: type[S], model_repository: Path, environ: Mapping[str, str] | None = None) -> S:
        """The settings a server on ``model_repository`` (``${ENV}`` from ``environ``, default this process's)
        would run the model with."""
        return cls.from_parameters(repository_parameters(model_repository, cls.MODEL, environ))
