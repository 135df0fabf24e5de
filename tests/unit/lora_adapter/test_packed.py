"""The packed forward (the real engine's default) against the Hugging Face forward and plain peft: logits, KV,
greedy tokens, the KV pool, and which models fall back to Hugging Face."""

from __future__ import annotations

import pytest
import torch

from warmup_tools.common.errors import UnknownAdapterError
from warmup_tools.kv.config import KVCacheConfig
from warmup_tools.lora_adapter.engine_api import ForwardRow
from warmup_tools.lora_adapter.engines import make_engine
from warmup_tools.lora_adapter.hf import HfEngine
from warmup_tools.lora_adapter.packed import KVPool, PackedEngine, packed_support
from warmup_tools.lora_adapter.settings import EngineConfig


def _config(demo_assets, **overrides) -> EngineConfig:
    return EngineConfig(base_model=demo_assets.lm_dir, adapter_root=demo_assets.adapter_root, dtype="float32",
                        kv=KVCacheConfig(budget_bytes=0), **overrides)


@pytest.fixture(scope="module")
def engines(demo_assets):
    """(packed, Hugging Face) over the same model and adapters."""
    packed = make_engine(_config(demo_assets))
    hf = make_engine(_config(demo_assets, forward="hf"))
    assert type(packed) is PackedEngine and type(hf) is HfEngine
    return packed, hf


def _prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = (40, 7, 100, 64, 1, 33, 90, 12, 2, 5)
    return [torch.randint(3, 4000, (lengths[i % len(lengths)],), generator=generator).tolist() for i in range(count)]


def _run(engine, prompts, adapters, steps, *, chunk=None):
    """Every prompt prefilled (in chunks of ``chunk`` tokens, each chunk a step of the batch), then ``steps`` greedy
    decode steps, every sequence in one batch: each step's logits per sequence."""
    logits = {i: [] for i in range(len(prompts))}
    position = {i: 0 for i in range(len(prompts))}
    tokens = {i: list(p) for i, p in enumerate(prompts)}
    pending = {i: list(p) for i, p in enumerate(prompts)}
    while any(pending.values()) or min(len(v) for v in logits.values()) < steps:
        rows = []
        for i in range(len(prompts)):
            if pending[i]:
                take = pending[i][:chunk] if chunk else pending[i]
                pending[i] = pending[i][len(take):]
            elif len(logits[i]) < steps:
                take = [tokens[i][-1]]
            else:
                continue
            rows.append(ForwardRow(i, take, position[i], adapters[i % len(adapters)]))
        engine.forward(rows)
        for row in rows:
            position[row.seq_id] += len(row.token_ids)
            out = engine._logits.pop(row.seq_id)
            if not pending[row.seq_id]:
                logits[row.seq_id].append(out.clone())
                tokens[row.seq_id].append(int(out.argmax()))
    for i in range(len(prompts)):
        engine.release(i)
    engine.forget_batches()
    return logits


@pytest.mark.parametrize("chunk", [None, 16])
def test_packed_logits_match_the_hugging_face_forward_in_mixed_batches(engines, chunk):
    """Base rows and three adapters in one batch, prompts prefilled whole or in 16-token chunks beside decode
    rows: every step's logits agree with the Hugging Face forward, so greedy tokens are the same."""
    packed, hf = engines
    prompts = _prompts(10, seed=3)
    adapters = [None, "sql", None, "legal", "support"]
    got, want = _run(packed, prompts, adapters, 12, chunk=chunk), _run(hf, prompts, adapters, 12, chunk=chunk)
    for i in want:
        for a, b in zip(got[i], want[i], strict=True):
            assert torch.allclose(a, b, atol=1e-4, rtol=0)
            assert int(a.argmax()) == int(b.argmax())
    assert packed.held_sequences() == 0 and packed._pool.held == 0


