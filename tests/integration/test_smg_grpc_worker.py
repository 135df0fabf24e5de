"""smg's gRPC worker protocol on a real replica: the front's VllmEngine listeners on a real tritonserver, behind a
real ``smg`` (1.13, round_robin, the LM's folder as its tokenizer), through the official ``openai`` SDK."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from tests.waiting import HANG_S, wait_for, wait_for_generation_to_leave
from warmup_tools.demo.prompts import SYSTEM_PROMPTS, USER_QUESTIONS
from warmup_tools.fleet.process import Child
from warmup_tools.server.client import metric_sum, scrape_metrics
from warmup_tools.server.process import free_port, free_port_block

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

MODELS = 4  # the base model and the three demo adapters
MAX_TOKENS = 512  # lora_adapter's max_tokens_limit: a stream that ran to the end would produce all of them


def front_settings(triton, **overrides):
    from tests.conftest import REPO_ROOT
    from warmup_tools.front.settings import FrontSettings

    return FrontSettings(**{"port": 0, "triton_grpc_url": triton.grpc_url, "triton_metrics_url": triton.metrics_url,
                            "model_repository": REPO_ROOT / "model_repository", "poll_interval_s": 0.2,
                            "grpc_worker_port": free_port_block("127.0.0.1", MODELS), "grpc_worker_models": MODELS,
                            "kv_events_dir": triton.kv_events_dir, **overrides})


@pytest.fixture(scope="module")
def front(triton):
    from warmup_tools.front.server import FrontServer

    with FrontServer(front_settings(triton), environ={"WARMUP_ASSETS_DIR": str(triton.assets_dir)}) as server:
        yield server


@pytest.fixture(scope="module")
def workers(front):
    """``{model: port}`` of the live models' listeners, once every adapter has one."""
    def listed():
        answer = httpx.get(f"{front.url}/grpc-workers", timeout=30).json()["workers"]
        return {w["model"]: w["port"] for w in answer} if len(answer) == MODELS else None

    return wait_for(listed, "a gRPC worker listener for each live model")


@pytest.fixture(scope="module")
def smg(triton, workers, tmp_path_factory):
    work = tmp_path_factory.mktemp("smg")
    port = free_port()
    urls = [f"grpc://127.0.0.1:{workers[m]}" for m in ("base", "legal")]
    argv = [str(Path(sys.executable).parent / "smg"), "launch", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(free_port()), "--worker-urls", *urls, "--policy", "round_robin",
            "--model-path", str(triton.assets_dir / "lm"), "--history-backend", "none",
            "--shutdown-grace-period-secs", "1", "--log-level", "warn"]
    process = Child("smg", argv, {"PATH": str(Path(sys.executable).parent), "HOME": str(work)}, work / "smg.log")
    process.start()
    url = f"http://127.0.0.1:{port}"
    try:
        def both_models():
            if process.exited():
                raise AssertionError(f"smg exited:\n{process.log_tail()}")
            try:
                listed = httpx.get(f"{url}/v1/models", timeout=10).json().get("data", [])
            except (httpx.HTTPError, ValueError):
                return False
            return {"base", "legal"} <= {m.get("id") for m in listed}

        wait_for(both_models, "smg serving the base model and legal from their gRPC workers",
                 detail=lambda: "\n" + process.log_tail())
        yield url
    finally:
        process.stop()


@pytest.fixture()
def sdk(smg):
    with openai.OpenAI(base_url=f"{smg}/v1", api_key="none", max_retries=0, timeout=HANG_S) as client:
        yield client


def stub(port: int) -> tuple[grpc.Channel, vllm_engine_pb2_grpc.VllmEngineStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return channel, vllm_engine_pb2_grpc.VllmEngineStub(channel)


def test_each_listener_names_its_model_and_the_replica(workers):
    assert sorted(workers) == ["base", "legal", "sql", "support"] and workers["base"] < min(
        port for model, port in workers.items() if model != "base")
    channel, engine = stub(workers["sql"])
    with channel:
        info = engine.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=60)
        assert info.served_model_name == "sql" and info.model_path == "" and info.is_generation
        assert info.vocab_size > 0 and info.max_context_length > 0 and list(info.eos_token_ids)
        server = engine.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(), timeout=60)
        assert server.block_size > 0 and server.max_num_seqs > 0 and server.server_type == "warmup-triton-grpc"
        assert engine.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=60).healthy
        loads = engine.GetLoads(vllm_engine_pb2.GetLoadsRequest(include=["core"]), timeout=60)
        assert len(loads.loads) == 1 and loads.loads[0].max_running_requests == server.max_num_seqs
        chunks = list(engine.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=60))
        assert chunks[-1].sha256 and all(not c.sha256 for c in chunks[:-1])


