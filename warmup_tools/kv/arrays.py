"""The array library a KV cache's payloads are made of: torch tensors (the real forwards) or numpy arrays (the
simulated engine, whose processes never import torch).

A forward hands the prefix cache per-layer KV in its own library; everything the cache, its storage codecs and
KV snapshots do to a payload goes through one :class:`KVArrays` (stack a block out of a sequence's KV, join blocks
back, copy, quantise, write and read safetensors, check finiteness, compare). :class:`TorchArrays` imports torch
when it is made, so a process that makes only :class:`NumpyArrays` never loads it.

Both write the same snapshot format (safetensors, the same tensor names and dtype names) and the same block digests
(:func:`~warmup_tools.kv.snapshot_verify.block_digest`).
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

import numpy as np

#: A payload array (a ``torch.Tensor`` or a ``numpy.ndarray``, whichever :class:`KVArrays` made it).
Array = Any

#: Bytes per value of each dtype a KV payload holds, by the name snapshots record.
DTYPE_BYTES: Mapping[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}
#: The spacing of 1.0 and the next value of each floating dtype (what recomputation may differ by).
DTYPE_EPS: Mapping[str, float] = {"float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


class KVArrays(Protocol):
    """The operations on KV payloads (``[layers, 2, kv_heads, tokens, head_dim]`` blocks, per-layer
    ``[1, kv_heads, tokens, head_dim]`` keys and values) that the cache, codecs and snapshots use."""

    #: ``torch`` or ``numpy``.
    name: str

    def is_array(self, value: object) -> bool: ...

    def block(self, layers: Sequence[tuple[Array, Array]], index: int, block_size: int) -> Array:
        """Block ``index`` of a sequence's per-layer KV: ``[layers, 2, kv_heads, block_size, head_dim]``."""

    def join(self, blocks: Sequence[Array]) -> list[tuple[Array, Array]]:
        """Blocks in order back to per-layer ``(keys, values)``, each ``[1, kv_heads, tokens, head_dim]``."""

    def copy(self, value: Array) -> Array:
        """A copy that owns its memory (a block must not keep a whole sequence's KV alive)."""

    def nbytes(self, value: Array) -> int: ...

    def dtype_name(self, value: Array) -> str:
        """``float32``, ``float16``, ``bfloat16`` or ``int8``: what a snapshot records."""

    def astype(self, value: Array, dtype: object) -> Array:
        """``value`` in the engine's dtype (an object of this library)."""

    def to_device(self, value: Array, device: object) -> Array: ...

    def to_host(self, value: Array) -> Array:
        """A contiguous copy in host memory (what safetensors writes)."""

    def as_float32(self, value: Array) -> np.ndarray:
        """The values as a float32 numpy array (for comparisons and finiteness checks)."""

    def raw_bytes(self, value: Array) -> np.ndarray:
        """The host bytes of a contiguous array, as uint8 (what a block's digest hashes)."""

    def quantize_int8(self, block: Array) -> tuple[Array, Array]:
        """INT8 values and float16 scales, one per channel (the maximum over axis 3, the block's tokens)."""

    def dequantize_int8(self, q: Array, scale: Array, dtype: object) -> Array: ...

    def save(self, tensors: Mapping[str, Array], metadata: Mapping[str, str]) -> bytes:
        """A safetensors file's bytes."""

    def load(self, data: bytes) -> dict[str, Array]:
        """The tensors of a safetensors file's bytes (a header parsed and raw bytes copied; nothing executed)."""


