"""The response sink (model.py's side of the scheduler) and the scheduler's metrics, with a fake pb_utils."""

from __future__ import annotations

import dataclasses
import types
import weakref

import pytest

from warmup_tools.common.errors import ServerBusyError
from warmup_tools.lora_adapter.engine_api import GenerationStep
from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams
from warmup_tools.lora_adapter.responses import ResponseQueue, ResponseSink
from warmup_tools.lora_adapter.scheduler import SchedulerStats, StepReport
from warmup_tools.triton.metrics import SchedulerMetrics

FINAL = 1


class FakeMetric:
    """Like Triton's: refuses to be used once its family was garbage collected."""

    def __init__(self, family, labels, buckets=None):
        self.family = weakref.ref(family)
        self.labels, self.value, self.observed = labels, 0, []

    def set(self, value):
        self._check()
        self.value = value

    def increment(self, value):
        self._check()
        self.value += value

    def observe(self, value):
        self._check()
        self.observed.append(value)

    def _check(self):
        if self.family() is None:
            raise RuntimeError("Invalid metric operation as the corresponding 'MetricFamily' has been deleted")


class FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    created: dict = {}

    def __init__(self, name, description, kind):
        self.name = name

    def Metric(self, labels, buckets=None):
        metric = FakeMetric(self, labels, buckets)
        FakeFamily.created[(self.name, tuple(sorted(labels.items())))] = metric
        return metric


class FakeError:
    INVALID_ARG, UNAVAILABLE, INTERNAL, CANCELLED = "invalid", "unavailable", "internal", "cancelled"

    def __init__(self, message, code):
        self.message, self.code = message, code


def fake_pb_utils():
    return types.SimpleNamespace(
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL, MetricFamily=FakeFamily, TritonError=FakeError,
        Tensor=lambda name, array: (name, array.tolist()),
        InferenceResponse=lambda output_tensors=None, error=None: {"outputs": dict(output_tensors or []),
                                                                    "error": error})


class FakeSender:
    def __init__(self):
        self.sent = []
        self.cancelled = False

    def send(self, response, flags=0):
        self.sent.append((response, flags))

    def is_cancelled(self):
        return self.cancelled


def steps(n):
    return [GenerationStep(text=f"t{i}", token_id=i, prompt_tokens=5, cached_tokens=0, output_tokens=i,
                           finished=i == n, finish_reason="length" if i == n else "", elapsed=0.01 * i)
            for i in range(1, n + 1)]


def request(stream):
    return GenerateRequest((1, 2, 3, 4, 5), "sql", "acme", stream, SamplingParams(max_tokens=3))


def test_streaming_sends_one_response_per_token_with_final_on_the_last():
    sender = FakeSender()
    sink = ResponseSink(fake_pb_utils(), sender, request(stream=True))
    for step in steps(3):
        sink.send(step)
    assert [flags for _, flags in sender.sent] == [0, 0, FINAL]
    assert [r["outputs"]["text_output"] for r, _ in sender.sent] == [[b"t1"], [b"t2"], [b"t3"]]
    assert [r["outputs"]["token_ids"] for r, _ in sender.sent] == [[1], [2], [3]]


def test_non_streaming_sends_the_whole_text_once_and_errors_carry_their_code():
    sender = FakeSender()
    sink = ResponseSink(fake_pb_utils(), sender, request(stream=False))
    for step in steps(3):
        sink.send(step)
    assert len(sender.sent) == 1 and sender.sent[0][0]["outputs"]["text_output"] == [b"t1t2t3"]
    assert sender.sent[0][0]["outputs"]["token_ids"] == [1, 2, 3]
    failing = ResponseSink(fake_pb_utils(), sender, request(stream=False))
    failing.fail(ServerBusyError("server busy"))
    response, flags = sender.sent[-1]
    assert flags == FINAL and response["error"].code == "unavailable" and "busy" in response["error"].message
    assert not sink.is_cancelled()
    sender.cancelled = True
    assert sink.is_cancelled()


class FailingSender(FakeSender):
    """A client gone after its first response."""

    def __init__(self):
        super().__init__()
        self.tried = []

    def send(self, response, flags=0):
        self.tried.append(flags)
        if self.sent:
            raise RuntimeError("the stream is closed")
        super().send(response, flags)