def test_a_chat_completion_through_smg_streams_text_and_reports_cached_tokens(sdk):
    messages = [{"role": "system", "content": SYSTEM_PROMPTS["support"]},
                {"role": "user", "content": USER_QUESTIONS["support"][0]}]
    usages = []
    for _ in range(2):  # the second time the prompt's blocks are in the base model's cache
        stream = sdk.chat.completions.create(model="base", messages=messages, max_tokens=8, stream=True,
                                             stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text
        usages.append(chunks[-1].usage)
    assert usages[1].completion_tokens == 8 and usages[1].prompt_tokens == usages[0].prompt_tokens
    assert 0 < usages[1].prompt_tokens_details.cached_tokens <= usages[1].prompt_tokens


def test_the_adapters_listener_serves_the_adapter(sdk, triton):
    before = metric_sum(scrape_metrics(triton.metrics_url), "warmup_output_tokens_total", model="lora_adapter",
                        adapter="legal")
    messages = [{"role": "system", "content": SYSTEM_PROMPTS["legal"]},
                {"role": "user", "content": USER_QUESTIONS["legal"][0]}]
    answer = sdk.chat.completions.create(model="legal", messages=messages, max_tokens=5)
    assert answer.model == "legal" and answer.choices[0].message.content and answer.usage.completion_tokens == 5
    # The system prompt of legal was pre-filled for legal by its warm-up samples: the adapter's own blocks.
    assert answer.usage.prompt_tokens_details.cached_tokens > 0
    after = metric_sum(scrape_metrics(triton.metrics_url), "warmup_output_tokens_total", model="lora_adapter",
                       adapter="legal")
    assert after - before >= 5


def test_a_client_that_leaves_mid_stream_frees_the_sequence(sdk, triton):
    def legal_tokens() -> float:
        return metric_sum(scrape_metrics(triton.metrics_url), "warmup_output_tokens_total", model="lora_adapter",
                          adapter="legal")

    story = [{"role": "user", "content": "Tell me a very long story about a lighthouse."}]
    # The same request, not abandoned, runs to max_tokens: a stream that produced fewer stopped because its
    # client left.
    whole = sdk.chat.completions.create(model="legal", messages=story, max_tokens=MAX_TOKENS,
                                        extra_body={"ignore_eos": True})
    assert whole.usage.completion_tokens == MAX_TOKENS
    # NOTE: every token before it is counted once a later request was answered (test_cancellation.py says why).
    sdk.chat.completions.create(model="legal", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    before = legal_tokens()
    stream = sdk.chat.completions.create(model="legal", messages=story, max_tokens=MAX_TOKENS, stream=True,
                                         extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break  # the generation runs (it holds MAX_TOKENS - 1 more steps): the client leaves now
    stream.close()
    wait_for_generation_to_leave(triton.metrics_url, "legal", before)
    sdk.chat.completions.create(model="legal", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    ran = legal_tokens() - before - 1
    assert 1 <= ran < MAX_TOKENS, f"the abandoned stream ran {ran} of its {MAX_TOKENS} tokens"


def test_generate_refuses_what_the_project_does_not_do(workers):
    channel, engine = stub(workers["base"])
    with channel:
        request = vllm_engine_pb2.GenerateRequest(
            request_id="n2", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[5, 6, 7]), stream=True,
            sampling_params=vllm_engine_pb2.SamplingParams(n=2, max_tokens=4))
        with pytest.raises(grpc.RpcError) as raised:
            list(engine.Generate(request, timeout=60))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n must be 1" in raised.value.details()
        request.sampling_params.n = 1
        request.sampling_params.max_tokens = 100000  # above lora_adapter's max_tokens_limit: its own refusal
        with pytest.raises(grpc.RpcError) as raised:
            list(engine.Generate(request, timeout=60))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in raised.value.details()
        request.sampling_params.max_tokens = 3
        answers = list(engine.Generate(request, timeout=HANG_S))
        complete = answers[-1].complete
        assert complete.finish_reason in ("stop", "length") and complete.prompt_tokens == 3
        streamed = [t for a in answers[:-1] for t in a.chunk.token_ids]
        assert list(complete.output_ids) == streamed and complete.completion_tokens == len(streamed)


def test_health_fails_while_the_replica_is_not_ready(triton):
    from warmup_tools.front.server import FrontServer

    # No sidecar answers at this address: the replica is not ready, and HealthCheck fails the call (smg registers
    # a worker whose HealthCheck succeeds, whatever its healthy field says).
    settings = front_settings(triton, sidecar_url=f"http://127.0.0.1:{free_port()}")
    with FrontServer(settings, environ={"WARMUP_ASSETS_DIR": str(triton.assets_dir)}):
        channel, engine = stub(settings.grpc_worker_port)
        with channel:
            with pytest.raises(grpc.RpcError) as raised:
                engine.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=60)
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            request = vllm_engine_pb2.GenerateRequest(
                request_id="r", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[5, 6]), stream=True)
            with pytest.raises(grpc.RpcError) as raised:
                list(engine.Generate(request, timeout=60))
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


def test_trust_mode_refuses_the_listeners(triton, tmp_path):
    from warmup_tools.common.errors import ConfigError
    from warmup_tools.front.server import FrontServer

    keys = tmp_path / "tenant_keys.json"
    keys.write_text("{}")
    with pytest.raises(ConfigError, match="cannot prove a request's tenant"):
        FrontServer(front_settings(triton, tenant_keys_file=keys),
                    environ={"WARMUP_ASSETS_DIR": str(triton.assets_dir)})


def test_abort_ends_a_running_generation_by_its_request_id(workers, triton):
    channel, engine = stub(workers["legal"])
    with channel:
        engine.Abort(vllm_engine_pb2.AbortRequest(request_ids=["no-such-request"]), timeout=60)  # ignored
        request = vllm_engine_pb2.GenerateRequest(
            request_id="held-open", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=list(range(5, 40))),
            stream=True, sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        answers = engine.Generate(request, timeout=HANG_S)
        first = next(answers)  # the generation runs, MAX_TOKENS - 1 steps still to go
        assert first.WhichOneof("response") == "chunk"
        engine.Abort(vllm_engine_pb2.AbortRequest(request_ids=["held-open"]), timeout=60)
        rest = list(answers)
        assert rest[-1].complete.finish_reason == "abort"
        assert sum(len(a.chunk.token_ids) for a in [first, *rest[:-1]]) < MAX_TOKENS


def test_a_generate_calls_trace_context_is_continued(triton):
    """smg (``--enable-trace``) sends ``traceparent``/``tracestate`` metadata: the front's span continues it (the
    models' own spans below it: tests/integration/test_tracing.py)."""
    import concurrent.futures
    import secrets

    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    from tests.integration.test_tracing import Collector
    from warmup_tools.common.settings import environ_overrides
    from warmup_tools.front.server import FrontServer

    receiver = Collector()
    collector = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, collector)
    endpoint = f"127.0.0.1:{collector.add_insecure_port('127.0.0.1:0')}"
    collector.start()
    try:
        settings = front_settings(triton)
        with environ_overrides({"WARMUP_TRACING_ENDPOINT": endpoint}):
            front = FrontServer(settings, environ={"WARMUP_ASSETS_DIR": str(triton.assets_dir)})
        with front:
            trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
            channel, engine = stub(settings.grpc_worker_port)
            with channel:
                def healthy() -> bool:
                    try:
                        return engine.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=60).healthy
                    except grpc.RpcError:
                        return False

                wait_for(healthy, "the traced front ready")
                request = vllm_engine_pb2.GenerateRequest(
                    request_id="traced", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[5, 6, 7]), stream=True,
                    sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=2))
                answers = list(engine.Generate(request, timeout=HANG_S, metadata=(
                    ("traceparent", f"00-{trace_id}-{parent_id}-01"), ("tracestate", "vendor=abc"))))
                assert answers[-1].complete.completion_tokens == 2
            (span,) = wait_for(lambda: [s for _, s in receiver.trace(trace_id) if s.name == "front.generate"],
                               "the front's span of the traced Generate")
            assert span.parent_span_id.hex() == parent_id and span.trace_state == "vendor=abc"
    finally:
        collector.stop(grace=None)


