"""The instance's device, dtype and host allocator settings (``warmup_tools.lora_adapter.devices``)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch

from warmup_tools.common.errors import ConfigError
from warmup_tools.lora_adapter.devices import reuse_freed_memory, select_dtype
from warmup_tools.lora_adapter.settings import EngineConfig

#: A fresh process fills and frees ten buffers of 40 MiB (above glibc's largest dynamic mmap threshold, 32 MiB:
#: with its defaults every one is mapped anew) after twelve that grow its heap (glibc places an aligned buffer past a
#: freed one a few bytes too small for a while), and prints its minor page faults.
_FAULTS = """
import resource, sys, torch
from warmup_tools.lora_adapter.devices import reuse_freed_memory
print(reuse_freed_memory(int(sys.argv[1])))
for i in range(22):
    if i == 12:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = torch.ones(10 << 20)
    del buffer
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mib: int) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", _FAULTS, str(mib)], capture_output=True, text=True, check=True,
                         timeout=300).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_reused_freed_memory_is_not_page_faulted_again():
    """With ``reuse_freed_mib`` a freed buffer's pages are reused by the next buffer of its size instead of being
    mapped and faulted in anew (a forward allocates the same buffers at every step); 0 leaves glibc's defaults."""
    pages = (40 << 20) // 4096
    took, faults = _faults(256)
    kept, default_faults = _faults(0)
    assert took and not kept
    assert default_faults >= 9 * pages  # every buffer faulted in
    assert faults < 2 * pages  # not ten buffers' pages


def test_reuse_freed_mib_is_a_bounded_setting_of_the_engine(tmp_path):
    assert EngineConfig(base_model=tmp_path).reuse_freed_mib == 256
    assert reuse_freed_memory(0) is False
    with pytest.raises(ConfigError, match="reuse_freed_mib"):
        EngineConfig(base_model=tmp_path, reuse_freed_mib=-1)


def test_auto_dtype_is_float32_on_the_cpu():
    assert select_dtype("auto", torch.device("cpu")) == torch.float32
