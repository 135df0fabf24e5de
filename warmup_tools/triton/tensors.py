"""The byte layout of Triton's warm-up data files (``input_data_file`` of a ``model_warmup`` sample).

Numbers are little-endian raw arrays; strings (``TYPE_STRING``) are each a 4-byte little-endian length
followed by the bytes. :mod:`warmup_tools.planning.stanzas` writes these files and
:mod:`warmup_tools.triton.warmup` reads them back to recognise a model's own warm-up requests.
"""

from __future__ import annotations

import struct
from typing import Sequence

import numpy as np

from warmup_tools.common.errors import ConfigError

_NUMPY_TYPES = {
    "TYPE_BOOL": np.bool_, "TYPE_INT8": np.int8, "TYPE_INT16": np.int16, "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64, "TYPE_UINT8": np.uint8, "TYPE_UINT16": np.uint16, "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64, "TYPE_FP16": np.float16, "TYPE_FP32": np.float32, "TYPE_FP64": np.float64,
}

def serialize_tensor(array: np.ndarray, data_type: str) -> bytes:
    """Raw bytes of a warm-up input file, as Triton reads them."""
    if data_type == "TYPE_STRING":
        out = bytearray()
        for item in array.reshape(-1):
            raw = item.encode("utf-8") if isinstance(item, str) else bytes(item)
            out += struct.pack("<I", len(raw)) + raw
        return bytes(out)
    try:
        dtype = _NUMPY_TYPES[data_type]
    except KeyError:
        raise ConfigError(f"unsupported warm-up data type {data_type}") from None
    return np.ascontiguousarray(array, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()


def deserialize_tensor(data: bytes, data_type: str, dims: Sequence[int]) -> np.ndarray:
    """The inverse of :func:`serialize_tensor`."""
    if data_type == "TYPE_STRING":
        items, offset = [], 0
        while offset < len(data):
            (length,) = struct.unpack_from("<I", data, offset)
            items.append(data[offset + 4 : offset + 4 + length])
            offset += 4 + length
        return np.array(items, dtype=np.object_).reshape(tuple(dims))
    return np.frombuffer(data, dtype=np.dtype(_NUMPY_TYPES[data_type]).newbyteorder("<")).reshape(tuple(dims))
