"""What the Triton engine makes of tritonserver's answers: error messages to kinds, /metrics to model state
and load signals."""

import pytest

from warmup_tools.common.errors import (
    UNKNOWN_ADAPTER_HINT,
    AdapterUnavailableError,
    InvalidInputError,
    KVBudgetError,
    ServerBusyError,
    UnknownAdapterError,
)
from warmup_tools.common.wire import ErrorKind
from warmup_tools.control.state import _UNAVAILABLE, AdapterState
from warmup_tools.front.engine.triton_engine import classify, engine_error, parse_triton_metrics
from warmup_tools.front.generation import openai_error
from warmup_tools.triton.io import error_for
from warmup_tools.triton.trust import TenantAuthError


class _PbUtils:
    """What error_for needs of triton_python_backend_utils."""

    class TritonError:
        INVALID_ARG, NOT_FOUND, UNAVAILABLE, CANCELLED, INTERNAL = range(5)

        def __init__(self, message, code):
            self.message, self.code = message, code


def sent(exc: BaseException) -> str:
    """The message a model sends for ``exc`` (triton/io.py's error_for), as the ensemble's stream carries it."""
    return "in ensemble 'ensemble', " + error_for(_PbUtils, exc).message


@pytest.mark.parametrize("exc, kind", [
    (ServerBusyError("server busy: this instance already holds 72 requests; retry later"), "busy"),
    (UnknownAdapterError(f"unknown adapter 'nope': {UNKNOWN_ADAPTER_HINT}"), "not_found"),
    (InvalidInputError("input 'max_tokens' is out of range: use 1 to 512"), "invalid"),
    (AdapterUnavailableError("lora_adapter is shutting down", kind=ErrorKind.UNAVAILABLE), "unavailable"),
    (TenantAuthError("tenant 'acme' is not authenticated on this deployment"), "unauthenticated"),
    (KVBudgetError("the KV memory budget is too small for this prompt"), "invalid"),
    (RuntimeError("a bug"), "internal"),
])
def test_a_models_error_reaches_the_front_with_its_kind_whatever_its_words(exc, kind):
    assert classify(sent(exc)) == kind
    assert classify(sent(exc), "StatusCode.INVALID_ARGUMENT") == kind


@pytest.mark.parametrize("message, status, kind", [
    # NOTE: the front names the repository's own models; one Triton does not know is not loaded (the replica's
    # fault, not the client's model name, which the front resolves itself), with or without a status.
    ("Request for unknown model: 'lora_adapter' has no available versions", "StatusCode.NOT_FOUND", "unavailable"),
    ("[request id: u7] Request for unknown model: 'tokenizer_cache' is not found", None, "unavailable"),
    ("Stub process 'lora_adapter_0_0' is not healthy.", None, "unavailable"),
    ("something new", "StatusCode.UNAVAILABLE", "unavailable"),
    ("something new", "StatusCode.INTERNAL", "internal"),
    ("something new", None, "internal"),
    # a message that only reads like a model's refusal is tritonserver's, not the client's
    ("input 'max_tokens' is out of range: use 1 to 512", "StatusCode.INVALID_ARGUMENT", "internal"),
])
def test_tritonservers_own_text_maps_to_a_kind_by_its_words_or_status(message, status, kind):
    assert classify(message, status) == kind


#: Internals of the server a client never reads: tritonserver's instance and internal model names, its wording.
INTERNALS = ("lora_adapter", "tokenizer_cache", "ensemble", "instance", "Stub", "request id", "for model")


@pytest.mark.parametrize("message, status", [
    # tritonserver's own text on a request: what the python backend says of an exception out of execute, and its
    # own check of a request the front built (the front's fault): never the client's, whatever the status says.
    ("Failed to process the request(s) for model instance 'lora_adapter_0_0', message: TypeError: bad", None),
    ("[request id: <id_unknown>] unexpected shape for input 'input_ids' for model 'lora_adapter'. Expected [-1], "
     "got [1,2]", "StatusCode.INVALID_ARGUMENT"),
    ("[request id: <id_unknown>] inference request batch-size must be <= 8 for 'tokenizer_cache'",
     "StatusCode.INVALID_ARGUMENT"),
    ("Stub process 'lora_adapter_0_0' is not healthy.", None),
    ("Request for unknown model: 'lora_adapter' has no available versions", "StatusCode.NOT_FOUND"),
])
def test_tritonservers_own_text_is_a_failure_on_the_server_side_that_no_client_reads(message, status):
    error = openai_error(engine_error(message, status))
    assert error.status in (500, 503)
    assert not any(word in error.message for word in INTERNALS), error.message