@pytest.mark.parametrize("chunk", [None, 40])
def test_prefill_attention_in_query_chunks_matches_the_hugging_face_forward(engines, chunk):
    """Prefill attention run 16 query tokens at a time (each chunk over the keys up to its last token, with and
    without KV held before it): the same logits and greedy tokens as the Hugging Face forward."""
    packed, hf = engines
    assert packed._packed.prefill_chunk > 0  # on the CPU a long prefill attends in chunks by default
    held = packed._packed.prefill_chunk
    packed._packed.prefill_chunk = 16
    try:
        prompts = _prompts(6, seed=5)
        adapters = [None, "sql"]
        got, want = _run(packed, prompts, adapters, 6, chunk=chunk), _run(hf, prompts, adapters, 6, chunk=chunk)
    finally:
        packed._packed.prefill_chunk = held
    for i in want:
        for a, b in zip(got[i], want[i], strict=True):
            assert torch.allclose(a, b, atol=1e-4, rtol=0)
            assert int(a.argmax()) == int(b.argmax())


def test_a_bfloat16_linear_goes_through_onednn_where_the_cpu_has_bf16_kernels_and_stays_close():
    """``dtype=bfloat16`` on a CPU with bf16 kernels (avx512_bf16, AMX) reorders its weights for oneDNN as
    float32 does; either way the product is the dense one within bfloat16's precision."""
    from warmup_tools.lora_adapter.packed import _Linear, _onednn_packs

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=generator) * 0.05
    x = torch.randn(7, 64, generator=generator)
    want = x @ weight.t()
    assert _onednn_packs(torch.float32) == torch.backends.mkldnn.is_available()
    assert not _onednn_packs(torch.float16)
    linear = _Linear(weight.bfloat16())
    assert (linear._packed is not None) == _onednn_packs(torch.bfloat16)
    got = linear(x.bfloat16())
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.allclose(got.float(), want, atol=0.05, rtol=0.02)
    assert torch.allclose(_Linear(weight)(x), want, atol=1e-5)


def test_served_requests_match_the_reference(engines, reference):
    """Through the scheduler (chunked prefill, batching): the tokens of plain Hugging Face and peft."""
    from tests.unit.lora_adapter.conftest import serve
    from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams

    packed, _ = engines
    for text, adapter in (("User: how do I reset my password?\nAssistant:", "support"),
                          ("User: select every row\nAssistant:", "sql"), ("Hello there", None)):
        request = GenerateRequest(tuple(packed.encode(text)), adapter, "acme", True, SamplingParams(max_tokens=16))
        assert [s.token_id for s in serve(packed, request)] == reference.generate(request).tokens


def test_compute_kv_is_the_packed_forwards_kv_and_close_to_hugging_faces(engines):
    packed, hf = engines
    ids = _prompts(1, seed=9)[0]
    for adapter in (None, "legal"):
        ours, theirs = packed.compute_kv(adapter, ids), hf.compute_kv(adapter, ids)
        assert len(ours) == len(theirs)
        for (k1, v1), (k2, v2) in zip(ours, theirs):
            assert k1.shape == k2.shape == (1, k2.shape[1], len(ids), k2.shape[3])
            assert torch.allclose(k1, k2, atol=1e-4) and torch.allclose(v1, v2, atol=1e-4)
    assert packed._pool.held == 0
    with pytest.raises(UnknownAdapterError):
        packed.compute_kv("nope", ids)


def test_adapters_load_and_unload_in_the_packed_forward(demo_assets):
    engine = make_engine(_config(demo_assets, adapters=("sql",)))
    ids = _prompts(1, seed=4)[0]
    engine.load_adapter("legal")
    with_legal = engine.compute_kv("legal", ids)
    base = engine.compute_kv(None, ids)
    assert not torch.allclose(with_legal[-1][1], base[-1][1])
    engine.unload_adapter("legal")
    assert not engine.has_adapter("legal")
    with pytest.raises(UnknownAdapterError):
        engine.compute_kv("legal", ids)


