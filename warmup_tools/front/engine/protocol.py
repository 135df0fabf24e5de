"""The protobuf requests the front sends tritonserver: one inference's tensors and parameters, as Triton reads them.

Why the front builds them itself rather than with tritonclient's ``InferInput``: a generation is called as a
server-streaming call (:mod:`~warmup_tools.front.engine.triton_engine`) and a unary inference as a plain
``ModelInfer``, both on the raw ``grpc.aio`` channel, where tritonclient's asyncio client only offers its
bidirectional ``stream_infer``.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
from tritonclient.grpc import service_pb2
from tritonclient.utils import serialize_byte_tensor

#: One input tensor: name, Triton datatype, values.
Tensor = tuple[str, str, np.ndarray]


def infer_request(model: str, request_id: str, inputs: Sequence[Tensor], outputs: Sequence[str] = (), *,
                  parameters: Mapping[str, str] | None = None) -> service_pb2.ModelInferRequest:
    """The protobuf of one inference (string ``parameters`` for the request); BYTES tensors are length-prefixed
    as Triton expects."""
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for key, value in (parameters or {}).items():
        request.parameters[key].string_param = value
    for name, datatype, array in inputs:
        request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        if datatype == "BYTES":  # NOTE: a 0-d object array holding the length-prefixed bytes (empty: size 0)
            serialized = serialize_byte_tensor(array)
            request.raw_input_contents.append(serialized.item() if serialized.size else b"")
        else:
            request.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
    for name in outputs:
        request.outputs.add(name=name)
    return request
