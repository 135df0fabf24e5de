"""The exact contract of a model's own warm-up window: the schedule built from the config as Triton hands it
to ``initialize`` (order, count, batch_size 0), the inputs it matches, the message a client reads, and the
plan ids read back from the samples."""

from __future__ import annotations

import json

import numpy as np
import pytest

from warmup_tools.triton.tensors import serialize_tensor
from warmup_tools.triton.warmup import ControlInputError, OwnWarmupSamples, own_plan_id, sample_plan_ids

REFUSED = ("input 'warmup_plan' is a control input: only this model's own warm-up samples, while it loads, may "
           "carry it; send the request without it (warm-up is planned by the operator with `warmup_tools stanzas`)")


def strings(*values):
    return np.array(list(values), dtype=object)


def _entry(model_dir, name, inputs, **fields):
    """A ``model_warmup`` entry as protobuf JSON (zero values omitted, like Triton's), its data files written."""
    (model_dir / "warmup").mkdir(parents=True, exist_ok=True)
    specs = {}
    for input_name, (data_type, array) in inputs.items():
        file = f"{name}__{input_name}"
        (model_dir / "warmup" / file).write_bytes(serialize_tensor(array, data_type))
        specs[input_name] = {"data_type": data_type, "dims": [str(d) for d in array.shape], "input_data_file": file}
    return {"name": name, "inputs": specs, **fields}


def _request(plan=b"p1", tenant=b"acme"):
    return {"tenant_id": strings(tenant), "warmup_plan": strings(plan)}


def _sample_inputs(plan=b"p1", tenant=b"acme"):
    return {"tenant_id": ("TYPE_STRING", strings(tenant)), "warmup_plan": ("TYPE_STRING", strings(plan))}


def test_from_args_reads_the_config_and_folder_triton_hands_initialize(tmp_path):
    config = {"name": "m", "model_warmup": [_entry(tmp_path, "a", _sample_inputs(), batch_size=1, count=2)]}
    own = OwnWarmupSamples.from_args({"model_config": json.dumps(config), "model_repository": str(tmp_path)})
    assert len(own) == 1 and own.loading
    assert [own.check(_request()), own.check(_request())] == [True, True]
    assert not own.loading


def test_every_sample_is_matched_in_config_order_and_counted(tmp_path):
    config = {"model_warmup": [_entry(tmp_path, "a", _sample_inputs(b"p1"), batch_size=1),
                               _entry(tmp_path, "b", _sample_inputs(b"p2"), batch_size=2, count=2)]}
    own = OwnWarmupSamples.from_model_config(config, tmp_path)
    assert len(own) == 2
    assert [own.check(_request(b"p1"))] + [own.check(_request(b"p2")) for _ in range(4)] == [True] * 5
    assert not own.loading


def test_a_sample_of_batch_size_0_is_skipped_and_the_next_one_still_counts(tmp_path):
    config = {"model_warmup": [_entry(tmp_path, "skipped", _sample_inputs(b"p0"), count=3),  # batch_size 0
                               _entry(tmp_path, "run", _sample_inputs(b"p1"), batch_size=1)]}
    own = OwnWarmupSamples.from_model_config(config, tmp_path)
    assert len(own) == 1
    assert own.check(_request(b"p1")) is True and not own.loading


def test_an_absent_count_runs_a_sample_once(tmp_path):
    own = OwnWarmupSamples.from_model_config({"model_warmup": [_entry(tmp_path, "a", _sample_inputs(),
                                                                      batch_size=3)]}, tmp_path)
    assert [own.claim(_request()) for _ in range(3)] == [True] * 3 and not own.loading


def test_a_request_with_an_input_no_sample_has_is_not_a_sample_and_closes_the_window(tmp_path):
    own = OwnWarmupSamples.from_model_config({"model_warmup": [_entry(tmp_path, "a", _sample_inputs(),
                                                                      batch_size=1)]}, tmp_path)
    assert own.claim({**_request(), "text_input": strings(b"hi")}) is False
    assert not own.loading


def test_a_client_s_control_input_gets_the_exact_message(tmp_path):
    own = OwnWarmupSamples.from_model_config({}, tmp_path)
    with pytest.raises(ControlInputError) as refused:
        own.check(_request())
    assert str(refused.value) == REFUSED and refused.value.code == "INVALID_ARG"


def test_sample_plan_ids_reads_only_string_plans_with_a_data_file(tmp_path):
    as_ints = {"warmup_plan": ("TYPE_INT32", np.array([1, 65], dtype=np.int32))}  # as strings: b"A" and a stub
    int_plan = _entry(tmp_path, "ints", as_ints, batch_size=1)
    zero_plan = {"name": "zeros", "batch_size": 1,
                 "inputs": {"warmup_plan": {"data_type": "TYPE_STRING", "dims": ["1"], "zero_data": True}}}
    assert sample_plan_ids({"model_warmup": [int_plan, zero_plan]}, tmp_path) == set()

    several = _entry(tmp_path, "two", {"warmup_plan": ("TYPE_STRING", strings(b"p1", b"", b"p2"))}, batch_size=1)
    broken = _entry(tmp_path, "utf8", {"warmup_plan": ("TYPE_STRING", strings(b"p\xff"))}, batch_size=1)
    assert sample_plan_ids({"model_warmup": [several, broken]}, tmp_path) == {"p1", "p2", "p\ufffd"}
    args = {"model_config": json.dumps({"model_warmup": [several]}), "model_repository": str(tmp_path)}
    assert own_plan_id(args) is None  # several plans: none is the model's own
