"""The generate request's wire format: both config.pbtxt files say what common/wire.py says, and its helpers."""

from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from warmup_tools.common import wire

REPOSITORY = Path(__file__).resolve().parents[3] / "model_repository"


def config(model: str) -> model_config_pb2.ModelConfig:
    text = (REPOSITORY / model / "config.pbtxt").read_text(encoding="utf-8")
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def declared(tensors) -> dict[str, tuple[str, list[int], bool]]:
    return {t.name: (model_config_pb2.DataType.Name(t.data_type), list(t.dims), getattr(t, "optional", False))
            for t in tensors}


def expected(names) -> dict[str, tuple[str, list[int], bool]]:
    return {name: (wire.DATATYPES[wire.INPUTS[name].dtype][0], list(wire.INPUTS[name].dims),
                   wire.INPUTS[name].optional) for name in names}


def outputs() -> dict[str, tuple[str, list[int], bool]]:
    return {name: (wire.DATATYPES[dtype][0], [1], False) for name, dtype in wire.GENERATE_OUTPUTS}


def test_the_ensembles_inputs_and_outputs_are_the_tables():
    ensemble = config("ensemble")
    assert declared(ensemble.input) == expected(wire.ENSEMBLE_INPUTS)
    assert declared(ensemble.output) == outputs()


def test_lora_adapters_inputs_and_outputs_are_the_tables():
    lora = config("lora_adapter")
    assert declared(lora.input) == expected(wire.LORA_ADAPTER_INPUTS)
    only = {name: (wire.DATATYPES[dtype][0], [-1], False) for name, dtype in wire.LORA_ONLY_OUTPUTS}
    assert declared(lora.output) == {**outputs(), **only}


def test_the_ensembles_steps_are_the_tables_wiring():
    steps = config("ensemble").ensemble_scheduling.step
    got = [(step.model_name, dict(step.input_map), dict(step.output_map)) for step in steps]
    assert got == [(step.model, dict(step.inputs), dict(step.outputs)) for step in wire.ENSEMBLE_STEPS]


def test_every_sampling_parameter_is_an_input_of_both_models():
    for row in wire.SAMPLING_INPUTS:
        assert row.name in wire.ENSEMBLE_INPUTS and row.name in wire.LORA_ADAPTER_INPUTS
        assert wire.ENSEMBLE_STEPS[-1].inputs[row.name] == row.name


def test_tensors_are_built_from_the_table_in_its_order_and_skip_what_is_unset():
    tensors = wire.input_tensors({"seed": 7, "text_input": "héllo", "temperature": 0.5, "top_p": None,
                                  "stream": True})
    assert [(name, dtype) for name, dtype, _ in tensors] == [
        ("text_input", "BYTES"), ("stream", "BOOL"), ("temperature", "FP32"), ("seed", "UINT64")]
    arrays = {name: array for name, _, array in tensors}
    assert arrays["text_input"].tolist() == ["héllo".encode()]
    assert arrays["seed"].dtype == np.uint64 and arrays["temperature"].dtype == np.float32


def test_a_name_that_is_no_input_is_refused():
    with pytest.raises(KeyError, match="temprature"):
        wire.input_tensors({"temprature": 0.5})


@pytest.mark.parametrize("kind", list(wire.ErrorKind))
def test_a_tagged_message_gives_back_its_kind_and_text(kind):
    assert wire.untag(wire.tag(kind, "input 'x' is out of range")) == (kind, "input 'x' is out of range")


@pytest.mark.parametrize("message", ["unknown adapter 'x'", "[request id: 1] boom", "[nope] text", "[busy]text"])
def test_a_message_without_a_tag_has_no_kind(message):
    assert wire.untag(message) == (None, message)


def test_each_bound_names_its_input_and_what_to_send():
    assert wire.INPUTS["top_p"].check(0.0) == "input 'top_p' is out of range: use a value in (0, 1] (1 for no " \
                                             "nucleus filtering)"
    assert wire.INPUTS["top_p"].check(float("nan")) is not None
    assert wire.INPUTS["top_p"].check(0.5) is None
