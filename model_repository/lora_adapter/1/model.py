"""lora_adapter: token ids + adapter + sampling inputs to a stream of text pieces (decoupled).

All logic lives in ``warmup_tools.lora_adapter`` (service, engine, settings); this file only adapts Triton's
request objects.
"""

import time

import numpy as np
import triton_python_backend_utils as pb_utils

from warmup_tools.triton.inputs import parse_optional_text
from warmup_tools.triton.io import collect_inputs, error_for, log_unexpected, model_parameters
from warmup_tools.triton.metrics import GenerationMetrics
from warmup_tools.lora_adapter.engine import EngineConfig, LoraEngine
from warmup_tools.lora_adapter.service import LoraService
from warmup_tools.lora_adapter.settings import LoraAdapterSettings
from warmup_tools.common.records import RequestRecord
from warmup_tools.lora_adapter.request_log import RequestLogWriter
from warmup_tools.lora_adapter.requests import RequestLimits, parse_generate_request

INPUTS = ("input_ids", "adapter_id", "tenant_id", "max_tokens", "stream", "temperature",
          "top_p", "top_k", "seed", "cluster_id", "warmup_plan", "text_input")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        settings = LoraAdapterSettings.from_parameters(model_parameters(args))
        engine = LoraEngine(EngineConfig(
            base_model=settings.base_model, adapter_root=settings.adapter_root, adapters=settings.adapters,
            device=settings.device, dtype=settings.dtype, num_threads=settings.num_threads, kv=settings.kv))
        self.instance = args["model_instance_name"]
        self.service = LoraService(
            engine, instance=self.instance, control_dir=settings.control_dir, serve_cold=settings.serve_cold,
            warm_priority=settings.warm_priority, warm_share=settings.warm_share,
            warm_chunk_tokens=settings.warm_chunk_tokens)
        self.limits = RequestLimits(max_tokens_limit=settings.max_tokens_limit,
                                    default_max_tokens=settings.default_max_tokens, vocab_size=engine.vocab_size)
        self.redact = settings.request_log_redact
        self.request_log = (RequestLogWriter(settings.request_log_dir, self.instance)
                            if settings.request_log_dir is not None else None)
        self.metrics = GenerationMetrics(pb_utils, "lora_adapter", self.instance)
        pb_utils.Logger.log_info(f"lora_adapter: device {engine.device}, adapters {sorted(engine.adapters)}")

    def execute(self, requests):
        if self.service.adapters_changed():
            self.metrics.record_state(self.service)  # before serving, so a refusal's state is visible
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._serve(request, sender)
            except Exception as exc:  # noqa: BLE001 (one bad request never fails the batch)
                log_unexpected(pb_utils, "lora_adapter", exc)
                sender.send(pb_utils.InferenceResponse(error=error_for(pb_utils, exc)), flags=FINAL)
        self.metrics.record_state(self.service)
        return None

    def _serve(self, request, sender):
        arrived = time.time()
        inputs = collect_inputs(pb_utils, request, INPUTS)
        req = parse_generate_request(inputs, self.limits)
        text = []
        for step in self.service.generate(req):
            if req.stream:
                sender.send(_response(step.text, step), flags=FINAL if step.finished else 0)
            else:
                text.append(step.text)
                if step.finished:
                    sender.send(_response("".join(text), step), flags=FINAL)
            if step.output_tokens == 1:  # NOTE: after the send, so metrics never delay the first token
                self.metrics.record(req.adapter, step.prompt_tokens, step.cached_tokens, step.elapsed)
                ttft_ms = step.elapsed * 1000
            if step.finished and self.request_log is not None and not req.is_warmup:
                self.request_log.log(RequestRecord.served(
                    ts=arrived, tenant=req.tenant, adapter=req.adapter, prompt=parse_optional_text(inputs),
                    prompt_tokens=step.prompt_tokens, cached_tokens=step.cached_tokens, ttft_ms=ttft_ms,
                    output_tokens=step.output_tokens, cluster=req.cluster_id, redact=self.redact))

    def finalize(self):
        self.service.close()
        if self.request_log is not None:
            self.request_log.close()


def _response(text, step):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("cached_tokens", np.array([step.cached_tokens], dtype=np.int32)),
        pb_utils.Tensor("prompt_tokens", np.array([step.prompt_tokens], dtype=np.int32)),
        pb_utils.Tensor("output_tokens", np.array([step.output_tokens], dtype=np.int32)),
        pb_utils.Tensor("finish_reason", np.array([step.finish_reason.encode()], dtype=np.object_)),
    ])
