"""bench memory: reading a process's PSS and libraries, naming a replica's processes, the table and its verdict."""

from __future__ import annotations

import os

from warmup_tools.sim.bench.memory import ProcessMemory, process_memory, report, role_of


def test_a_replicas_processes_are_named_by_role():
    stub = ["/venv/bin/triton_python_backend_stub", "/repo/model_repository/lora_adapter/1/model.py", "/tmp/shm",
            "1048576", "lora_adapter_0_0"]
    assert role_of(stub) == "stub lora_adapter"
    assert role_of(["/opt/tritonserver/bin/tritonserver", "--model-repository=/r"]) == "tritonserver"
    assert role_of(["/venv/bin/python", "-m", "warmup_tools", "sidecar", "--replica-name", "r1"]) == "sidecar + front"
    assert role_of([]) == "?"


def test_this_process_is_read_from_proc():
    mine = process_memory(os.getpid())
    assert mine.pss_kib > 0 and mine.pid == os.getpid()
    assert process_memory(2 ** 22 + 7).pss_kib == 0  # no such process: nothing counted


def test_the_table_sums_each_engine_and_judges_the_ratio():
    real = [ProcessMemory("stub lora_adapter", 1, 400 * 1024, ("torch",)),
            ProcessMemory("tritonserver", 2, 100 * 1024, ())]
    light = [ProcessMemory("stub lora_adapter", 3, 25 * 1024, ()), ProcessMemory("tritonserver", 4, 100 * 1024, ())]
    text = report({"real": real, "simulated": light})
    assert "| stub lora_adapter | 400 (torch) | 25 |" in text and "**500** | **125**" in text
    assert text.endswith("simulated / real: 25% (goal <= 25%: met)")
    assert report({"real": real, "simulated": real}).endswith("(goal <= 25%: NOT met)")
