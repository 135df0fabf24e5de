"""Only a model's own warm-up samples, run while it loads, may carry the warmup_plan control input."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from warmup_tools.planning.stanzas import WarmupInput, WarmupSample, string_input, write_model_warmup
from warmup_tools.triton.warmup import ControlInputError, OwnWarmupSamples

CONFIG = 'name: "lora_adapter"\nbackend: "python"\nmax_batch_size: 0\n'


def _model(tmp_path, samples, edit=lambda text: text):
    model = tmp_path / "lora_adapter"
    model.mkdir()
    (model / "config.pbtxt").write_text(CONFIG)
    write_model_warmup(model, samples)
    (model / "config.pbtxt").write_text(edit((model / "config.pbtxt").read_text()))
    # The config as Triton hands it to initialize(): the protobuf as JSON.
    config = text_format.Parse((model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    return OwnWarmupSamples.from_model_config(json_format.MessageToDict(config, preserving_proto_field_name=True),
                                              model)


def _inputs(**values):
    names = ("input_ids", "adapter_id", "tenant_id", "max_tokens", "warmup_plan", "warmup_retention_s")
    return {name: values.get(name) for name in names}


SAMPLE = WarmupSample("kv_0000", (
    WarmupInput("input_ids", "TYPE_INT32", np.arange(5, 37, dtype=np.int32)),
    string_input("adapter_id", "legal"), string_input("tenant_id", "acme"),
    WarmupInput("max_tokens", "TYPE_INT32", np.array([1], dtype=np.int32)), string_input("warmup_plan", "p1"),
))


def test_the_model_s_own_sample_may_carry_warmup_plan(tmp_path):
    own = _model(tmp_path, [SAMPLE])
    assert len(own) == 1
    request = _inputs(input_ids=np.arange(5, 37, dtype=np.int32), adapter_id=np.array([b"legal"], dtype=object),
                      tenant_id=np.array([b"acme"], dtype=object), max_tokens=np.array([1], dtype=np.int32),
                      warmup_plan=np.array([b"p1"], dtype=object))
    assert own.check(request) is True
    assert own.check({**request, "warmup_plan": None}) is False  # a live request: nothing to check
    with pytest.raises(ControlInputError):  # its one run is over: the model is READY, the sample a replay
        own.check(request)


@pytest.mark.parametrize("change", [
    {"warmup_plan": np.array([b"other-plan"], dtype=object)},  # unpin the operator's plan
    {"input_ids": np.arange(100, 132, dtype=np.int32)},  # pin blocks of its own choosing
    {"tenant_id": np.array([b"globex"], dtype=object)},  # in another tenant's name
    {"adapter_id": None},  # one input fewer
    {"max_tokens": np.array([2], dtype=np.int32)},  # any other byte
])
def test_a_client_request_with_warmup_plan_is_refused(tmp_path, change):
    own = _model(tmp_path, [SAMPLE])
    request = _inputs(input_ids=np.arange(5, 37, dtype=np.int32), adapter_id=np.array([b"legal"], dtype=object),
                      tenant_id=np.array([b"acme"], dtype=object), max_tokens=np.array([1], dtype=np.int32),
                      warmup_plan=np.array([b"p1"], dtype=object))
    with pytest.raises(ControlInputError, match="'warmup_plan' is a control input: only this model's own warm-up "
                                                "samples, while it loads, may carry it"):
        own.check({**request, **change})


RETAINED = WarmupSample("kv_0001", (*SAMPLE.inputs,
                                    WarmupInput("warmup_retention_s", "TYPE_FP32", np.array([600.0], np.float32))))


def _retained_request(**change):
    return {**_request(), "warmup_retention_s": np.array([600.0], dtype=np.float32), **change}


def test_the_model_s_own_sample_may_carry_its_retention(tmp_path):
    own = _model(tmp_path, [RETAINED])
    assert own.check(_retained_request()) is True


@pytest.mark.parametrize("change", [
    {"warmup_retention_s": np.array([30 * 86400.0], dtype=np.float32)},  # hold the plan's pins longer
    {"warmup_plan": None},  # a retention alone
    {"warmup_plan": np.array([b"other-plan"], dtype=object)},
])
def test_a_client_request_with_warmup_retention_s_is_refused(tmp_path, change):
    own = _model(tmp_path, [RETAINED])
    with pytest.raises(ControlInputError, match="input '(warmup_plan|warmup_retention_s)' is a control input: "
                                                "only this model's own warm-up samples, while it loads, may carry it"):
        own.check(_retained_request(**change))


def test_after_load_a_request_with_only_a_retention_is_refused_naming_it(tmp_path):
    own = _model(tmp_path, [RETAINED])
    assert own.check(_retained_request()) is True  # the one run of the samples: the model is READY now
    with pytest.raises(ControlInputError, match="input 'warmup_retention_s' is a control input"):
        own.check({**_retained_request(), "warmup_plan": None})


def test_a_model_without_samples_refuses_every_control_input(tmp_path):
    own = _model(tmp_path, [])
    with pytest.raises(ControlInputError):
        own.check({"text_input": np.array([b"hi"], dtype=object), "warmup_plan": np.array([b""], dtype=object)})


def test_the_plan_of_the_model_s_own_samples_is_read_back_for_snapshot_restore(tmp_path):
    import json

    from warmup_tools.triton.warmup import own_plan_id, sample_plan_ids

    _model(tmp_path, [SAMPLE])
    model = tmp_path / "lora_adapter"
    config = text_format.Parse((model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    data = json_format.MessageToDict(config, preserving_proto_field_name=True)
    assert sample_plan_ids(data, model) == {"p1"}
    assert own_plan_id({"model_config": json.dumps(data), "model_repository": str(model)}) == "p1"
    assert own_plan_id({"model_config": json.dumps({"name": "x"}), "model_repository": str(model)}) is None


def _request():
    return _inputs(input_ids=np.arange(5, 37, dtype=np.int32), adapter_id=np.array([b"legal"], dtype=object),
                   tenant_id=np.array([b"acme"], dtype=object), max_tokens=np.array([1], dtype=np.int32),
                   warmup_plan=np.array([b"p1"], dtype=object))


@pytest.mark.parametrize(("count", "batch_size", "runs"), [(3, 1, 3), (0, 1, 1), (2, 2, 4), (5, 0, 0)])
def test_a_sample_is_honoured_exactly_as_often_as_triton_runs_it_at_load(tmp_path, count, batch_size, runs):
    """Triton runs each sample max(count, 1) times, batch_size requests each time, and skips batch_size 0."""
    own = _model(tmp_path, [SAMPLE], lambda text: text.replace("count: 1", f"count: {count}")
                 .replace("batch_size: 1", f"batch_size: {batch_size}"))
    assert [own.check(_request()) for _ in range(runs)] == [True] * runs
    # The same bytes after load: an ordinary client request, and warmup_plan in it is refused.
    with pytest.raises(ControlInputError):
        own.check(_request())
    assert not own.loading and own.claim({**_request(), "warmup_plan": None}) is False


def test_the_first_request_that_is_not_the_next_sample_closes_the_window(tmp_path):
    second = WarmupSample("kv_0001", (*SAMPLE.inputs[:-1], string_input("warmup_plan", "p2")))
    own = _model(tmp_path, [SAMPLE, second])
    with pytest.raises(ControlInputError):  # the second sample first: not what Triton would send
        own.check({**_request(), "warmup_plan": np.array([b"p2"], dtype=object)})
    assert not own.loading
    with pytest.raises(ControlInputError):  # closed for good: the first sample no longer counts either
        own.check(_request())


def test_a_sample_without_data_files_keeps_its_place_but_never_counts(tmp_path):
    zero = ('  {\n    name: "zeros"\n    batch_size: 1\n    count: 2\n    inputs { key: "input_ids" value: '
            '{ data_type: TYPE_INT32 dims: [ 4 ] zero_data: true } }\n  },\n')
    own = _model(tmp_path, [SAMPLE], lambda text: text.replace("model_warmup [\n", "model_warmup [\n" + zero))
    zeros = _inputs(input_ids=np.zeros(4, dtype=np.int32))
    assert [own.claim(zeros), own.claim(zeros)] == [False, False]  # Triton's two zero-data runs
    assert own.loading and own.check(_request()) is True and not own.loading
