"""tokenizer_cache: prompt text to token ids, with a tiered tokenisation cache.

All logic lives in ``warmup_tools.tokenizer_cache.service``; this file only adapts Triton's request objects.
"""

import time

import numpy as np
import triton_python_backend_utils as pb_utils

from warmup_tools.common.tracing import Tracer, cache_attributes, end_span
from warmup_tools.tokenizer_cache.service import TokenizerService
from warmup_tools.tokenizer_cache.settings import TokenizerCacheSettings
from warmup_tools.triton.inputs import parse_text
from warmup_tools.triton.io import collect_inputs, error_response, log_unexpected, model_parameters, shared_tier
from warmup_tools.triton.metrics import CacheMetrics, PeriodicFlush
from warmup_tools.triton.trust import TenantTrust
from warmup_tools.triton.warmup import OwnWarmupSamples

INPUTS = ("text_input", "tenant_id", "tenant_key", "warmup_plan")


class TritonPythonModel:
    def initialize(self, args):
        settings = TokenizerCacheSettings.from_parameters(model_parameters(args))
        self.trust = TenantTrust.from_settings(settings.trust, model="tokenizer_cache")
        self.service = TokenizerService(settings.tokenizer,
                                        shared=shared_tier(settings.shared, self.trust, model="tokenizer_cache"))
        self.metrics = CacheMetrics(pb_utils, "tokenizer_cache", args["model_instance_name"])
        self.metrics_flush = PeriodicFlush(self.metrics.flush, settings.metrics.flush_s, "tokenizer-metrics")
        self.own_samples = OwnWarmupSamples.from_args(args)  # only they, while loading, may carry warmup_plan
        self.tracer = Tracer.from_environment(args["model_instance_name"])  # off without WARMUP_TRACING_ENDPOINT

    def execute(self, requests):
        responses = []
        for request in requests:
            span = self.tracer.request_span("tokenizer_cache", request)
            try:
                inputs = collect_inputs(pb_utils, request, INPUTS)
                # An own warm-up sample (at load only) needs no tenant key and gets no signed token; one that
                # carries warmup_plan marks a template.
                own_sample = self.own_samples.check(inputs)
                tenant = self.trust.first_step_tenant(inputs, own_sample)
                text = parse_text(inputs)
                if own_sample and inputs.get("warmup_plan") is not None:
                    self.service.register_template(text)
                ids, source = self.service.encode(text, tenant)
                end_span(span, {**cache_attributes(source), "prompt_tokens": int(ids.size)})
                token = self.trust.token(tenant, now=time.time(), verified=not own_sample)
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("input_ids", ids),
                    pb_utils.Tensor("input_length", np.array([ids.size], dtype=np.int32)),
                    pb_utils.Tensor("tenant_token", np.array([token.encode()], dtype=np.object_)),
                ]))
                self.metrics.record(source, self.service.local.stats)
            except Exception as exc:  # noqa: BLE001 (one bad request never fails the batch)
                end_span(span, error=exc)
                log_unexpected(pb_utils, "tokenizer_cache", exc)
                responses.append(error_response(pb_utils, exc))
        return responses

    def finalize(self):
        self.metrics_flush.close()
        self.tracer.shutdown()
        self.service = None
