"""Which torch device and dtype an instance runs on (the ``device`` and ``dtype`` parameters)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import torch

from warmup_tools.common.errors import AssetError

LOGGER = logging.getLogger(__name__)

#: glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


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


def reuse_freed_memory(mib: int) -> bool:
    """Keep up to ``mib`` MiB of freed memory in the process for reuse (the ``reuse_freed_mib`` parameter): glibc
    serves buffers up to that size from its heap instead of a fresh ``mmap`` each, and trims the heap only above it.

    A forward allocates the same large buffers at every step (a 528-token prefill of the demo LM: tens of MB); with
    glibc's defaults many of them are mapped anew and page-faulted page by page (6,000 to 11,000 minor faults and
    about 10 ms of system time per prefill on a 2-core EPYC), which vLLM's CPU docs avoid with tcmalloc. Returns
    whether the settings took (False on a C library without ``mallopt``, or ``mib`` 0: nothing changed)."""
    if mib <= 0:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        LOGGER.info("reuse_freed_mib: this C library has no mallopt; its allocator is left as it is")
        return False
    size = mib << 20
    return bool(mallopt(_M_MMAP_THRESHOLD, size)) and bool(mallopt(_M_TRIM_THRESHOLD, size))