def test_a_queue_sends_every_requests_responses_in_order_on_its_thread_and_close_sends_what_is_queued():
    queue = ResponseQueue()
    senders = [FakeSender(), FakeSender()]
    sinks = [ResponseSink(fake_pb_utils(), s, request(stream=True), queue=queue) for s in senders]
    for a, b in zip(steps(3), steps(3)):
        sinks[0].send(a)
        sinks[1].send(b)
    sinks[1].fail(ServerBusyError("late error after the final: not sent"))
    queue.close()
    for sender in senders:
        assert [r["outputs"]["text_output"] for r, _ in sender.sent] == [[b"t1"], [b"t2"], [b"t3"]]
        assert [flags for _, flags in sender.sent] == [0, 0, FINAL]
    with pytest.raises(RuntimeError, match="shutting down"):
        ResponseSink(fake_pb_utils(), FakeSender(), request(stream=True), queue=queue).send(steps(1)[0])


def test_a_queued_send_that_fails_ends_its_sequence_at_the_next_token_and_nothing_more_goes_out():
    queue = ResponseQueue()
    sender = FailingSender()
    sink = ResponseSink(fake_pb_utils(), sender, request(stream=True), queue=queue)
    first, second, third = steps(3)
    sink.send(first)
    sink.send(second)  # fails on the queue's thread
    queue.close()  # everything queued was tried
    assert sink.is_cancelled(), "the scheduler's cancellation check sees the client gone"
    with pytest.raises(RuntimeError, match="closed"):
        sink.send(third)  # the scheduler's send raises: it drops the sequence as for a failed send of its own
    assert len(sender.sent) == 1


def test_a_queued_request_whose_send_failed_still_gets_its_final_error():
    # NOTE: Triton lets go of a decoupled request (its response factory, which keeps the model loaded) only at a
    # response with FINAL: a request whose token send failed and that got no FINAL kept lora_adapter from unloading.
    queue = ResponseQueue()
    sender = FailingSender()
    sink = ResponseSink(fake_pb_utils(), sender, request(stream=True), queue=queue)
    first, second, third = steps(3)
    sink.send(first)
    sink.send(second)  # fails on the queue's thread: the client is gone
    queue.close()
    queue = sink.queue = ResponseQueue()
    with pytest.raises(RuntimeError, match="closed"):
        sink.send(third)  # the scheduler drops the sequence ...
    sink.fail(RuntimeError("the stream is closed"))  # ... and ends it (Scheduler._finish)
    queue.close()
    assert sender.tried == [0, 0, FINAL], "no token after the failed send, but the final error is tried"
    assert [flags for _, flags in sender.sent] == [0]


def test_scheduler_metrics_send_gauges_at_once_and_counts_every_flush_or_when_idle():
    clock = [0.0]
    metrics = SchedulerMetrics(fake_pb_utils(), "lora_adapter", "lora_adapter_0_0", flush_s=1.0,
                               clock=lambda: clock[0])
    stats = SchedulerStats(running=3, waiting=1, preemptions=2, output_tokens={"": 4, "sql": 5})
    scheduler = types.SimpleNamespace(stats=stats)
    created = FakeFamily.created
    labels = (("instance", "lora_adapter_0_0"), ("model", "lora_adapter"))
    sql_labels = (("adapter", "sql"), ("model", "lora_adapter"))

    metrics.observe(StepReport(batch_size=3, seconds=0.02), scheduler)
    assert created[("warmup_scheduler_running_sequences", labels)].value == 3
    assert created[("warmup_scheduler_steps_total", labels)].value == 0  # counted, not sent yet
    assert ("warmup_output_tokens_total", sql_labels) not in created
    stats.output_tokens["sql"] = 7
    stats.running = 2
    clock[0] = 1.0  # a flush interval later
    metrics.observe(StepReport(batch_size=2, seconds=0.01), scheduler)
    assert created[("warmup_scheduler_running_sequences", labels)].value == 2
    assert created[("warmup_scheduler_waiting_sequences", labels)].value == 1
    assert created[("warmup_scheduler_steps_total", labels)].value == 2
    assert created[("warmup_scheduler_step_sequences_total", labels)].value == 5
    assert created[("warmup_scheduler_step_seconds_total", labels)].value == pytest.approx(0.03)
    assert created[("warmup_scheduler_preemptions_total", (("model", "lora_adapter"),))].value == 2
    base = created[("warmup_output_tokens_total", (("adapter", "base"), ("model", "lora_adapter")))]
    assert (created[("warmup_output_tokens_total", sql_labels)].value, base.value) == (7, 4)

    stats.output_tokens["sql"] = 9
    metrics.observe(StepReport(batch_size=1, seconds=0.01), scheduler)  # within the interval: held
    assert created[("warmup_output_tokens_total", sql_labels)].value == 7
    stats.running = stats.waiting = 0
    metrics.observe(StepReport(batch_size=1, seconds=0.01), scheduler)  # idle: everything sent at once
    assert created[("warmup_output_tokens_total", sql_labels)].value == 9
    assert created[("warmup_scheduler_steps_total", labels)].value == 4
    assert created[("warmup_scheduler_running_sequences", labels)].value == 0


