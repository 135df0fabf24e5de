"""Which torch device and dtype an instance runs on (the ``device`` and ``dtype`` parameters)."""

from __future__ import annotations

import torch

from warmup_tools.common.errors import AssetError


def select_device(spec: str) -> torch.device:
    """``auto`` picks the first CUDA device when there is one, else the CPU."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def select_dtype(spec: str, device: torch.device) -> torch.dtype:
    """``auto`` is bfloat16 on a GPU and float32 on the CPU (where bf16 matmuls are slow)."""
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[spec]
    except KeyError:
        raise AssetError(f"dtype {spec!r} is not supported; use auto, float32, float16 or bfloat16") from None