class NumpyArrays:
    """KV payloads as numpy arrays, on the host."""

    name = "numpy"

    def is_array(self, value: object) -> bool:
        return isinstance(value, np.ndarray)

    def block(self, layers: Sequence[tuple[np.ndarray, np.ndarray]], index: int, block_size: int) -> np.ndarray:
        start, end = index * block_size, (index + 1) * block_size
        return np.stack([np.stack((k[0, :, start:end], v[0, :, start:end])) for k, v in layers])

    def join(self, blocks: Sequence[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        joined = np.concatenate(list(blocks), axis=3)
        return [(joined[i, 0][None], joined[i, 1][None]) for i in range(joined.shape[0])]

    def copy(self, value: np.ndarray) -> np.ndarray:
        return np.array(value, copy=True)

    def nbytes(self, value: np.ndarray) -> int:
        return int(value.nbytes)

    def dtype_name(self, value: np.ndarray) -> str:
        return str(value.dtype)

    def astype(self, value: np.ndarray, dtype: object) -> np.ndarray:
        return value.astype(dtype, copy=False)

    def to_device(self, value: np.ndarray, device: object) -> np.ndarray:
        return value

    def to_host(self, value: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(value)

    def as_float32(self, value: np.ndarray) -> np.ndarray:
        return np.asarray(value, dtype=np.float32)

    def raw_bytes(self, value: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(value).reshape(-1).view(np.uint8)

    def quantize_int8(self, block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = block.astype(np.float32)
        scale = np.maximum(np.abs(x).max(axis=3, keepdims=True), 1e-8) / 127.0
        q = np.clip(np.round(x / scale), -127, 127).astype(np.int8)
        return q, scale.astype(np.float16)

    def dequantize_int8(self, q: np.ndarray, scale: np.ndarray, dtype: object) -> np.ndarray:
        return (q.astype(np.float32) * scale.astype(np.float32)).astype(dtype)

    def save(self, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> bytes:
        import safetensors.numpy

        return safetensors.numpy.save(dict(tensors), metadata=dict(metadata))

    def load(self, data: bytes) -> dict[str, np.ndarray]:
        import safetensors.numpy

        return safetensors.numpy.load(data)


class TorchArrays:
    """KV payloads as torch tensors, on the forward's device; importing torch is this object's to do."""

    name = "torch"

    def __init__(self) -> None:
        import torch

        self._torch = torch

    def is_array(self, value: object) -> bool:
        return isinstance(value, self._torch.Tensor)

    def block(self, layers: Sequence[tuple[Array, Array]], index: int, block_size: int) -> Array:
        start, end = index * block_size, (index + 1) * block_size
        stack = self._torch.stack
        return stack([stack((k[0, :, start:end], v[0, :, start:end])) for k, v in layers])

    def join(self, blocks: Sequence[Array]) -> list[tuple[Array, Array]]:
        joined = self._torch.cat(list(blocks), dim=3)  # [layers, 2, heads, tokens, dim], a new tensor
        return [(joined[i, 0].unsqueeze(0), joined[i, 1].unsqueeze(0)) for i in range(joined.shape[0])]

    def copy(self, value: Array) -> Array:
        return value.detach().clone()

    def nbytes(self, value: Array) -> int:
        return int(value.numel() * value.element_size())

    def dtype_name(self, value: Array) -> str:
        return str(value.dtype).removeprefix("torch.")

    def astype(self, value: Array, dtype: object) -> Array:
        return value.to(dtype)

    def to_device(self, value: Array, device: object) -> Array:
        return value.to(device)

    def to_host(self, value: Array) -> Array:
        return value.detach().to("cpu").contiguous()

    def as_float32(self, value: Array) -> np.ndarray:
        return value.detach().float().cpu().numpy()

    def raw_bytes(self, value: Array) -> np.ndarray:
        return value.detach().cpu().contiguous().reshape(-1).view(self._torch.uint8).numpy()

    def quantize_int8(self, block: Array) -> tuple[Array, Array]:
        torch = self._torch
        x = block.detach().float()
        scale = x.abs().amax(dim=3, keepdim=True).clamp_min(1e-8) / 127.0
        q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
        return q, scale.to(torch.float16)

    def dequantize_int8(self, q: Array, scale: Array, dtype: object) -> Array:
        return (q.float() * scale.float()).to(dtype)

    def save(self, tensors: Mapping[str, Array], metadata: Mapping[str, str]) -> bytes:
        import safetensors.torch

        return safetensors.torch.save(dict(tensors), metadata=dict(metadata))

    def load(self, data: bytes) -> dict[str, Array]:
        import safetensors.torch

        return safetensors.torch.load(data)


_LIBRARIES: dict[str, KVArrays] = {}


def kv_arrays(name: str) -> KVArrays:
    """The :class:`KVArrays` of ``name`` (``torch`` or ``numpy``), one per process."""
    if name not in _LIBRARIES:
        if name not in ("torch", "numpy"):
            raise ValueError(f"unknown KV array library {name!r}; torch or numpy")
        _LIBRARIES[name] = TorchArrays() if name == "torch" else NumpyArrays()
    return _LIBRARIES[name]


def arrays_for(value: object) -> KVArrays:
    """The :class:`KVArrays` of the library ``value`` (a payload array) belongs to."""
    name = "numpy" if isinstance(value, np.ndarray) else type(value).__module__.partition(".")[0]
    if name not in ("numpy", "torch"):
        raise TypeError(f"a KV payload is a torch tensor or a numpy array, not {type(value).__name__}")
    return kv_arrays(name)


def dtype_name(dtype: object) -> str:
    """The snapshot name (``float32``...) of a torch or numpy dtype."""
    text = str(dtype)
    return text.removeprefix("torch.") if text.startswith("torch.") else str(np.dtype(dtype))  # type: ignore[call-overload]
