"""embedding_cache: prompt text to a normalised sentence embedding, its semantic cluster and similarity.

All logic lives in ``warmup_tools.embedding_cache.service``; this file only adapts Triton's request objects.
"""

import secrets
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from warmup_tools.common.tracing import Tracer, cache_attributes, end_span
from warmup_tools.embedding_cache.embedder import OnnxEmbedder
from warmup_tools.embedding_cache.semantic import CENTROIDS_FILE
from warmup_tools.embedding_cache.service import EmbeddingService
from warmup_tools.embedding_cache.settings import EmbeddingCacheSettings
from warmup_tools.triton.inputs import MAX_PROMPT_TOKENS, parse_count, parse_identity, parse_text
from warmup_tools.triton.io import collect_inputs, error_response, log_unexpected, model_parameters, shared_tier
from warmup_tools.triton.trust import TenantTrust
from warmup_tools.triton.warmup import OwnWarmupSamples
from warmup_tools.triton.metrics import CacheMetrics, HeatMetrics, PeriodicFlush

def outputs(requested, **arrays):
    """The output tensors the requester asked for (through ``ensemble``: only ``cluster_id``), no others."""
    return [pb_utils.Tensor(name, arrays[name]) for name in requested if name in arrays]


INPUTS = ("text_input", "warmup_plan", "tenant_id", "tenant_token", "adapter_id", "prompt_tokens")


class TritonPythonModel:
    def initialize(self, args):
        settings = EmbeddingCacheSettings.from_parameters(model_parameters(args))
        self.trust = TenantTrust.from_settings(settings.trust, model="embedding_cache")
        embedder = OnnxEmbedder(settings.embedder,
                                shared=shared_tier(settings.shared, self.trust, model="embedding_cache"))
        instance = args["model_instance_name"]
        heat_dir = settings.semantic.heat_log_dir
        self.service = EmbeddingService(
            embedder, settings.semantic,
            centroids_path=Path(args["model_repository"]) / CENTROIDS_FILE,
            heat_log=heat_dir / f"heat-{instance}.jsonl" if heat_dir is not None else None,
            cluster_key=self.trust.derived_key(b"cluster-id") or secrets.token_bytes(32),
        )
        self.metrics = CacheMetrics(pb_utils, "embedding_cache", instance)
        self.metrics_flush = PeriodicFlush(self.metrics.flush, settings.metrics.flush_s, "embedding-metrics")
        self.heat_metrics = HeatMetrics(pb_utils, instance)
        self.own_samples = OwnWarmupSamples.from_args(args)  # only they, while loading, may carry warmup_plan
        self.tracer = Tracer.from_environment(instance)  # off without WARMUP_TRACING_ENDPOINT
        pb_utils.Logger.log_info(f"embedding_cache: ONNX Runtime providers {embedder.providers}")

    def execute(self, requests):
        responses = []
        for request in requests:
            span = self.tracer.request_span("embedding_cache", request)
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
                end_span(span, cache_attributes(outcome.source))
                responses.append(pb_utils.InferenceResponse(output_tensors=outputs(
                    request.requested_output_names(),
                    embedding=outcome.vector,
                    # Only the caller's own tenant's clusters, under ids of its own (embedding_cache.semantic).
                    cluster_id=np.array([outcome.reported_cluster_id], dtype=np.int32),
                    similarity=np.array([outcome.similarity], dtype=np.float32))))
                self.metrics.record(outcome.source, self.service.embedder.local.stats)
            except Exception as exc:  # noqa: BLE001 (one bad request never fails the batch)
                end_span(span, error=exc)
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
        self.metrics_flush.close()
        self.tracer.shutdown()
        self.service.close()
        self.service = None