@pytest.mark.parametrize("message, status, kind, text", [
    # the models' own messages, written for the client, reach it without tritonserver's prefixes and the tag
    (f"in ensemble 'ensemble', [not_found] unknown adapter 'x': {UNKNOWN_ADAPTER_HINT}", None, "not_found",
     f"unknown adapter 'x': {UNKNOWN_ADAPTER_HINT}"),
    ("[request id: r1] [invalid] input 'max_tokens' is out of range: use 1 to 512", "StatusCode.INVALID_ARGUMENT",
     "invalid", "input 'max_tokens' is out of range: use 1 to 512"),
    ("in ensemble 'ensemble', [request id: r1] [busy] server busy: this instance already holds 72 requests; retry "
     "later", None, "busy", "server busy: this instance already holds 72 requests; retry later"),
    # a client's own name for an adapter is no server internal, whatever it looks like
    (f"[not_found] unknown adapter 'lora_adapter_0_0': {UNKNOWN_ADAPTER_HINT}", None, "not_found",
     f"unknown adapter 'lora_adapter_0_0': {UNKNOWN_ADAPTER_HINT}"),
])
def test_a_models_own_message_reaches_the_client_without_tritonservers_prefixes(message, status, kind, text):
    error = engine_error(message, status)
    assert (error.kind, error.message) == (kind, text)
    assert openai_error(error).message == text


@pytest.mark.parametrize("state", [s for s in _UNAVAILABLE if s is not AdapterState.RETIRED] + [AdapterState.RETIRED])
def test_an_adapter_that_is_not_live_is_not_found_with_its_reason(state):
    message = _UNAVAILABLE[state].format(name="claims", detail="bad weights")
    error = engine_error(sent(AdapterUnavailableError(message)))
    assert (error.kind, openai_error(error).status, error.message) == ("not_found", 404, message)


METRICS = """# HELP warmup_adapter_state 1 for the adapter's current lifecycle state on an instance
# TYPE warmup_adapter_state gauge
warmup_adapter_state{adapter="base",instance="lora_adapter_0_0",model="lora_adapter",state="live"} 1
warmup_adapter_state{adapter="sql",instance="lora_adapter_0_0",model="lora_adapter",state="live"} 1
warmup_adapter_state{adapter="sql",instance="lora_adapter_0_1",model="lora_adapter",state="live"} 1
warmup_adapter_state{adapter="claims",instance="lora_adapter_0_0",model="lora_adapter",state="live"} 1
warmup_adapter_state{adapter="claims",instance="lora_adapter_0_1",model="lora_adapter",state="warming"} 1
warmup_adapter_state{adapter="claims",instance="lora_adapter_0_1",model="lora_adapter",state="live"} 0
# TYPE warmup_scheduler_running_sequences gauge
warmup_scheduler_running_sequences{instance="lora_adapter_0_0",model="lora_adapter"} 3
warmup_scheduler_running_sequences{instance="lora_adapter_0_1",model="lora_adapter"} 2
# TYPE warmup_scheduler_waiting_sequences gauge
warmup_scheduler_waiting_sequences{instance="lora_adapter_0_0",model="lora_adapter"} 4
# TYPE warmup_kv_cache_bytes gauge
warmup_kv_cache_bytes{adapter="base",instance="lora_adapter_0_0",model="lora_adapter"} 100
warmup_kv_cache_bytes{adapter="sql",instance="lora_adapter_0_0",model="lora_adapter"} 300
warmup_kv_cache_bytes{adapter="sql",instance="lora_adapter_0_1",model="lora_adapter"} 200
# TYPE warmup_kv_running_bytes gauge
warmup_kv_running_bytes{instance="lora_adapter_0_0",model="lora_adapter"} 150
warmup_kv_running_bytes{instance="lora_adapter_0_1",model="lora_adapter"} 50
"""


def test_metrics_give_the_live_adapters_and_the_load_summed_over_instances():
    models, load = parse_triton_metrics(METRICS, kv_capacity_bytes=1000)
    assert models.live() == ["sql"]
    assert models.adapters["claims"] == "adapter 'claims' is warming"  # no instance named: a client reads it
    assert "base" not in models.adapters
    assert (load.running, load.waiting) == (5, 4)
    # KV use is what the running sequences hold, not the cached blocks (a warm cache is full of those, and a router
    # that read them as load would leave every warm replica out: smg's worker overload veto at 0.8).
    assert load.kv_usage == pytest.approx(200 / 2000)
    assert parse_triton_metrics(METRICS, kv_capacity_bytes=None)[1].kv_usage is None


