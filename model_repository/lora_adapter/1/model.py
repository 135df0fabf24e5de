"""lora_adapter: token ids + adapter + sampling inputs to a stream of text pieces (decoupled).

All logic lives in ``warmup_tools.lora_adapter`` (engine, scheduler, service, responses); this file only
adapts Triton's request objects. Like Triton's vLLM backend, ``execute`` hands each valid request to the
instance's scheduler and returns at once; its responses go out through the request's response sender
from the scheduler's thread.
"""

import dataclasses
import time

import triton_python_backend_utils as pb_utils

from warmup_tools.common.wire import LORA_ADAPTER_INPUTS
from warmup_tools.triton.inputs import parse_optional_text
from warmup_tools.triton.io import chat_roles, collect_inputs, error_for, log_unexpected, model_parameters
from warmup_tools.triton.metrics import GenerationMetrics, SchedulerMetrics, SnapshotMetrics
from warmup_tools.triton.trust import TenantTrust
from warmup_tools.triton.warmup import OwnWarmupSamples, own_plan_id
from warmup_tools.lora_adapter.engines import make_engine
from warmup_tools.lora_adapter.responses import ResponseQueue, ResponseSink
from warmup_tools.lora_adapter.scheduler import Scheduler
from warmup_tools.lora_adapter.service import LoraService
from warmup_tools.lora_adapter.settings import LoraAdapterSettings
from warmup_tools.lora_adapter.snapshots import SnapshotKeeper
from warmup_tools.lora_adapter.request_log import RequestLogWriter, prompt_for_log
from warmup_tools.lora_adapter.requests import parse_generate_request
from warmup_tools.common.tracing import Tracer
from warmup_tools.lora_adapter.traced import refused, traced

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        settings = LoraAdapterSettings.from_parameters(model_parameters(args))
        self.trust = TenantTrust.from_settings(settings.trust, model="lora_adapter")
        engine = make_engine(dataclasses.replace(settings.engine, cache_salt=self.trust.cache_salt()))
        self.instance = args["model_instance_name"]
        self.own_samples = OwnWarmupSamples.from_args(args)  # only they, while loading, may carry warmup_plan
        self.limits = dataclasses.replace(settings.limits, vocab_size=engine.vocab_size)
        self.redact = settings.request_log_redact
        self.tokenizer = engine.tokenizer
        self.digest_key = self.trust.derived_key(b"log-digest")
        self.expose_cached_tokens = settings.expose_cached_tokens
        observer = SchedulerMetrics(pb_utils, "lora_adapter", self.instance, flush_s=settings.metrics.flush_s).observe
        scheduler = Scheduler(engine, settings.batching, observer=observer)
        scheduler.start()  # before the service: its first reconcile may load adapters through it
        try:
            self.service = LoraService(engine, settings.service, instance=self.instance, scheduler=scheduler)
        except Exception:
            scheduler.stop()
            raise
        self.request_log = (RequestLogWriter(settings.request_log_dir, self.instance)
                            if settings.request_log_dir is not None else None)
        self.metrics = GenerationMetrics(pb_utils, "lora_adapter", self.instance)
        self.responses = ResponseQueue()
        self.tracer = Tracer.from_environment(self.instance)  # off without WARMUP_TRACING_ENDPOINT
        pb_utils.Logger.log_info(f"lora_adapter: {engine.label}, device {engine.device}, "
                                 f"adapters {sorted(engine.adapters)}")
        self.snapshots = None
        if settings.snapshots.folder is not None and engine.prefix_cache is not None:
            # Before Triton runs the warm-up samples: they then find their prefixes cached.
            snapshot_metrics = SnapshotMetrics(pb_utils, "lora_adapter")
            self.snapshots = SnapshotKeeper(engine, settings.snapshots, instance=self.instance,
                                            plan_id=own_plan_id(args), run_on_engine=self.service.run_on_engine,
                                            log=pb_utils.Logger.log_warn, on_write=snapshot_metrics.record_write,
                                            mac_key=self.trust.derived_key(b"kv-snapshot-mac"),
                                            host=settings.service.replica_name or None)
            report = self.snapshots.restore()
            snapshot_metrics.record_restore(report)
            pb_utils.Logger.log_info(f"lora_adapter: KV snapshots restored {report.blocks} blocks "
                                     f"({report.bytes} bytes, {report.verified} verified) from "
                                     f"{report.snapshots_used} snapshot(s) in {report.seconds:.3f} s")
            self.snapshots.start()

    def execute(self, requests):
        if self.service.adapters_changed():
            self.metrics.record_state(self.service)  # before serving, so a refusal's state is visible
        for request in requests:
            sender = request.get_response_sender()
            sink = None
            try:
                inputs = collect_inputs(pb_utils, request, LORA_ADAPTER_INPUTS)
                tenant = self.trust.tenant_of(inputs, self.own_samples.check(inputs), now=time.time())
                req = parse_generate_request(inputs, self.limits, tenant=tenant)
                prompt = (prompt_for_log(self.tokenizer, parse_optional_text(inputs), req.prompt_ids)
                          if self.request_log is not None else None)
                sink = ResponseSink(pb_utils, sender, req, metrics=self.metrics, request_log=self.request_log,
                                    prompt_text=prompt, redact=self.redact, digest_key=self.digest_key,
                                    expose_cached_tokens=self.expose_cached_tokens,
                                    roles=chat_roles(request) if prompt is not None else None,
                                    queue=self.responses)
                sink = traced(sink, self.tracer, request, len(req.prompt_ids), req.adapter)
                self.service.serve(req, sink)  # queued on the scheduler: returns at once
            except Exception as exc:  # noqa: BLE001 (one bad request never fails the batch)
                log_unexpected(pb_utils, "lora_adapter", exc)
                sender.send(pb_utils.InferenceResponse(error=error_for(pb_utils, exc)), flags=FINAL)
                refused(sink, exc)
        self.metrics.record_state(self.service)
        return None

    def finalize(self):
        self.service.close()
        self.responses.close()  # the last responses of the requests that ran, sent
        if self.snapshots is not None:
            self.snapshots.close()  # the last snapshot, once no request runs
        if self.request_log is not None:
            self.request_log.close()
        self.tracer.shutdown()

