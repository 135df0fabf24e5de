"""The generation engine on the demo LM and adapters, without a server: requests served through the scheduler
(the only way the engine serves) reuse the prefix cache within their scope, and the forward computes a row
alone what it computes in a batch."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.unit.lora_adapter.conftest import serve
from warmup_tools.common.errors import InvalidInputError, UnknownAdapterError
from warmup_tools.demo.prompts import SYSTEM_PROMPTS
from warmup_tools.kv.blocks import BlockSource
from warmup_tools.kv.config import KVCacheConfig
from warmup_tools.lora_adapter.engines import make_engine
from warmup_tools.lora_adapter.hf import HfEngine
from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams
from warmup_tools.lora_adapter.settings import EngineConfig


@pytest.fixture(scope="module")
def engine(demo_assets):
    return make_engine(EngineConfig(base_model=demo_assets.lm_dir, adapter_root=demo_assets.adapter_root,
                                   kv=KVCacheConfig(budget_bytes=64 << 20)))


@pytest.fixture(scope="module")
def plain_engine(demo_assets):
    """The Hugging Face forward (``engine_forward=hf``), no prefix cache: its batched path's own tests."""
    engine = make_engine(EngineConfig(base_model=demo_assets.lm_dir, adapter_root=demo_assets.adapter_root,
                                      kv=KVCacheConfig(budget_bytes=0), forward="hf"))
    assert type(engine) is HfEngine
    return engine


def request(engine, text, adapter="support", tenant="acme", max_tokens=12, plan=None, **sampling):
    ids = tuple(engine.tokenizer.encode(text))
    source = BlockSource.LIVE if plan is None else BlockSource.WARMUP
    return GenerateRequest(ids, adapter, tenant, True, SamplingParams(max_tokens=max_tokens, **sampling),
                           source=source, plan_id=plan or None)


def run(engine, req):
    steps = serve(engine, req)
    return "".join(s.text for s in steps), steps[-1]