def test_an_ensemble_request_is_the_tables_tensors_of_what_the_request_sets():
    from warmup_tools.front.engine.engine import GenerateInput
    from warmup_tools.front.engine.triton_engine import ensemble_inputs

    request = GenerateInput("hi", adapter="sql", tenant=None, tenant_key="k", sampling={"max_tokens": 4, "seed": 9})
    tensors = {name: (datatype, array.tolist()) for name, datatype, array in ensemble_inputs(request)}
    assert tensors == {"text_input": ("BYTES", [b"hi"]), "stream": ("BOOL", [True]), "max_tokens": ("INT32", [4]),
                       "seed": ("UINT64", [9]), "adapter_id": ("BYTES", [b"sql"]), "tenant_key": ("BYTES", [b"k"])}


class _Output:
    def __init__(self, datatype):
        self.datatype = datatype


class _Result:
    def __init__(self, outputs):
        self.outputs = outputs

    def get_output(self, name):
        return _Output(self.outputs[name][0])

    def as_numpy(self, name):
        return self.outputs[name][1]


def test_the_composing_pipeline_runs_the_ensembles_steps_as_its_wiring_says():
    """The front drives tokenizer_cache and embedding_cache with the ensemble's own wiring (common/wire.py)."""
    import asyncio

    import numpy as np

    from warmup_tools.front.engine.engine import GenerateInput
    from warmup_tools.front.engine.triton_engine import TritonEngine, ensemble_inputs

    answers = {"tokenizer_cache": {"input_ids": ("INT32", np.array([5, 6, 7], dtype=np.int32)),
                                   "input_length": ("INT32", np.array([3], dtype=np.int32)),
                                   "tenant_token": ("BYTES", np.array([b"acme:tok"], dtype=np.object_))},
               "embedding_cache": {"cluster_id": ("INT32", np.array([2], dtype=np.int32))}}
    calls = []

    class Engine(TritonEngine):
        async def _unary(self, model, inputs, outputs=(), parameters=None):
            assert parameters is None  # the trace context only, and tracing is off
            calls.append((model, sorted(name for name, _, _ in inputs), outputs))
            return _Result(answers[model])

    request = GenerateInput("hi", adapter="sql", tenant="acme", tenant_key="k", sampling={"temperature": 0.5})
    engine = Engine("127.0.0.1:1", "http://127.0.0.1:1/metrics")
    last = asyncio.run(engine._composing_inputs(ensemble_inputs(request)))
    assert calls == [
        ("tokenizer_cache", ["tenant_id", "tenant_key", "text_input"], ("input_ids", "input_length", "tenant_token")),
        ("embedding_cache", ["adapter_id", "prompt_tokens", "tenant_id", "tenant_token", "text_input"],
         ("cluster_id",))]
    sent = {name: (datatype, array.tolist()) for name, datatype, array in last}
    assert sent == {"input_ids": ("INT32", [5, 6, 7]), "cluster_id": ("INT32", [2]), "text_input": ("BYTES", [b"hi"]),
                    "adapter_id": ("BYTES", [b"sql"]), "tenant_id": ("BYTES", [b"acme"]),
                    "tenant_token": ("BYTES", [b"acme:tok"]), "stream": ("BOOL", [True]),
                    "temperature": ("FP32", [0.5])}


class _Call:
    """A gRPC server-streaming call as grpc.aio hands it out: its responses, then its end; records a cancel."""

    def __init__(self, responses: list) -> None:
        self._responses = list(responses)
        self.cancelled = False
        self.read_to_end = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._responses:
            return self._responses.pop(0)
        self.read_to_end = True
        raise StopAsyncIteration

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def test_a_models_final_error_ends_its_call_cleanly_instead_of_cancelling_it():
    """tritonserver 2.51 keeps a decoupled model loaded when a call is cancelled just after its final response
    (docs/fleet.md): an error, the final response of a refused request, is read to the call's end like a finished
    generation, and the client still gets the error."""
    import asyncio

    from tritonclient.grpc import service_pb2

    from warmup_tools.front.engine.engine import EngineError
    from warmup_tools.front.engine.triton_engine import TritonEngine

    call = _Call([service_pb2.ModelStreamInferResponse(error_message="[rate_limited] too many requests")])
    engine = TritonEngine("127.0.0.1:1", "http://127.0.0.1:1/metrics")
    engine._generate = lambda request, timeout: call

    async def consume() -> None:
        async for _ in engine._stream("lora_adapter", [], None):
            pass

    with pytest.raises(EngineError) as raised:
        asyncio.run(consume())
    assert raised.value.kind == ErrorKind.RATE_LIMITED
    assert call.read_to_end and not call.cancelled
