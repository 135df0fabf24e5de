import numpy as np
import pytest

from warmup_tools.common.errors import InvalidInputError
from warmup_tools.lora_adapter.requests import RequestLimits, parse_generate_request
from warmup_tools.triton.inputs import parse_text

LIMITS = RequestLimits(max_tokens_limit=64, default_max_tokens=8, vocab_size=100)


def ids(*values):
    return np.array(values, dtype=np.int32)


def test_parse_text_accepts_utf8_and_refuses_bad_input():
    assert parse_text({"text_input": np.array(["héllo".encode()], dtype=object)}) == "héllo"
    with pytest.raises(InvalidInputError, match="required"):
        parse_text({"text_input": None})
    with pytest.raises(InvalidInputError, match="empty"):
        parse_text({"text_input": np.array([b"   "], dtype=object)})
    with pytest.raises(InvalidInputError, match="UTF-8"):
        parse_text({"text_input": np.array([b"\xff\xfe bad"], dtype=object)})
    with pytest.raises(InvalidInputError, match="exactly one"):
        parse_text({"text_input": np.array([b"a", b"b"], dtype=object)})


def test_generate_request_defaults():
    req = parse_generate_request({"input_ids": ids(1, 2, 3)}, LIMITS)
    assert req.prompt_ids == (1, 2, 3)
    assert req.adapter is None and req.tenant == "default" and not req.stream
    assert req.sampling.max_tokens == 8 and req.sampling.greedy


def test_generate_request_values():
    req = parse_generate_request({
        "input_ids": ids(5),
        "adapter_id": np.array([b"sql"], dtype=object),
        "tenant_id": np.array([b"acme"], dtype=object),
        "max_tokens": np.array([64], dtype=np.int32),
        "stream": np.array([True]),
        "temperature": np.array([0.7], dtype=np.float32),
        "top_p": np.array([0.9], dtype=np.float32),
        "top_k": np.array([40], dtype=np.int32),
        "seed": np.array([2**64 - 1], dtype=np.uint64),
    }, LIMITS)
    assert req.adapter == "sql" and req.tenant == "acme" and req.stream
    assert req.sampling.max_tokens == 64 and not req.sampling.greedy
    assert req.sampling.seed == 2**64 - 1


@pytest.mark.parametrize("name,value,match", [
    ("max_tokens", np.array([0], dtype=np.int32), "max_tokens"),
    ("max_tokens", np.array([65], dtype=np.int32), "1 to 64"),
    ("temperature", np.array([-1.0], dtype=np.float32), "temperature"),
    ("temperature", np.array([np.nan], dtype=np.float32), "temperature"),
    ("top_p", np.array([1.5], dtype=np.float32), "top_p"),
    ("top_k", np.array([-2], dtype=np.int32), "top_k"),
])
def test_generate_request_out_of_range(name, value, match):
    with pytest.raises(InvalidInputError, match=match):
        parse_generate_request({"input_ids": ids(1), name: value}, LIMITS)


def test_generate_request_refuses_empty_and_out_of_vocab_ids():
    with pytest.raises(InvalidInputError, match="at least one"):
        parse_generate_request({"input_ids": ids()}, LIMITS)
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):
        parse_generate_request({"input_ids": ids(1, 100)}, LIMITS)


def test_the_warmup_plan_input_becomes_a_source_and_a_plan_id():
    from warmup_tools.kv.blocks import BlockSource

    base = {"input_ids": np.array([1, 2, 3], dtype=np.int32)}
    live = parse_generate_request(base, RequestLimits())
    assert (live.source, live.plan_id, live.is_warmup) == (BlockSource.LIVE, None, False)
    unpinned = parse_generate_request({**base, "warmup_plan": np.array([b""], dtype=np.object_)}, RequestLimits())
    assert (unpinned.source, unpinned.plan_id) == (BlockSource.WARMUP, None)
    pinned = parse_generate_request({**base, "warmup_plan": np.array([b"p1"], dtype=np.object_)}, RequestLimits())
    assert (pinned.source, pinned.plan_id) == (BlockSource.WARMUP, "p1")


def _pinned(retention=None, plan=b"p1"):
    inputs = {"input_ids": ids(1, 2, 3), "warmup_plan": np.array([plan], dtype=np.object_)}
    if retention is not None:
        inputs["warmup_retention_s"] = np.asarray(retention, dtype=np.float32)
    return inputs


def test_a_pinning_sample_carries_its_retention_or_none_for_the_caches_default():
    assert parse_generate_request(_pinned(), LIMITS).retention_s is None
    assert parse_generate_request(_pinned([90.0]), LIMITS).retention_s == 90.0
    assert parse_generate_request(_pinned([30 * 86400.0]), LIMITS).retention_s == 30 * 86400.0


