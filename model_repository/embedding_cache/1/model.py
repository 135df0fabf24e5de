"""embedding_cache: prompt text to a normalised sentence embedding, its semantic cluster and similarity.

All logic lives in ``warmup_tools.embedding_cache.service``; this file only adapts Triton's request objects.
"""

import secrets
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from warmup_tools.embedding_cache.embedder import OnnxEmbedder
from warmup_tools.embedding_cache.semantic import CENTROIDS_FILE
from warmup_tools.embedding_cache.service import EmbeddingService
from warmup_tools.triton.inputs import MAX_PROMPT_TOKENS, parse_count, parse_identity, parse_text
from warmup_tools.triton.io import (
    collect_inputs, error_response, log_unexpected, model_parameters, redis_tier_from_params,
)
from warmup_tools.triton.trust import TenantTrust
from warmup_tools.triton.params import parse_bool
from warmup_tools.triton.warmup import OwnWarmupSamples
from warmup_tools.triton.metrics import CacheMetrics, HeatMetrics

INPUTS = ("text_input", "warmup_plan", "tenant_id", "tenant_token", "adapter_id", "prompt_tokens")


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        self.trust = TenantTrust.from_parameters(params)
        embedder = OnnxEmbedder(
            params.path("embedder_path"),
            cache_bytes=params.get("cache_bytes", int, 64 << 20),
            providers=params.get("providers", str, "auto"),
            num_threads=params.get("num_threads", int, 1),
            shared=redis_tier_from_params(params),
        )
        instance = args["model_instance_name"]
        heat_dir = params.get("heat_log_dir", str, "")
        self.service = EmbeddingService(
            embedder,
            sample_rate=params.get("miss_sample_rate", float, 0.1),
            seed=params.get("sample_seed", int, 0),
            threshold=params.get("admit_threshold", float, 0.82),
            centroids_path=Path(args["model_repository"]) / CENTROIDS_FILE,
            heat_log=params.path("heat_log_dir") / f"heat-{instance}.jsonl" if heat_dir else None,
            deferred=params.get("deferred_misses", parse_bool, True),
            cluster_key=self.trust.derived_key(b"cluster-id") or secrets.token_bytes(32),
        )
        params.check_unknown()
        self.metrics = CacheMetrics(pb_utils, "embedding_cache", instance)
        self.heat_metrics = HeatMetrics(pb_utils, instance)
        self.own_samples = OwnWarmupSamples.from_args(args)  # only they, while loading, may carry warmup_plan
        pb_utils.Logger.log_info(f"embedding_cache: ONNX Runtime providers {embedder.providers}")

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                inputs = collect_inputs(pb_utils, request, INPUTS)
                own_sample = self.own_samples.check(inputs)
                outcome = self.service.handle(
                    parse_text(inputs),
                    tenant=self.trust.tenant_of(inputs, own_sample, now=time.time()),
                    adapter=parse_identity(inputs, "adapter_id", ""),
                    prompt_tokens=parse_count(inputs, "prompt_tokens", 0, MAX_PROMPT_TOKENS),
                    warmup=own_sample,
                )
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("embedding", outcome.vector),
                    # Only the caller's own tenant's clusters, under ids of its own (embedding_cache.semantic).
                    pb_utils.Tensor("cluster_id", np.array([outcome.reported_cluster_id], dtype=np.int32)),
                    pb_utils.Tensor("similarity", np.array([outcome.similarity], dtype=np.float32)),
                ]))
                self.metrics.record(outcome.source, self.service.embedder.local.stats)
            except Exception as exc:  # noqa: BLE001 (one bad request never fails the batch)
                log_unexpected(pb_utils, "embedding_cache", exc)
                responses.append(error_response(pb_utils, exc))
        try:
            snapshot = self.service.maybe_flush()
            if snapshot is not None:
                self.heat_metrics.publish(snapshot)
        except Exception as exc:  # noqa: BLE001 (statistics never cost the batch its responses)
            log_unexpected(pb_utils, "embedding_cache", exc)
        return responses

    def finalize(self):
        self.service.close()
        self.service = None
