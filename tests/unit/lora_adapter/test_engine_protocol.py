"""One conformance test of :class:`~warmup_tools.lora_adapter.engine_api.SequenceEngine`, run against each forward
``make_engine`` builds: the packed default, the Hugging Face reference (``engine_forward=hf``) and the simulated one
(``engine=simulated``), on the demo LM and adapters in float32.

Everything goes through the protocol as the scheduler calls it (and ``held_sequences``, which every forward has for
the tests): a sequence's life from open to close, a prefix stored by one sequence and loaded by another, a forward
that fails part-way, adapters refused, unloaded and loaded again.
"""

from __future__ import annotations

import pytest

from warmup_tools.common.errors import AssetError, UnknownAdapterError
from warmup_tools.demo.prompts import SYSTEM_PROMPTS
from warmup_tools.kv.blocks import BlockSource
from warmup_tools.kv.config import KVCacheConfig
from warmup_tools.lora_adapter.engine_api import ForwardRow, SequenceEngine
from warmup_tools.lora_adapter.engines import make_engine
from warmup_tools.lora_adapter.hf import HfEngine
from warmup_tools.lora_adapter.packed import PackedEngine
from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams
from warmup_tools.lora_adapter.settings import EngineConfig
from warmup_tools.lora_adapter.simulated import SimulatedEngine

#: Per forward: the settings that select it, the class make_engine must build, and where a test makes its next
#: forward fail once the computation ran (the last thing before the forward would commit its rows).
FORWARDS = {
    "packed": ({"forward": "packed"}, PackedEngine, lambda engine: (engine._packed, "forward")),
    "hf": ({"forward": "hf"}, HfEngine, lambda engine: (engine.model, "lm")),
    # NOTE: a modelled step of a millionth of its time: the test does not wait on the profile.
    "simulated": ({"kind": "simulated", "speedup": 1e6}, SimulatedEngine, lambda engine: (engine, "step_seconds")),
}
TENANT = "conformance"


@pytest.fixture(scope="module", params=list(FORWARDS))
def forward(request, demo_assets) -> tuple[str, SequenceEngine]:
    """(name, engine) for each forward, with a KV prefix cache."""
    options, cls, _ = FORWARDS[request.param]
    engine = make_engine(EngineConfig(base_model=demo_assets.lm_dir, adapter_root=demo_assets.adapter_root,
                                      dtype="float32", kv=KVCacheConfig(budget_bytes=64 << 20), **options))
    assert type(engine) is cls  # the forward asked for, not a fallback
    return request.param, engine


def _request(engine, text: str, adapter: str | None = "support", max_tokens: int = 4) -> GenerateRequest:
    return GenerateRequest(tuple(engine.encode(text)), adapter, TENANT, True, SamplingParams(max_tokens=max_tokens))


def _greedy(engine, seq_id: int, request: GenerateRequest) -> int:
    return engine.sample(seq_id, request.sampling, request.prompt_ids)


def _break_next_forward(name: str, engine, monkeypatch) -> None:
    """Make the engine's forwards run their computation and then raise, until ``monkeypatch`` undoes it."""
    target, attribute = FORWARDS[name][2](engine)
    real = getattr(target, attribute)

    def failing(*args, **kwargs):
        real(*args, **kwargs)
        raise RuntimeError("injected fault after the computation")

    monkeypatch.setattr(target, attribute, failing)


def test_a_sequence_lives_through_the_protocol_and_a_second_one_reuses_its_stored_prefix(forward):
    """open, load_prefix(None), a prompt forwarded in two chunks, sample, a decode step, store_prefix; a second
    sequence loads the stored prefix, forwards the rest and samples the same token; release and close leave
    nothing held."""
    _, engine = forward
    cache = engine.prefix_cache
    request = _request(engine, SYSTEM_PROMPTS["support"] + "User: where is my last invoice?\nAssistant:")
    engine.check_request(request)
    prompt, size = request.prompt_ids, cache.block_size
    hashes, public = engine.block_hashes(request)
    assert len(hashes) == len(prompt) // size >= 3
    held_before = engine.held_sequences()

    engine.open(1, request, sampled=False)
    engine.load_prefix(1, None)
    split = 2 * size + 3  # the first chunk ends inside a block
    engine.forward([ForwardRow(1, prompt[:split], 0, request.adapter)])
    engine.forward([ForwardRow(1, prompt[split:], split, request.adapter)])
    first = _greedy(engine, 1, request)
    engine.store_prefix(1, hashes, start_block=0, source=BlockSource.LIVE, plan_id=None, owner=request.adapter,
                        tenant=TENANT, public_blocks=public, tokens=prompt)
    engine.forward([ForwardRow(1, (first,), len(prompt), request.adapter)])  # a decode step on top
    second = _greedy(engine, 1, request)
    assert 0 <= first < engine.vocab_size and 0 <= second < engine.vocab_size

    match = cache.match(hashes, TENANT)
    try:
        assert match.num_tokens == len(hashes) * size  # every block the first sequence stored
        engine.open(2, request, sampled=False)
        engine.load_prefix(2, match)
        engine.forward([ForwardRow(2, prompt[match.num_tokens:], match.num_tokens, request.adapter)])
        assert _greedy(engine, 2, request) == first  # computed on the loaded blocks: the same next token
        engine.forward([ForwardRow(2, (first,), len(prompt), request.adapter)])
        assert _greedy(engine, 2, request) == second
    finally:
        cache.release(match)

    engine.release(1)
    engine.release(2)
    engine.close(1)
    engine.close(2)
    engine.close(2)  # closing twice is harmless
    engine.forget_batches()
    assert engine.held_sequences() == held_before == 0