@pytest.mark.parametrize("value", [0.0, -0.0, -5.0, 30 * 86400.0 + 1024, 3.4e38, np.inf, -np.inf, np.nan])
def test_a_retention_that_is_not_finite_positive_seconds_up_to_30_days_is_refused(value):
    rule = r"input 'warmup_retention_s' is out of range: use a number of seconds above 0 and at most 2592000 " \
           r"\(30 days\)"
    with pytest.raises(InvalidInputError, match=rule) as info:
        parse_generate_request(_pinned([value]), LIMITS)
    assert "inf" not in str(info.value) and "nan" not in str(info.value)


@pytest.mark.parametrize("inputs, match", [
    ({"warmup_retention_s": np.array([60.0, 60.0], dtype=np.float32)}, "exactly one value"),
    ({"warmup_retention_s": np.array([b"60"], dtype=np.object_)}, "must be a number, not a string"),
])
def test_a_retention_of_the_wrong_shape_or_type_is_refused(inputs, match):
    with pytest.raises(InvalidInputError, match=match):
        parse_generate_request({**_pinned(), **inputs}, LIMITS)


@pytest.mark.parametrize("plan", [None, b""])
def test_a_retention_without_a_plan_that_pins_is_refused(plan):
    inputs = _pinned([60.0], plan=plan or b"")
    if plan is None:
        del inputs["warmup_plan"]
    with pytest.raises(InvalidInputError, match="send it only with a non-empty 'warmup_plan'"):
        parse_generate_request(inputs, LIMITS)


@pytest.mark.parametrize("value", [1e-40, 1.4e-45, 1e-38, 1e-30, 1e-3, 0.0099, 100.5, 3.4e38, np.inf, -np.inf, np.nan,
                                   -1e-40])
def test_temperature_must_be_0_or_at_least_the_minimum_a_float32_division_survives(value):
    """Sampling divides float32 logits by the temperature: a subnormal or tiny one overflows them (1e-40
    once froze an instance). The message states the range and never echoes the value."""
    rule = r"'temperature' is out of range: use 0 \(greedy\) or 0.01 to 100"
    with pytest.raises(InvalidInputError, match=rule) as info:
        parse_generate_request({"input_ids": ids(1), "temperature": np.array([value], dtype=np.float32)}, LIMITS)
    assert "e-" not in str(info.value) and "inf" not in str(info.value) and "nan" not in str(info.value)


@pytest.mark.parametrize("value", [0.0, -0.0, 0.01, 0.5, 100.0])
def test_temperature_0_and_the_fp32_values_from_001_to_100_are_taken(value):
    req = parse_generate_request({"input_ids": ids(1), "temperature": np.array([value], dtype=np.float32)}, LIMITS)
    assert req.sampling.temperature == float(np.float32(value))


def test_text_input_is_bounded_before_it_is_decoded_like_every_models_prompt_text():
    from warmup_tools.triton.inputs import MAX_TEXT_BYTES

    base = {"input_ids": ids(1, 2)}
    ok = parse_generate_request({**base, "text_input": np.array([b"x" * MAX_TEXT_BYTES], dtype=object)}, LIMITS)
    assert ok.prompt_ids == (1, 2)
    for value in (b"\xff" * (MAX_TEXT_BYTES + 1), b"x" * (2 << 20)):  # too long wins over bad UTF-8
        with pytest.raises(InvalidInputError, match=f"'text_input' is longer than {MAX_TEXT_BYTES} bytes"):
            parse_generate_request({**base, "text_input": np.array([value], dtype=object)}, LIMITS)
    with pytest.raises(InvalidInputError, match="exactly one string"):
        parse_generate_request({**base, "text_input": np.array([b"a", b"b"], dtype=object)}, LIMITS)


def test_a_string_where_a_number_belongs_is_invalid_arg_not_an_internal_error():
    with pytest.raises(InvalidInputError, match="'top_k' must be a number"):
        parse_generate_request({"input_ids": ids(1), "top_k": np.array([b"seven"], dtype=object)}, LIMITS)


def test_repetition_penalty_is_1_unless_set_and_is_taken_as_sent():
    assert parse_generate_request({"input_ids": ids(1)}, LIMITS).sampling.repetition_penalty == 1.0
    req = parse_generate_request({"input_ids": ids(1), "repetition_penalty": np.array([1.3], dtype=np.float32)},
                                 LIMITS)
    assert req.sampling.repetition_penalty == pytest.approx(1.3)


@pytest.mark.parametrize("value", [0.0, -1.0, np.nan, np.inf, 0.001, 101.0])
def test_a_repetition_penalty_out_of_its_bound_is_refused_with_what_to_send(value):
    with pytest.raises(InvalidInputError) as info:
        parse_generate_request({"input_ids": ids(1), "repetition_penalty": np.array([value], dtype=np.float32)},
                               LIMITS)
    assert str(info.value) == "input 'repetition_penalty' is out of range: use 0.01 to 100 (1 for no penalty)"
    assert info.value.kind == "invalid"
