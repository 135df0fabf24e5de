"""lora_adapter: token ids + adapter + sampling inputs to a stream of text pieces (decoupled).

All logic lives in ``warmup_tools.lora_adapter`` (engine, scheduler, service, responses); this file only
adapts Triton's request objects. Like Triton's vLLM backend, ``execute`` hands each valid request to the
instance's scheduler and returns at once; its responses go out through the request's response sender
from the scheduler's thread.
"""

import triton_python_backend_utils as pb_utils

from warmup_tools.common.errors import ConfigError
from warmup_tools.triton.inputs import parse_optional_text
from warmup_tools.triton.io import collect_inputs, error_for, log_unexpected, model_parameters
from warmup_tools.triton.metrics import GenerationMetrics, SchedulerMetrics
from warmup_tools.lora_adapter.engine import EngineConfig, LoraEngine
from warmup_tools.lora_adapter.responses import ResponseSink
from warmup_tools.lora_adapter.scheduler import Scheduler, SchedulerConfig
from warmup_tools.lora_adapter.service import LoraService
from warmup_tools.triton.params import parse_bool
from warmup_tools.lora_adapter.request_log import RequestLogWriter
from warmup_tools.lora_adapter.requests import RequestLimits, parse_generate_request

INPUTS = ("input_ids", "adapter_id", "tenant_id", "max_tokens", "stream", "temperature",
          "top_p", "top_k", "seed", "cluster_id", "warmup_plan", "text_input")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
SCHEDULERS = ("continuous", "serial")


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        adapters = params.get("adapters", str, "")
        engine = LoraEngine(EngineConfig(
            base_model=params.path("base_model"),
            adapter_root=params.path("adapter_root"),
            adapters=tuple(a.strip() for a in adapters.split(",") if a.strip()) or None,
            device=params.get("device", str, "auto"),
            dtype=params.get("dtype", str, "auto"),
            num_threads=params.get("num_threads", int, 0),
            kv_cache_bytes=params.get("kv_cache_bytes", int, 256 << 20),
            kv_block_size=params.get("kv_block_size", int, 16),
            kv_storage=params.get("kv_storage", str, "fp"),
            kv_eviction=params.get("kv_eviction", str, "lfu_ttl"),
            kv_ttl_s=params.get("kv_ttl_s", float, 3600.0),
            kv_live_reserve=params.get("kv_live_reserve", float, 0.15),
        ))
        control = params.get("control_dir", str, "")
        self.instance = args["model_instance_name"]
        mode = params.get("scheduler", str, "continuous")
        if mode not in SCHEDULERS:
            raise ConfigError(f"lora_adapter: parameter 'scheduler'={mode!r}: use one of {', '.join(SCHEDULERS)}")
        scheduler_config = SchedulerConfig(
            max_num_seqs=params.get("max_num_seqs", int, 8),
            max_queue=params.get("max_queue", int, 64),
            max_num_batched_tokens=params.get("max_num_batched_tokens", int, 256),
        )
        service_options = dict(
            control_dir=params.path("control_dir") if control else None,
            serve_cold=params.get("serve_cold", parse_bool, False),
            warm_priority=params.get("warm_priority", str, "live_first"),
            warm_share=params.get("warm_share", float, 0.5),
            warm_chunk_tokens=params.get("warm_chunk_tokens", int, 128),
        )
        self.limits = RequestLimits(
            max_tokens_limit=params.get("max_tokens_limit", int, 512),
            default_max_tokens=params.get("default_max_tokens", int, 16),
            vocab_size=engine.vocab_size,
        )
        log_dir = params.get("request_log_dir", str, "")
        self.redact = params.get("request_log_redact", parse_bool, False)
        params.check_unknown()
        self.scheduler = None
        if mode == "continuous":
            observer = SchedulerMetrics(pb_utils, "lora_adapter", self.instance).observe
            self.scheduler = Scheduler(engine, scheduler_config, observer=observer)
            self.scheduler.start()  # before the service: its first reconcile may load adapters through it
        try:
            self.service = LoraService(engine, instance=self.instance, scheduler=self.scheduler, **service_options)
        except Exception:
            if self.scheduler is not None:
                self.scheduler.stop()
            raise
        self.request_log = RequestLogWriter(params.path("request_log_dir"), self.instance) if log_dir else None
        self.metrics = GenerationMetrics(pb_utils, "lora_adapter", self.instance)
        pb_utils.Logger.log_info(f"lora_adapter: device {engine.device}, adapters {sorted(engine.adapters)}")

    def execute(self, requests):
        if self.service.adapters_changed():
            self.metrics.record_state(self.service)  # before serving, so a refusal's state is visible
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = collect_inputs(pb_utils, request, INPUTS)
                req = parse_generate_request(inputs, self.limits)
                prompt = parse_optional_text(inputs) if self.request_log is not None else None
                sink = ResponseSink(pb_utils, sender, req, metrics=self.metrics, request_log=self.request_log,
                                    prompt_text=prompt, redact=self.redact)
                self.service.serve(req, sink)  # continuous: queued, returns at once; serial: runs to the end
            except Exception as exc:  # noqa: BLE001 (one bad request never fails the batch)
                log_unexpected(pb_utils, "lora_adapter", exc)
                sender.send(pb_utils.InferenceResponse(error=error_for(pb_utils, exc)), flags=FINAL)
        self.metrics.record_state(self.service)
        return None

    def finalize(self):
        self.service.close()
        if self.request_log is not None:
            self.request_log.close()