def test_heat_metrics_stay_bounded_whatever_adapters_clients_name():
    import dataclasses

    from warmup_tools.triton.metrics import HeatMetrics

    @dataclasses.dataclass
    class Entry:
        cluster_id: int
        adapter: str
        window_s: float
        requests: float

    heat = HeatMetrics(fake_pb_utils(), "i0", top=5, max_series=12)
    for round_ in range(100):  # every round new adapter names (as a flood of clients might send)
        heat.publish([Entry(c, f"adapter-{round_}-{c}", w, 10.0 + c) for c in range(5) for w in (60.0, 3600.0)])
        assert heat.series <= 12
    other = FakeFamily.created[("warmup_heat_requests", tuple(sorted(
        {"cluster": "other", "adapter": "other", "window": "60s", "instance": "i0"}.items())))]
    assert other.value == sum(10.0 + c for c in range(5))  # the last round, summed into the overflow series


def test_request_log_skips_the_sidecars_probes():
    from warmup_tools.common.records import PROBE_TENANT

    class FakeLog:
        def __init__(self):
            self.records = []

        def log(self, record):
            self.records.append(record)
            return True

    log = FakeLog()
    for tenant in ("acme", PROBE_TENANT):
        req = GenerateRequest((1, 2, 3, 4, 5), "sql", tenant, False, SamplingParams(max_tokens=3))
        sink = ResponseSink(fake_pb_utils(), FakeSender(), req, request_log=log, prompt_text="hi")
        for step in steps(3):
            sink.send(step)
    assert [r.tenant for r in log.records] == ["acme"]


def test_cached_tokens_can_be_withheld_from_clients():
    def sent(expose):
        sender = FakeSender()
        sink = ResponseSink(fake_pb_utils(), sender, request(stream=True), expose_cached_tokens=expose)
        for step in steps(2):
            sink.send(dataclasses.replace(step, cached_tokens=4))
        return [r["outputs"]["cached_tokens"] for r, _ in sender.sent]

    assert sent(True) == [[4], [4]] and sent(False) == [[0], [0]]


def test_a_request_gets_exactly_one_final_response_whatever_fails_after_it():
    for stream in (True, False):
        sender = FakeSender()
        sink = ResponseSink(fake_pb_utils(), sender, request(stream=stream))
        for step in steps(3):
            sink.send(step)
        sink.fail(RuntimeError("the request log could not be written"))  # after the last token: no second final
        sink.fail(ServerBusyError("server busy"))
        assert [flags for _, flags in sender.sent].count(FINAL) == 1
        assert all(response["error"] is None for response, _ in sender.sent)
    sender = FakeSender()
    sink = ResponseSink(fake_pb_utils(), sender, request(stream=True))
    sink.send(steps(3)[0])
    sink.fail(RuntimeError("sampling failed"))  # mid-stream: the error is the final response, once
    sink.fail(ServerBusyError("server busy"))
    assert [flags for _, flags in sender.sent] == [0, FINAL]
    assert sender.sent[-1][0]["error"].code == "internal"
    assert "sampling" not in sender.sent[-1][0]["error"].message  # the exception text stays in the server log


def test_the_request_log_keeps_a_chat_request_s_role_spans():
    class FakeLog:
        records: list = []

        def log(self, record):
            self.records.append(record)
            return True

    roles = (("system", 0, 10), ("user", 10, 20))
    req = GenerateRequest((1, 2, 3), None, "acme", True, SamplingParams(max_tokens=2))
    sink = ResponseSink(fake_pb_utils(), FakeSender(), req, request_log=FakeLog(), prompt_text="x" * 20, roles=roles)
    for step in steps(2):
        sink.send(step)
    assert FakeLog.records[-1].roles == roles and FakeLog.records[-1].to_json()["roles"][0] == ["system", 0, 10]
