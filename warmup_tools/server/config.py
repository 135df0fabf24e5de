"""How a command runs tritonserver: :class:`ServeConfig`, one settings object like the others.

It is read by :func:`warmup_tools.common.settings.load_settings`: defaults, then a JSON file (``--config``),
then ``WARMUP_<FIELD>`` variables, then flags. Unknown keys in the file are an error, so a typo never silently
falls back to a default.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

from warmup_tools.common.errors import ConfigError
from warmup_tools.common.names import replica_name as check_replica_name
from warmup_tools.common.settings import check_settings, setting

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True, slots=True)
class ServeConfig:
    """How ``warmup_tools serve``, ``sidecar`` and ``demo`` run tritonserver (the keys of ``--config``'s JSON
    file; ``WARMUP_<KEY>`` variables and flags override them)."""

    #: No section: ``WARMUP_CONTROL_DIR`` and the other folders are the names the models' configs read too.
    section: ClassVar[str] = ""

    model_repository: Path = setting(REPO_ROOT / "model_repository", "The model repository tritonserver serves.")
    assets_dir: Path = setting(REPO_ROOT / ".assets", "The LM, tokenizer, adapters and embedder the models load "
                                                      "(the models' WARMUP_ASSETS_DIR).")
    control_dir: Path | None = setting(REPO_ROOT / ".control", "Folder through which operators change the adapter "
                                                               "set and the live plan (`warmup_tools adapters`, "
                                                               "`apply-plan`); empty disables it.")
    snapshot_dir: Path | None = setting(None, "Folder of lora_adapter's KV snapshots (shared by replicas); empty "
                                              "disables them.")
    replica_name: str = setting("", "This replica's name in the shared control and snapshot folders (lora_adapter's "
                                    "replica_name, the sidecar's coverage reports); empty: the host name. Replicas "
                                    "sharing a host and the folders need distinct names.")
    http_port: int = setting(8000, "tritonserver's HTTP port (0: any free port).", ge=0, le=65535)
    grpc_port: int = setting(8001, "tritonserver's gRPC port (0: any free port).", ge=0, le=65535)
    metrics_port: int = setting(8002, "tritonserver's metrics port (0: any free port).", ge=0, le=65535)
    host: str = setting("127.0.0.1", "Address tritonserver's HTTP and gRPC listen on. Only the OpenAI front and the "
                                     "sidecar beside it need them: keep the loopback, and give clients from outside "
                                     "the front, or deploy/gateway/triton-direct.conf (SECURITY.md, Ports).")
    metrics_host: str = setting("", "Address tritonserver's metrics port listens on (Prometheus scrapes it there); "
                                    "empty: host's.")
    log_verbose: int = setting(0, "tritonserver's --log-verbose level.", ge=0)
    ready_timeout_s: float = setting(600.0, "The longest wait for tritonserver to report ready.", gt=0)
    exit_timeout_s: int = setting(60, "Seconds tritonserver gets on SIGINT to unload its models (lora_adapter "
                                      "writes its KV snapshot then; a large cache on a busy machine takes more "
                                      "than Triton's 15 s) before it exits anyway.", ge=1, le=3600)
    log_file: Path | None = setting(None, "tritonserver's log file; empty: one in a temporary folder.")

    def __post_init__(self) -> None:
        check_settings(self)
        if len({self.http_port, self.grpc_port, self.metrics_port} - {0}) < 3:
            raise ConfigError("http_port, grpc_port and metrics_port must differ")
        if self.replica_name:
            check_replica_name(self.replica_name)

    def server_env(self) -> dict[str, str]:
        return {"WARMUP_ASSETS_DIR": str(Path(self.assets_dir).resolve()),
                "WARMUP_CONTROL_DIR": str(Path(self.control_dir).resolve()) if self.control_dir else "",
                "WARMUP_SNAPSHOT_DIR": str(Path(self.snapshot_dir).resolve()) if self.snapshot_dir else "",
                "WARMUP_REPLICA_NAME": self.replica_name}


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
