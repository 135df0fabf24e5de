"""The warm-up plan the repository's ``lora_adapter`` stanzas come from, read from their data files."""

from __future__ import annotations

import struct
from pathlib import Path

from warmup_tools.triton.tensors import deserialize_tensor


def discover_plan_id(model_repository: Path, model: str = "lora_adapter") -> str | None:
    """The plan id the model's ``warmup_plan`` sample inputs carry (one file read), or None.

    Cheap on purpose: ``/status`` shows which plan the warm-up that the last (re)load ran came from.
    """
    for path in sorted((Path(model_repository) / model / "warmup").glob("*__warmup_plan")):
        try:
            value = deserialize_tensor(path.read_bytes(), "TYPE_STRING", [1]).reshape(-1)[0]
        except (OSError, ValueError, struct.error):
            continue
        return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return None