def test_a_forward_that_raises_leaves_every_row_as_it_was(forward, monkeypatch):
    """A batch of a prefill chunk and a decode row fails after its computation ran: running the same batch again
    gives what one that never failed gives."""
    name, engine = forward
    request = _request(engine, SYSTEM_PROMPTS["legal"] + "User: is clause 4 binding?\nAssistant:", adapter="legal")
    other = _request(engine, "User: a short question\nAssistant:", adapter=None)
    prompt, split = request.prompt_ids, 17

    def first_steps(a: int, b: int) -> int:
        """Sequence ``a``'s first chunk, sequence ``b``'s whole prompt and first token: ``b``'s token."""
        engine.open(a, request, sampled=False)
        engine.open(b, other, sampled=False)
        engine.load_prefix(a, None)
        engine.load_prefix(b, None)
        engine.forward([ForwardRow(a, prompt[:split], 0, request.adapter),
                        ForwardRow(b, other.prompt_ids, 0, other.adapter)])
        return _greedy(engine, b, other)

    def batch(a: int, b: int, token: int) -> list[ForwardRow]:
        return [ForwardRow(a, prompt[split:], split, request.adapter),
                ForwardRow(b, (token,), len(other.prompt_ids), other.adapter)]

    token = first_steps(1, 2)
    held = engine.held_sequences()
    with monkeypatch.context() as patch:
        _break_next_forward(name, engine, patch)
        with pytest.raises(RuntimeError, match="injected fault"):
            engine.forward(batch(1, 2, token))
    assert engine.held_sequences() == held
    engine.forward(batch(1, 2, token))
    retried = (_greedy(engine, 1, request), _greedy(engine, 2, other))

    assert first_steps(3, 4) == token
    engine.forward(batch(3, 4, token))
    assert (_greedy(engine, 3, request), _greedy(engine, 4, other)) == retried
    for seq_id in (1, 2, 3, 4):
        engine.close(seq_id)
    engine.forget_batches()
    assert engine.held_sequences() == 0


def test_an_unknown_adapter_is_refused_by_check_request(forward):
    _, engine = forward
    assert not engine.has_adapter("no-such-adapter")
    with pytest.raises(UnknownAdapterError, match="unknown adapter 'no-such-adapter'"):
        engine.check_request(_request(engine, "User: hello", adapter="no-such-adapter"))
    engine.check_request(_request(engine, "User: hello", adapter="sql"))


def test_an_adapter_unloads_and_loads_again_with_the_same_identity_and_tokens(forward):
    """Unloaded, an adapter is refused; loaded again from the same files it has the same fingerprint and gives
    the same tokens. A folder that holds no adapter fails the load and leaves nothing loaded."""
    _, engine = forward
    request = _request(engine, "User: select the ten largest orders\nAssistant:", adapter="sql")
    scope = engine.block_hashes(request)

    def next_token(seq_id: int) -> int:
        engine.open(seq_id, request, sampled=False)
        engine.load_prefix(seq_id, None)
        engine.forward([ForwardRow(seq_id, request.prompt_ids, 0, request.adapter)])
        token = _greedy(engine, seq_id, request)
        engine.close(seq_id)
        return token

    before = next_token(1)
    engine.unload_adapter("sql")
    try:
        assert not engine.has_adapter("sql")
        with pytest.raises(UnknownAdapterError):
            engine.check_request(request)
        engine.unload_adapter("sql")  # unloading what is not loaded is harmless
    finally:
        engine.load_adapter("sql")
    assert engine.has_adapter("sql")
    engine.check_request(request)
    assert engine.block_hashes(request) == scope  # the same files: the same fingerprint in every block hash
    assert next_token(2) == before
    with pytest.raises(AssetError):
        engine.load_adapter("missing", "no-such-folder")
    assert not engine.has_adapter("missing")
    engine.forget_batches()
    assert engine.held_sequences() == 0
