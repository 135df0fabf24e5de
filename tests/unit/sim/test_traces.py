"""The shipped public traces and their scaling: lengths, arrivals, shared prefixes kept exact in text."""

from __future__ import annotations

import gzip
import hashlib

import pytest

from warmup_tools.common.errors import ConfigError
from warmup_tools.sim.traces import (
    TRACES,
    TracePrompts,
    TraceRequest,
    TraceScale,
    load_trace,
    prefix_reuse,
    scale_request,
)

SHA256 = {"conversation": "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
          "synthetic": "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131"}


@pytest.mark.parametrize("name", sorted(TRACES))
def test_the_shipped_traces_are_the_published_files(name):
    assert hashlib.sha256(gzip.decompress(TRACES[name].path.read_bytes())).hexdigest() == SHA256[name]


def test_a_request_keeps_its_blocks_and_gets_the_scaled_length():
    row = {"timestamp": 30535, "input_length": 6472, "output_length": 26, "hash_ids": list(range(13))}
    r = scale_request(row, 512, TraceScale(block_tokens=16, speedup=2.0, output_scale=0.5))
    # 12 whole blocks of 16, and the last block's 328 of 512 tokens as ceil(328 * 16 / 512) = 11.
    assert r == TraceRequest(30535 / 1000 / 2, tuple(range(13)), 12 * 16 + 11, 13)
    assert scale_request({**row, "output_length": 0}, 512, TraceScale()).output_tokens == 1
    assert scale_request({**row, "output_length": 10_000}, 512, TraceScale(max_output_tokens=8)).output_tokens == 8


@pytest.mark.parametrize("row", [
    {"timestamp": 0, "input_length": 6472, "output_length": 26, "hash_ids": list(range(12))},  # one block short
    {"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1, 2]},  # one block too many
    {"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": []},
    {"timestamp": 0, "input_length": "x", "output_length": 2, "hash_ids": [1]},
    {"input_length": 10, "output_length": 2, "hash_ids": [1]},
])
def test_a_line_that_is_not_a_trace_request_is_refused(row):
    with pytest.raises(ConfigError):
        scale_request(row, 512, TraceScale())


def test_a_window_of_a_trace_is_read_in_order_and_rebased_to_its_start():
    scale = TraceScale(start_s=600, duration_s=60, speedup=4.0, max_input_tokens=10**9)
    window = load_trace("conversation", scale)
    assert 100 < len(window) < 400  # about 3.4 requests a second
    assert [r.at_s for r in window] == sorted(r.at_s for r in window)
    assert 0 <= window[0].at_s and window[-1].at_s < 60 / 4
    assert len(load_trace("conversation", TraceScale(limit=25))) == 25
    short = load_trace("synthetic", TraceScale(limit=200, max_input_tokens=256))
    assert short and max(r.input_tokens for r in short) <= 256
    with pytest.raises(ConfigError, match="unknown trace"):
        load_trace("toolagent")


def test_the_whole_conversation_trace_reuses_the_share_of_blocks_it_was_published_with():
    requests = load_trace("conversation", TraceScale(max_input_tokens=10**9))
    assert len(requests) == 12_031
    assert prefix_reuse(requests) == pytest.approx(0.366, abs=0.001)
    assert prefix_reuse([]) == 0.0


def test_prompts_are_exactly_their_scaled_tokens_and_shared_blocks_are_shared_tokens(demo_assets):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_assets.root / "lm")
    prompts = TracePrompts(tokenizer, block_tokens=16)
    a = TraceRequest(0.0, (7, 8, 9), 16 * 2 + 5, 4)
    b = TraceRequest(1.0, (7, 8, 10, 11), 16 * 4, 4)
    ids_a = tokenizer.encode(prompts.prompt(a), add_special_tokens=False)
    ids_b = tokenizer.encode(prompts.prompt(b), add_special_tokens=False)
    assert len(ids_a) == a.input_tokens and len(ids_b) == b.input_tokens
    assert ids_a[:32] == ids_b[:32] and ids_a[32] != ids_b[32]
    # The same id is the same text in another instance (another process): seeded by the id alone.
    assert TracePrompts(tokenizer, block_tokens=16).prompt(a) == prompts.prompt(a)
