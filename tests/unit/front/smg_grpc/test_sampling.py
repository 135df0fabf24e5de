"""A Generate request as the project's generate request: the sampling mapping and what is refused."""

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from warmup_tools.front.smg_grpc.sampling import (
    MAX_REQUEST_ID_CHARS,
    MAX_TOKENS_FIELD,
    GenerateLimits,
    Refusal,
    generate_args,
)

LIMITS = GenerateLimits(max_prompt_tokens=100, max_stop=2, vocab_size=4096)


def request(ids=(5, 6, 7), **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id="r1", tokenized=pb.TokenizedInput(input_ids=list(ids)), stream=True,
                              sampling_params=pb.SamplingParams(**sampling))


def refused(req: pb.GenerateRequest) -> str:
    with pytest.raises(Refusal) as raised:
        generate_args(req, LIMITS)
    assert raised.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return raised.value.message


def test_the_sampling_fields_map_onto_the_wire_names_and_unset_ones_stay_unset():
    args = generate_args(request(), LIMITS)
    assert args.input_ids == (5, 6, 7) and args.stream and args.request_id == "r1"
    assert args.sampling == {}  # proto3 zeros: top_p, top_k, repetition_penalty left to the project's defaults
    args = generate_args(request(temperature=0.7, top_p=0.9, top_k=40, repetition_penalty=1.1, max_tokens=32,
                                 seed=7, ignore_eos=True), LIMITS)
    assert args.sampling == {"temperature": pytest.approx(0.7), "top_p": pytest.approx(0.9), "top_k": 40,
                             "repetition_penalty": pytest.approx(1.1), "max_tokens": 32, "seed": 7,
                             "ignore_eos": True}


def test_what_smg_applies_itself_is_taken_within_bounds():
    args = generate_args(request(stop=["\n\n", "END"], stop_token_ids=[1], skip_special_tokens=True), LIMITS)
    assert args.sampling == {}
    assert "at most 2 strings" in refused(request(stop=["a", "b", "c"]))
    assert "at most 256 characters" in refused(request(stop=["x" * 257]))


@pytest.mark.parametrize("sampling, words", [
    ({"n": 2}, "n must be 1"),
    ({"logprobs": 1}, "log probabilities"),
    ({"prompt_logprobs": 0}, "log probabilities"),
    ({"json_schema": "{}"}, "structured output (json_schema)"),
    ({"regex": "a+"}, "structured output (regex)"),
    ({"logit_bias": {5: 1.0}}, "logit_bias"),
    ({"truncate_prompt_tokens": 10}, "truncate_prompt_tokens"),
    ({"min_p": 0.1}, "min_p"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"min_tokens": 3}, "min_tokens"),
    ({"max_tokens": 0}, f"max_tokens must be 1 to {MAX_TOKENS_FIELD}"),
    ({"max_tokens": MAX_TOKENS_FIELD + 1}, "max_tokens must be 1"),
    ({"temperature": 0.001}, "temperature is out of range"),
    ({"temperature": float("nan")}, "temperature is out of range"),
    ({"top_p": 1.5}, "top_p is out of range"),
    ({"top_k": 2**31}, "top_k must be at most"),
    ({"repetition_penalty": 1000.0}, "repetition_penalty is out of range"),
    ({"seed": -1}, "seed is out of range"),
])
def test_what_the_project_does_not_do_is_refused_with_what_to_change(sampling, words):
    assert words in refused(request(**sampling))


def test_the_request_itself_is_bounded():
    assert "token ids" in refused(pb.GenerateRequest(request_id="r", text="hello"))
    assert "at least one token id" in refused(request(ids=()))
    assert "at most 100" in refused(request(ids=range(101)))
    assert "outside the vocabulary [0, 4096)" in refused(request(ids=(1, 4096)))
    assert "request_id" in refused(pb.GenerateRequest(request_id="", tokenized=pb.TokenizedInput(input_ids=[1])))
    long_id = "x" * (MAX_REQUEST_ID_CHARS + 1)
    assert "request_id" in refused(pb.GenerateRequest(request_id=long_id,
                                                      tokenized=pb.TokenizedInput(input_ids=[1])))
    mm = request()
    mm.mm_inputs.CopyFrom(pb.MultimodalInputs(im_token_id=3))
    assert "multimodal" in refused(mm)
    kv = request()
    kv.kv_transfer_params.CopyFrom(pb.KvTransferParams(remote_host="h", remote_port=1))
    assert "KV transfer" in refused(kv)
    dp = request()
    dp.data_parallel_rank = 1
    assert "data_parallel_rank" in refused(dp)
