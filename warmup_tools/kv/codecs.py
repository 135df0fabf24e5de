"""How a KV block is stored: full precision, or INT8 with per-channel scales, in the cache's array library
(:mod:`warmup_tools.kv.arrays`)."""

from __future__ import annotations

from typing import Callable, Mapping, Protocol

from warmup_tools.kv.arrays import Array, KVArrays


class KVCodec(Protocol):
    """How a block's KV ``[layers, 2, kv_heads, block_size, head_dim]`` is stored."""

    arrays: KVArrays

    def encode(self, block: Array) -> tuple[object, int]: ...

    def decode(self, payload: object, dtype: object) -> Array: ...


class FullPrecisionCodec:
    """Stores the block as computed (the model's dtype, on the model's device)."""

    def __init__(self, arrays: KVArrays) -> None:
        self.arrays = arrays

    def encode(self, block: Array) -> tuple[object, int]:
        stored = self.arrays.copy(block)
        return stored, self.arrays.nbytes(stored)

    def decode(self, payload: object, dtype: object) -> Array:
        assert self.arrays.is_array(payload)
        return self.arrays.astype(payload, dtype)


class Int8ChannelCodec:
    """INT8 with one scale per channel: per (layer, k/v, head, head_dim) over the block's tokens.

    Keys have outlier channels (KIVI quantises keys per channel for that reason); scaling each channel
    on its own keeps those outliers from flattening every other channel to zero.
    """

    def __init__(self, arrays: KVArrays) -> None:
        self.arrays = arrays

    def encode(self, block: Array) -> tuple[object, int]:
        q, scale = self.arrays.quantize_int8(block)
        return (q, scale), self.arrays.nbytes(q) + self.arrays.nbytes(scale)

    def decode(self, payload: object, dtype: object) -> Array:
        q, scale = payload  # type: ignore[misc]
        return self.arrays.dequantize_int8(q, scale, dtype)


STORAGE_CODECS: Mapping[str, Callable[[KVArrays], KVCodec]] = {"fp": FullPrecisionCodec, "int8": Int8ChannelCodec}