def test_kv_events_are_relayed_from_the_instances_socket(workers):
    """A subscription from 0 on the legal listener gets the instance's state of legal's blocks (its warm-up
    samples' system prompt) through the front (the event stream itself: tests/integration/test_kv_events.py)."""
    channel, engine = stub(workers["legal"])
    with channel:
        call = engine.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=0), timeout=HANG_S)
        try:
            call.initial_metadata()  # the relay's headers: sent once the instance sent its own
            first = next(call)
            stored = [e for e in first.events if e.WhichOneof("data") == "stored"] if first.events else []
            assert first.HasField("snapshot") or stored, first
        finally:
            call.cancel()


def test_smg_renders_and_tokenizes_a_chat_as_the_front_does(triton, front, sdk):
    """A plan learnt from the front's traffic holds the token ids smg sends: a chat served through the front first
    is a cache hit through smg's gRPC path, prompt tokens equal (smg's chat template and tokenizer are the LM's)."""
    messages = [{"role": "system", "content": SYSTEM_PROMPTS["legal"] + " Answer in one word when you can."},
                {"role": "user", "content": "Token check: is a verbal contract binding?"}]
    with openai.OpenAI(base_url=f"{front.url}/v1", api_key="none", max_retries=0, timeout=HANG_S) as direct:
        first = direct.chat.completions.create(model="legal", messages=messages, max_tokens=1)
    second = sdk.chat.completions.create(model="legal", messages=messages, max_tokens=1)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= (first.usage.prompt_tokens - 1) // 16 * 16 > 0
    # Both reach lora_adapter's request log with the prompt's text (the gRPC one decoded from smg's ids), so the
    # planner learns from gRPC traffic as from the front's.
    import json

    def logged():
        prompts = [json.loads(line).get("prompt") or "" for path in triton.request_log_dir.glob("*.jsonl")
                   for line in path.read_text().splitlines() if line.strip()]
        return sum("Token check: is a verbal contract binding?" in p for p in prompts) >= 2

    wait_for(logged, "both requests in lora_adapter's request log with their prompt")


