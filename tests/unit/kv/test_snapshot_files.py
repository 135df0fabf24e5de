"""Which writer's snapshot a file of the shared folder belongs to, read from its name alone."""

from __future__ import annotations

import tempfile

import pytest

from tests.unit.kv.test_snapshot import ADAPTERS, BIG, IDENTITY, filled_cache
from warmup_tools.kv.snapshot import write_snapshot
from warmup_tools.kv.snapshot_files import snapshot_name, snapshot_of


def test_every_file_a_writer_leaves_names_its_snapshot(tmp_path):
    blocks = filled_cache().snapshot_blocks(BIG)
    for name in ("lora_adapter_0_0_r1", "lora_adapter_0_1_r1", "lora_adapter_0_0_r1.b"):
        for count in (2, 4, len(blocks)):  # rewrites: the manifest, the payload and the previous payload
            write_snapshot(tmp_path, name, IDENTITY, ADAPTERS, blocks[:count], created=float(count))
    assert len(list(tmp_path.iterdir())) == 9
    owners = {p.name: snapshot_of(p.name) for p in tmp_path.iterdir()}
    assert sorted(set(owners.values())) == ["lora_adapter_0_0_r1", "lora_adapter_0_0_r1.b", "lora_adapter_0_1_r1"]
    assert all(file.startswith(f"{name}.") for file, name in owners.items())


def test_a_temporary_file_of_a_write_in_progress_names_its_snapshot(tmp_path):
    # NOTE: the name write_atomic's temporary file gets (tempfile.mkstemp with its prefix and suffix).
    for target in ("x_r1.manifest.json", "x_r1.0123456789abcdef.safetensors"):
        _, tmp = tempfile.mkstemp(dir=tmp_path, prefix=f".{target}.", suffix=".tmp")
        assert snapshot_of(tmp.rsplit("/", 1)[1]) == "x_r1"


@pytest.mark.parametrize("file", ["README.txt", "x_r1.safetensors", "x_r1.0123.safetensors", ".manifest.json",
                                  "x_r1.manifest.json.bak", ".lock", "x_r1.tmp", "model.safetensors"])
def test_a_file_no_snapshot_writer_names_so_belongs_to_none(file):
    assert snapshot_of(file) is None


def test_a_snapshot_name_ends_with_its_replica_name():
    assert snapshot_name("lora_adapter_0_0", "r1") == "lora_adapter_0_0_r1"
    assert snapshot_name("lora_adapter_0_0", "pod-7.example") == "lora_adapter_0_0_pod-7.example"
