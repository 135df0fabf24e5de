"""KV payloads in either array library: numpy (the simulated engine's, without torch) and torch (the real forwards')
store, load, quantise, digest and snapshot alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from warmup_tools.kv.arrays import NumpyArrays, TorchArrays, arrays_for, dtype_name
from warmup_tools.kv.hashing import CacheScope, block_hashes
from warmup_tools.kv.prefix_cache import PrefixCache
from warmup_tools.kv.snapshot import write_snapshot
from warmup_tools.kv.snapshot_verify import (
    SnapshotIdentity,
    SnapshotRejected,
    block_digest,
    kv_close,
    read_snapshot,
    salt_fingerprint,
)

BS = 4
LAYERS, HEADS, DIM = 2, 1, 3
SCOPE = CacheScope(base_fingerprint="base-1", adapter="", adapter_fingerprint="", tenant="acme")
BIG = 1 << 30
TOKENS = (list(range(1, 14)), list(range(1, 9)) + [50, 51, 52, 53])


def kv_numpy(tokens):
    t = np.asarray(tokens, dtype=np.float32) / 7.0
    return [(np.broadcast_to((t + layer).reshape(1, 1, -1, 1), (1, HEADS, len(t), DIM)).copy(),
             np.broadcast_to((-t - layer).reshape(1, 1, -1, 1), (1, HEADS, len(t), DIM)).copy())
            for layer in range(LAYERS)]


def kv_torch(tokens):
    return [(torch.from_numpy(k), torch.from_numpy(v)) for k, v in kv_numpy(tokens)]


def cache_of(library, storage="fp"):
    arrays = NumpyArrays() if library == "numpy" else TorchArrays()
    cache = PrefixCache(BIG, BS, storage=storage, live_reserve=0.0, arrays=arrays)
    make = kv_numpy if library == "numpy" else kv_torch
    for tokens in TOKENS:
        cache.store(block_hashes(tokens, BS, SCOPE), make(tokens), tenant="acme", tokens=tokens)
    return cache


def identity(storage):
    return SnapshotIdentity("base-1", "tok-1", "float32", storage, BS, (LAYERS, HEADS, DIM), salt_fingerprint(""))


def as_numpy(value):
    return value.numpy() if isinstance(value, torch.Tensor) else value


@pytest.mark.parametrize("storage", ["fp", "int8"])
def test_both_libraries_store_and_load_the_same_values_and_count_the_same_bytes(storage):
    caches = {library: cache_of(library, storage) for library in ("numpy", "torch")}
    hashes = block_hashes(TOKENS[0], BS, SCOPE)
    loaded = {}
    for library, cache in caches.items():
        match = cache.match(hashes)
        dtype = np.float32 if library == "numpy" else torch.float32
        loaded[library] = cache.load(match, dtype)
        cache.release(match)
        assert cache.stats.bytes_used == caches["numpy"].stats.bytes_used > 0
    assert isinstance(loaded["numpy"][0][0], np.ndarray) and isinstance(loaded["torch"][0][0], torch.Tensor)
    for (nk, nv), (tk, tv) in zip(loaded["numpy"], loaded["torch"], strict=True):
        assert nk.shape == (1, HEADS, 12, DIM)
        assert np.array_equal(nk, tk.numpy()) and np.array_equal(nv, tv.numpy())  # int8: the same rounding
    if storage == "fp":
        assert np.allclose(loaded["numpy"][1][0][0, 0, :, 0], np.arange(1, 13) / 7.0 + 1)


def test_a_block_digest_depends_on_dtype_shape_and_values_not_on_the_library():
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    digest = block_digest(b"h" * 32, [values])
    assert digest == block_digest(b"h" * 32, [torch.from_numpy(values)])
    assert digest != block_digest(b"h" * 32, [values.astype(np.float16)])
    assert digest != block_digest(b"h" * 32, [values.reshape(3, 2)])
    with pytest.raises(TypeError):
        arrays_for([1.0, 2.0])


@pytest.mark.parametrize("storage", ["fp", "int8"])
@pytest.mark.parametrize("writer,reader", [("numpy", "numpy"), ("torch", "numpy"), ("numpy", "torch")])
def test_a_snapshot_written_in_one_library_reads_back_in_either(tmp_path, storage, writer, reader):
    blocks = cache_of(writer, storage).snapshot_blocks(BIG)
    info = write_snapshot(tmp_path, "w", identity(storage), {}, blocks, created=1.0)
    arrays = NumpyArrays() if reader == "numpy" else TorchArrays()
    read = read_snapshot(info.manifest, identity(storage), max_payload_bytes=BIG, arrays=arrays).blocks
    assert [b.block_hash for b in read] == [b.block_hash for b in blocks]
    for got, wrote in zip(read, blocks, strict=True):
        parts = got.payload if isinstance(got.payload, tuple) else (got.payload,)
        assert all(arrays.is_array(p) for p in parts)
        wrote_parts = wrote.payload if isinstance(wrote.payload, tuple) else (wrote.payload,)
        assert all(np.array_equal(as_numpy(a), as_numpy(b)) for a, b in zip(parts, wrote_parts, strict=True))
        assert got.nbytes == wrote.nbytes


def test_a_numpy_snapshot_with_a_non_finite_value_is_refused(tmp_path):
    cache = PrefixCache(BIG, BS, live_reserve=0.0, arrays=NumpyArrays())
    kv = kv_numpy(TOKENS[0])
    kv[1][0][0, 0, 5, 1] = np.nan
    cache.store(block_hashes(TOKENS[0], BS, SCOPE), kv, tenant="acme", tokens=TOKENS[0])
    info = write_snapshot(tmp_path, "w", identity("fp"), {}, cache.snapshot_blocks(BIG), created=1.0)
    with pytest.raises(SnapshotRejected) as refused:
        read_snapshot(info.manifest, identity("fp"), max_payload_bytes=BIG, arrays=NumpyArrays())
    assert refused.value.reason == "not_finite"


def test_kv_close_and_dtype_names_take_either_library():
    ref = np.full((2, 3), 4.0, dtype=np.float32)
    assert kv_close(ref + 1e-6, ref, "fp") and kv_close(torch.from_numpy(ref + 1e-6), ref, "fp")
    assert not kv_close(ref * 1.1, torch.from_numpy(ref), "fp")
    assert [dtype_name(d) for d in (np.float32, np.dtype(np.float16), torch.bfloat16, torch.int8)] == \
        ["float32", "float16", "bfloat16", "int8"]