def _smg_kv(url: str, name: str, worker: str, **labels: str) -> float:
    return metric_sum(scrape_metrics(url, prefix=name), name, worker=worker, **labels)


def test_a_router_whose_event_stream_broke_resumes_from_the_replay_window(triton, front, workers, tmp_path):
    """smg (cache_aware on its event index) reaches the base listener through a link the test cuts. Blocks stored
    while it is cut arrive once smg reconnects: it resumes from the last number it applied, inside the instance's
    replay window, so its index takes them as live events, with no full-state resync (its own counters say so)."""
    import uuid

    from tests.tcp_fault import Forwarder

    with Forwarder(workers["base"]) as link:
        worker = f"grpc://127.0.0.1:{link.port}"
        port, metrics = free_port(), free_port()
        argv = [str(Path(sys.executable).parent / "smg"), "launch", "--host", "127.0.0.1", "--port", str(port),
                "--prometheus-port", str(metrics), "--worker-urls", worker, "--policy", "cache_aware",
                "--kv-index", "positional", "--block-size", "16", "--model-path", str(triton.assets_dir / "lm"),
                "--history-backend", "none", "--shutdown-grace-period-secs", "1", "--log-level", "warn"]
        process = Child("smg", argv, {"PATH": str(Path(sys.executable).parent), "HOME": str(tmp_path)},
                        tmp_path / "smg.log")
        process.start()
        url = f"http://127.0.0.1:{metrics}/metrics"
        try:
            def counter(name: str, **labels: str) -> float:
                try:
                    return _smg_kv(url, name, worker, **labels)
                except (OSError, ValueError):
                    return -1.0

            wait_for(lambda: counter("smg_kv_event_batches_total", disposition="snapshot") >= 1,
                     "smg applying the listener's state", detail=lambda: "\n" + process.log_tail())
            snapshots = counter("smg_kv_event_batches_total", disposition="snapshot")
            resyncs = counter("smg_kv_event_resyncs_total")
            streams = counter("smg_kv_event_subscriptions_total")
            stored = counter("smg_kv_event_blocks_total", op="stored")

            link.cut()
            prompt = f"Resume check {uuid.uuid4().hex}: " + " ".join(USER_QUESTIONS["support"]) * 2
            answer = httpx.post(f"{front.url}/v1/completions", json={"model": "base", "prompt": prompt,
                                                                       "max_tokens": 1}, timeout=HANG_S)
            assert answer.status_code == 200, answer.text
            blocks = answer.json()["usage"]["prompt_tokens"] // 16
            assert blocks >= 2
            link.mend()

            wait_for(lambda: counter("smg_kv_event_blocks_total", op="stored") >= stored + blocks,
                     f"smg receiving the {blocks} blocks stored while its stream was cut",
                     detail=lambda: "\n" + process.log_tail())
            assert counter("smg_kv_event_subscriptions_total") > streams  # it did reconnect
            assert counter("smg_kv_event_batches_total", disposition="snapshot") == snapshots
            assert counter("smg_kv_event_resyncs_total") == resyncs
        finally:
            process.stop()