def test_second_request_reuses_the_shared_prefix_and_cached_tokens_is_exact(engine):
    system = SYSTEM_PROMPTS["support"]
    _, first = run(engine, request(engine, system + "User: first question?"))
    second_req = request(engine, system + "User: another one entirely")
    _, second = run(engine, second_req)
    assert first.cached_tokens == 0
    common = 0
    first_ids = engine.tokenizer.encode(system + "User: first question?")
    for a, b in zip(first_ids, second_req.prompt_ids):
        if a != b:
            break
        common += 1
    assert second.cached_tokens == (common // 16) * 16 > 0


@pytest.mark.parametrize("adapter", [None, "support", "sql"])
def test_greedy_output_with_the_cache_equals_output_without(engine, reference, adapter):
    prompt = SYSTEM_PROMPTS["legal"] + "User: Clause 3 says what?"
    run(engine, request(engine, prompt, adapter=adapter))  # fills the cache
    req = request(engine, prompt, adapter=adapter, max_tokens=24)
    cached_text, cached = run(engine, req)
    assert cached.cached_tokens > 0
    assert cached_text == reference.generate(req).text


def test_prefix_warmed_for_one_tenant_or_adapter_is_a_miss_for_another(engine):
    prompt = SYSTEM_PROMPTS["sql"] + "User: isolation check"
    run(engine, request(engine, prompt, adapter="sql", tenant="t1"))
    assert run(engine, request(engine, prompt, adapter="sql", tenant="t2"))[1].cached_tokens == 0
    assert run(engine, request(engine, prompt, adapter="legal", tenant="t1"))[1].cached_tokens == 0
    assert run(engine, request(engine, prompt, adapter="sql", tenant="t1"))[1].cached_tokens > 0


def test_changed_adapter_weights_never_reuse_stale_kv(demo_assets, tmp_path):
    root = tmp_path / "adapters"
    shutil.copytree(demo_assets.adapter_root / "support", root / "support")
    config = EngineConfig(base_model=demo_assets.lm_dir, adapter_root=root, kv=KVCacheConfig(budget_bytes=16 << 20))
    before = make_engine(config)
    from safetensors.torch import load_file, save_file

    weights_path = root / "support" / "adapter_model.safetensors"
    weights = load_file(weights_path)
    save_file({k: v * 1.5 for k, v in weights.items()}, weights_path)
    after = make_engine(config)
    assert before.adapter_fingerprints["support"] != after.adapter_fingerprints["support"]
    prompt = tuple(before.tokenizer.encode(SYSTEM_PROMPTS["support"]))
    assert before.scope("support", "acme") != after.scope("support", "acme")
    from warmup_tools.kv.hashing import block_hashes

    assert block_hashes(prompt, 16, before.scope("support", "acme"))[0] != \
        block_hashes(prompt, 16, after.scope("support", "acme"))[0]


def test_warmup_blocks_are_pinned_under_their_plan(engine):
    prompt = SYSTEM_PROMPTS["support"] + "pinned"
    run(engine, request(engine, prompt, plan="plan-1", max_tokens=1))
    assert engine.prefix_cache.active_plan == "plan-1"
    assert engine.prefix_cache.stats.pinned_bytes > 0
    engine.prefix_cache.activate_plan(None)
    assert engine.prefix_cache.stats.pinned_bytes == 0


def test_errors(engine):
    with pytest.raises(UnknownAdapterError, match="nope"):
        run(engine, request(engine, "hi", adapter="nope"))
    long_ids = tuple([5] * engine.context_length)
    with pytest.raises(InvalidInputError, match="context"):
        run(engine, GenerateRequest(long_ids, None, "t", False, SamplingParams(max_tokens=4)))


def test_seeded_sampling_is_reproducible(engine):
    req = request(engine, "Tell me a story", temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=16)
    assert run(engine, req)[0] == run(engine, req)[0]
    other = request(engine, "Tell me a story", temperature=1.0, top_p=0.9, top_k=50, seed=8, max_tokens=16)
    assert run(engine, other)[0] != run(engine, req)[0]
    assert torch.get_num_threads() >= 1


def test_a_public_prefix_is_shared_across_tenants_and_what_follows_is_not(demo_assets):
    platform = SYSTEM_PROMPTS["support"]
    shared = make_engine(EngineConfig(base_model=demo_assets.lm_dir, adapter_root=demo_assets.adapter_root,
                                     kv=KVCacheConfig(budget_bytes=64 << 20), public_prefixes=(platform,)))
    public_tokens = shared.public_blocks(shared.tokenizer.encode(platform + "User: hi")) * 16
    assert public_tokens >= 160
    tenant_part = "User: my account number is 12345 and my invoice from March looks wrong, please check it."
    _, a = run(shared, request(shared, platform + tenant_part, tenant="acme"))
    _, b = run(shared, request(shared, platform + tenant_part, tenant="globex"))
    assert a.cached_tokens == 0
    assert b.cached_tokens == public_tokens  # the platform prompt, and not one block of acme's own text
    _, a_again = run(shared, request(shared, platform + tenant_part, tenant="acme"))
    assert a_again.cached_tokens > public_tokens  # acme's own blocks after the prefix are still acme's
    # Without the declaration nothing crosses tenants, the platform prompt included.
    private = make_engine(EngineConfig(base_model=demo_assets.lm_dir, adapter_root=demo_assets.adapter_root,
                                      kv=KVCacheConfig(budget_bytes=64 << 20)))
    run(private, request(private, platform + tenant_part, tenant="acme"))
    _, other = run(private, request(private, platform + tenant_part, tenant="globex"))
    assert other.cached_tokens == 0


@pytest.mark.parametrize("adapter", ["support", None])
def test_a_row_forwarded_alone_computes_what_it_computes_in_a_batch(plain_engine, adapter):
    """One sequence takes the single-row path (no padding, no mask, its adapter set); beside another row it
    takes the padded batch: the logits and the KV agree, prompt and decode steps alike."""
    from warmup_tools.lora_adapter.runner import BatchRow

    ids = tuple(plain_engine.encode(SYSTEM_PROMPTS["legal"] + "User: is this binding?\nAssistant:"))
    other = tuple(plain_engine.encode("User: a different, shorter prompt\nAssistant:"))
    plain_engine.forget_batches()
    alone = plain_engine.forward_batch([BatchRow(ids, 0, None, adapter)])[0]
    pair = plain_engine.forward_batch([BatchRow(other, 0, None, "sql"), BatchRow(ids, 0, None, adapter)])
    batched = pair[1]
    assert torch.allclose(alone.logits, batched.logits, atol=1e-4)
    for (k1, v1), (k2, v2) in zip(alone.kv, batched.kv):
        assert k1.shape == k2.shape == (1, k1.shape[1], len(ids), k1.shape[3])
        assert torch.allclose(k1, k2, atol=1e-4) and torch.allclose(v1, v2, atol=1e-4)
    token = int(alone.logits.argmax())
    step_alone = plain_engine.forward_batch([BatchRow((token,), len(ids), alone.kv, adapter)])[0]
    step_batched = plain_engine.forward_batch([BatchRow((5,), len(other), pair[0].kv, "sql"),
                                               BatchRow((token,), len(ids), batched.kv, adapter)])[1]
    assert torch.allclose(step_alone.logits, step_batched.logits, atol=1e-4)
    assert step_alone.kv[0][0].shape[2] == len(ids) + 1


def test_an_adapter_already_active_is_not_set_again(plain_engine, monkeypatch):
    """peft's set_adapter walks every module: a single stream must not pay it on every step."""
    from warmup_tools.lora_adapter.runner import BatchRow

    ids = tuple(plain_engine.encode("User: hello\nAssistant:"))
    out = plain_engine.forward_batch([BatchRow(ids, 0, None, "legal")])[0]
    calls = []
    real = plain_engine.model.peft.set_adapter
    monkeypatch.setattr(plain_engine.model.peft, "set_adapter", lambda name: (calls.append(name), real(name)))
    for position in range(len(ids), len(ids) + 3):
        out = plain_engine.forward_batch([BatchRow((7,), position, out.kv, "legal")])[0]
    assert calls == []
    plain_engine.forward_batch([BatchRow(ids, 0, None, "sql")])
    assert calls == ["sql"]
