"""embedding_cache: prompt text to a normalised sentence embedding (ONNX Runtime), with a bounded cache.

All logic lives in ``warmup_tools.embedding``; this file only adapts Triton's request objects.
"""

import random

import numpy as np
import triton_python_backend_utils as pb_utils

from warmup_tools.backend import (
    CacheMetrics, collect_inputs, error_response, log_unexpected, model_parameters, shared_tier,
)
from warmup_tools.embedding import OnnxEmbedder
from warmup_tools.requests import parse_optional_string, parse_text

INPUTS = ("text_input", "warmup_plan", "tenant_id")


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        self.embedder = OnnxEmbedder(
            params.path("embedder_path"),
            cache_bytes=params.get("cache_bytes", int, 64 << 20),
            providers=params.get("providers", str, "auto"),
            num_threads=params.get("num_threads", int, 1),
            shared=shared_tier(params),
        )
        self.sample_rate = params.get("miss_sample_rate", float, 0.1)
        self.rng = random.Random(params.get("sample_seed", int, 0))
        params.check_unknown()
        self.zeros = np.zeros(self.embedder.dim, dtype=np.float32)
        self.metrics = CacheMetrics(pb_utils, "embedding_cache", args["model_instance_name"])
        pb_utils.Logger.log_info(f"embedding_cache: ONNX Runtime providers {self.embedder.providers}")

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                inputs = collect_inputs(pb_utils, request, INPUTS)
                text = parse_text(inputs)
                # Warm-up samples always compute: filling the cache is their whole purpose.
                rate = 1.0 if inputs["warmup_plan"] is not None else self.sample_rate
                tenant = parse_optional_string(inputs, "tenant_id", "default")
                result = self.embedder.lookup_or_sample(text, rate, self.rng, tenant)
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("embedding", self.zeros if result.vector is None else result.vector),
                    # Cluster ids come from a warm-up plan; -1 means "no cluster assigned".
                    pb_utils.Tensor("cluster_id", np.array([-1], dtype=np.int32)),
                ]))
                self.metrics.record(result.source, self.embedder.local.stats)
            except Exception as exc:  # noqa: BLE001 (one bad request never fails the batch)
                log_unexpected(pb_utils, "embedding_cache", exc)
                responses.append(error_response(pb_utils, exc))
        return responses

    def finalize(self):
        self.embedder = None