def test_the_packed_engine_has_no_hugging_face_batch_path_and_shares_no_class_with_it(engines):
    packed, hf = engines
    assert not hasattr(packed, "forward_batch")
    assert not isinstance(packed, HfEngine) and not isinstance(hf, PackedEngine)


def test_a_forward_at_the_wrong_position_is_refused_and_changes_nothing(engines):
    packed, _ = engines
    packed.forward([ForwardRow(1, [5, 6, 7], 0, None)])
    packed._logits.pop(1)
    with pytest.raises(RuntimeError, match="position 2"):
        packed.forward([ForwardRow(1, [8], 2, None)])
    packed.forward([ForwardRow(1, [8], 3, None)])
    assert packed._length[1] == 4
    packed.close(1)
    assert packed.held_sequences() == 0


def test_the_pool_grows_keeps_what_it_holds_and_keeps_its_size_when_empty():
    pool = KVPool(2, 1, 4, dtype=torch.float32, device=torch.device("cpu"), max_capacity=1000)
    slots = [pool.acquire() for _ in range(3)]
    pool.ensure(10)
    for slot in slots:
        pool.buf[:, :, slot, :, :10] = float(slot + 1)
    more = [pool.acquire() for _ in range(5)]  # past the first 4 slots: grows
    pool.ensure(200)  # grows the capacity
    assert pool.slots >= 8 and pool.capacity >= 200 and pool.capacity % 64 == 0
    for slot in slots:
        assert bool((pool.buf[:, :, slot, :, :10] == slot + 1).all())
    assert len(set(slots + more)) == 8
    pool.ensure(5000)
    assert pool.capacity == 1000  # never past the context
    for slot in slots + more:
        pool.free(slot)
    assert pool.held == 0 and pool.nbytes() == pool.slots * pool.capacity * 2 * 2 * 4 * 4  # kept for the next ones
    again = pool.acquire()
    assert again in slots + more and pool.capacity == 1000
    pool.free(again)
    pool.clear()
    assert pool.buf is None and pool.nbytes() == 0


def test_which_models_the_packed_forward_runs():
    llama = {"model_type": "llama", "hidden_act": "silu", "rope_parameters": {"rope_type": "default"}}
    assert packed_support(llama) is None
    assert packed_support({**llama, "model_type": "qwen2"}) is None
    assert "model_type 'gpt2'" in packed_support({**llama, "model_type": "gpt2"})
    assert "sliding-window" in packed_support({**llama, "model_type": "mistral", "sliding_window": 4096})
    assert "rope_type 'dynamic'" in packed_support({**llama, "rope_parameters": {"rope_type": "dynamic"}})
    assert "hidden_act" in packed_support({**llama, "hidden_act": "gelu"})


def test_a_dora_adapter_is_refused_naming_the_hf_forward_and_the_engine_keeps_serving(demo_assets, tmp_path):
    import shutil

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from warmup_tools.common.errors import AssetError

    shutil.copytree(demo_assets.adapter_root / "sql", tmp_path / "sql")
    model = AutoModelForCausalLM.from_pretrained(demo_assets.lm_dir, dtype=torch.float32)
    dora = get_peft_model(model, LoraConfig(r=4, use_dora=True, target_modules=["q_proj", "v_proj"]))
    dora.save_pretrained(tmp_path / "dora")
    engine = make_engine(EngineConfig(base_model=demo_assets.lm_dir, adapter_root=tmp_path, adapters=("sql",),
                                      kv=KVCacheConfig(budget_bytes=0)))
    with pytest.raises(AssetError, match="engine_forward=hf"):
        engine.load_adapter("dora")
    assert not engine.has_adapter("dora") and engine.has_adapter("sql")
    ids = _prompts(1, seed=2)[0]
    assert len(engine.compute_kv("sql", ids)) == 6
