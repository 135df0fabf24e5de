"""How a KV block is stored: full precision, or INT8 with per-channel scales."""

from __future__ import annotations

from typing import Callable, Mapping, Protocol

import torch


class KVCodec(Protocol):
    """How a block's KV tensor ``[layers, 2, kv_heads, block_size, head_dim]`` is stored."""

    def encode(self, block: torch.Tensor) -> tuple[object, int]: ...

    def decode(self, payload: object, dtype: torch.dtype) -> torch.Tensor: ...


class FullPrecisionCodec:
    """Stores the tensor as computed (the model's dtype, on the model's device)."""

    def encode(self, block: torch.Tensor) -> tuple[object, int]:
        stored = block.detach().clone()
        return stored, stored.numel() * stored.element_size()

    def decode(self, payload: object, dtype: torch.dtype) -> torch.Tensor:
        assert isinstance(payload, torch.Tensor)
        return payload.to(dtype)


class Int8ChannelCodec:
    """INT8 with one scale per channel: per (layer, k/v, head, head_dim) over the block's tokens.

    Keys have outlier channels (KIVI quantises keys per channel for that reason); scaling each channel
    on its own keeps those outliers from flattening every other channel to zero.
    """

    def encode(self, block: torch.Tensor) -> tuple[object, int]:
        x = block.detach().float()
        scale = x.abs().amax(dim=3, keepdim=True).clamp_min(1e-8) / 127.0
        q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
        scale = scale.to(torch.float16)
        return (q, scale), q.numel() + scale.numel() * scale.element_size()

    def decode(self, payload: object, dtype: torch.dtype) -> torch.Tensor:
        q, scale = payload  # type: ignore[misc]
        return (q.float() * scale.float()).to(dtype)


STORAGE_CODECS: Mapping[str, Callable[[], KVCodec]] = {"fp": FullPrecisionCodec, "int8": Int8ChannelCodec}
