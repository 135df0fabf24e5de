"""One validated configuration object per command, fed by a file, the environment and flags.

Precedence: flags over environment (``WARMUP_<FIELD>``) over file (JSON) over defaults. Unknown keys in
the file are an error, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Mapping, TypeVar

from warmup_tools.common.errors import ConfigError
from warmup_tools.common.names import replica_name as check_replica_name

REPO_ROOT = Path(__file__).resolve().parents[2]
ENV_PREFIX = "WARMUP_"

C = TypeVar("C")


@dataclasses.dataclass(frozen=True, slots=True)
class ServeConfig:
    """How ``warmup_tools serve`` (and the demo) runs tritonserver."""

    model_repository: Path = REPO_ROOT / "model_repository"
    assets_dir: Path = REPO_ROOT / ".assets"
    #: Folder through which operators change the adapter set (``warmup_tools adapters``); empty disables it.
    control_dir: Path | None = REPO_ROOT / ".control"
    #: Folder of lora_adapter's KV snapshots (``snapshot_dir``; shared by replicas); empty disables them.
    snapshot_dir: Path | None = None
    #: This replica's name in the shared control and snapshot folders (lora_adapter's ``replica_name``, the
    #: sidecar's coverage reports); empty: the host name. Replicas sharing a host and the folders need distinct names.
    replica_name: str = ""
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    host: str = "127.0.0.1"
    log_verbose: int = 0
    ready_timeout_s: float = 600.0
    #: Seconds tritonserver gets on SIGINT to unload its models (lora_adapter writes its KV snapshot then; a
    #: large cache on a busy machine takes more than Triton's 15 s) before it exits anyway.
    exit_timeout_s: int = 60
    log_file: Path | None = None

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port", "metrics_port"):
            port = getattr(self, name)
            if not 0 <= port <= 65535:
                raise ConfigError(f"{name}={port} is not a TCP port")
        if len({self.http_port, self.grpc_port, self.metrics_port} - {0}) < 3:
            raise ConfigError("http_port, grpc_port and metrics_port must differ")
        if self.ready_timeout_s <= 0:
            raise ConfigError("ready_timeout_s must be positive")
        if not 1 <= self.exit_timeout_s <= 3600:
            raise ConfigError("exit_timeout_s must be 1 to 3600 seconds")
        if self.replica_name:
            check_replica_name(self.replica_name)

    def server_env(self) -> dict[str, str]:
        return {"WARMUP_ASSETS_DIR": str(Path(self.assets_dir).resolve()),
                "WARMUP_CONTROL_DIR": str(Path(self.control_dir).resolve()) if self.control_dir else "",
                "WARMUP_SNAPSHOT_DIR": str(Path(self.snapshot_dir).resolve()) if self.snapshot_dir else "",
                "WARMUP_REPLICA_NAME": self.replica_name}


def load_config(cls: type[C], file: Path | None = None, flags: Mapping[str, Any] | None = None,
                env: Mapping[str, str] | None = None) -> C:
    """Build ``cls`` from defaults, then ``file``, then ``WARMUP_*`` variables, then non-None ``flags``."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    if file is not None:
        try:
            data = json.loads(Path(file).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read config file {file}: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"config file {file} must hold a JSON object")
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ConfigError(f"config file {file}: unknown key(s) {', '.join(unknown)}; known: {', '.join(fields)}")
        values.update(data)
    env = os.environ if env is None else env
    for name in fields:
        key = ENV_PREFIX + name.upper()
        if key in env:
            values[name] = env[key]
    for name, value in (flags or {}).items():
        if value is not None:
            if name not in fields:
                raise ConfigError(f"unknown setting {name}")
            values[name] = value
    return cls(**{name: _cast(fields[name], value) for name, value in values.items()})


def _cast(field: dataclasses.Field, value: Any) -> Any:
    kind = str(field.type)
    try:
        if "Path" in kind:
            return None if value in (None, "") else Path(value)
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        return value
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{field.name}={value!r}: {exc}") from exc


def set_instance_count(model_dir: Path, count: int) -> None:
    """Give the model in ``model_dir`` ``count`` instances: its config.pbtxt's one ``instance_group`` count
    (instances are separate processes; a canary needs two of lora_adapter). ValueError if it has no single
    ``instance_group`` with a count."""
    import re

    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"an instance count must be a positive integer, not {count!r}")
    config = Path(model_dir) / "config.pbtxt"
    text = config.read_text(encoding="utf-8")
    new, found = re.subn(r"(instance_group\s*\[\s*\{\s*count:\s*)\d+", rf"\g<1>{count}", text)
    if found != 1:
        raise ValueError(f"{config} has {found} instance_group counts; expected exactly one")
    config.write_text(new, encoding="utf-8")
