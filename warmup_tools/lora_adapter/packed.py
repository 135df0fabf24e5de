"""The default forward of the real engine: packed tokens, one KV pool, batched multi-LoRA.

:class:`PackedEngine` runs a :class:`~warmup_tools.lora_adapter.loaded.LoadedModel` (loaded through
``AutoModelForCausalLM`` and ``PeftModel``, as for the Hugging Face forward,
:class:`~warmup_tools.lora_adapter.hf.HfEngine`) through :class:`PackedModel`, which reads the loaded model's weights
and computes what the Hugging Face forward computes with far fewer operations. On a small model the Hugging Face path
spends most of a step dispatching operations (the padded 4D mask, per-row KV copies, peft's per-module wrappers), so
the step time is set by their count, not by the arithmetic (docs/benchmarks.md, "The engine's forward"):

- all rows' new tokens go through the linears as one ``[tokens, hidden]`` matrix (no padding, no mask tensor);
- q/k/v and gate/up are one matrix product each (the Hugging Face modules' weights become views of the fused ones,
  so nothing is held twice);
- every open sequence's KV lives in one :class:`KVPool` (``[layers, 2, slots, kv_heads, capacity, head_dim]``):
  a sequence keeps its slot while it runs, so a batch that changes copies nothing; decode rows attend in one
  batched product over the pool's slots, prefill rows one by one;
- LoRA: for each adapter in the batch, one gathered ``x[rows] @ A @ B`` per module group (q/k/v share one stacked
  A and a block-diagonal B), added into the rows of that adapter; rows without an adapter skip LoRA entirely.

Model families: Llama, Mistral without a sliding window and Qwen2 (:func:`packed_support` says why another is
not); any other model runs the Hugging Face forward (``engine_forward=hf``). The tests check the packed forward's
logits and greedy outputs against plain Hugging Face and peft (tests/unit/lora_adapter/test_packed.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F

from warmup_tools.common.errors import UNKNOWN_ADAPTER_HINT, AssetError, UnknownAdapterError
from warmup_tools.kv.blocks import BlockSource, PrefixMatch
from warmup_tools.kv.hashing import BlockHash
from warmup_tools.lora_adapter.engine_api import ForwardRow
from warmup_tools.lora_adapter.loaded import LoadedModel, ModelFacts
from warmup_tools.lora_adapter.runner import SamplingState, SequenceKV
from warmup_tools.lora_adapter.sampling import TorchSampling
from warmup_tools.lora_adapter.serving import ServingEngine, make_prefix_cache
from warmup_tools.lora_adapter.settings import EngineConfig

LOGGER = logging.getLogger(__name__)

#: Model types the packed forward computes exactly (RMSNorm, SiLU gated MLP, rotary positions, GQA).
PACKED_MODEL_TYPES = ("llama", "mistral", "qwen2")
#: Rotary scalings whose frequencies do not depend on the sequence's length.
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")
#: Capacity (tokens) is grown in multiples of this.
_GRANULE = 64
#: Query tokens per attention call of a prefill on the CPU (see PackedModel._attention).
_PREFILL_CHUNK = 128


def packed_support(model_config: dict) -> str | None:
    """Why the packed forward cannot run a model with this ``config.json`` (None: it can)."""
    model_type = model_config.get("model_type", "")
    if model_type not in PACKED_MODEL_TYPES:
        return f"model_type {model_type!r} (the packed forward runs {', '.join(PACKED_MODEL_TYPES)})"
    if model_config.get("hidden_act", "silu") != "silu":
        return f"hidden_act {model_config['hidden_act']!r}"
    if model_type == "mistral" and model_config.get("sliding_window"):
        return "sliding-window attention"
    if model_type == "qwen2" and model_config.get("use_sliding_window"):
        return "sliding-window attention"
    if model_config.get("mlp_bias"):
        return "MLP biases"
    rope = model_config.get("rope_parameters") or model_config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in _STATIC_ROPE:
        return f"rope_type {rope_type!r}"
    return None


def model_packed_support(model_dir: Path) -> str | None:
    """:func:`packed_support` of a model folder's ``config.json``."""
    return packed_support(json.loads((model_dir / "config.json").read_text()))


class KVPool:
    """Every open sequence's KV in one tensor ``[layers, 2, slots, kv_heads, capacity, head_dim]``.

    A sequence takes a slot at its first forward and gives it back when its KV is dropped. Slots and capacity grow
    (by half, in whole granules, up to ``max_capacity`` tokens) when a sequence needs more, copying what is held,
    and the tensor then keeps its size (as vLLM keeps the KV space it allocated): growing it again for every
    request costs more than the request's warm prefill. Its memory is slots x capacity tokens: the most sequences
    open at once (``max_num_seqs``, a warm prompt and a snapshot check) times the longest one's length (at most the
    model's context), rounded up to the growth step; :meth:`clear` drops it.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, *, dtype: torch.dtype, device: torch.device,
                 max_capacity: int) -> None:
        self._shape = (layers, 2, kv_heads, head_dim)
        self.dtype, self.device, self.max_capacity = dtype, device, max_capacity
        self.buf: torch.Tensor | None = None
        self._free: list[int] = []
        self._held: set[int] = set()

    @property
    def slots(self) -> int:
        return 0 if self.buf is None else self.buf.shape[2]

    @property
    def capacity(self) -> int:
        return 0 if self.buf is None else self.buf.shape[4]

    @property
    def held(self) -> int:
        return len(self._held)

    def nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.numel() * self.buf.element_size()

    def acquire(self) -> int:
        if not self._free:
            self._grow(max(4, self.slots + self.slots // 2), max(self.capacity, _GRANULE))
        slot = self._free.pop()
        self._held.add(slot)
        return slot

    def free(self, slot: int) -> None:
        self._held.discard(slot)
        self._free.append(slot)

    def clear(self) -> None:
        """Drop the tensor (no slot is held)."""
        assert not self._held
        self.buf, self._free = None, []

    def ensure(self, tokens: int) -> None:
        """Room for ``tokens`` tokens in every slot."""
        if tokens > self.capacity:
            grown = max(tokens, self.capacity + self.capacity // 2)
            self._grow(self.slots, min(self.max_capacity, -(-grown // _GRANULE) * _GRANULE))

    def _grow(self, slots: int, capacity: int) -> None:
        layers, two, kv_heads, head_dim = self._shape
        # NOTE: zeros, not empty: a batched decode multiplies every slot's values by its (zero) weights, and
        # uninitialised memory may hold NaNs, which a zero weight does not cancel.
        buf = torch.zeros((layers, two, slots, kv_heads, capacity, head_dim), dtype=self.dtype, device=self.device)
        if self.buf is not None:
            buf[:, :, :self.slots, :, :self.capacity] = self.buf
        self._free = [*range(slots - 1, self.slots - 1, -1), *self._free]
        self.buf = buf

    def layers(self, slot: int, tokens: int) -> SequenceKV:
        """Per layer ``(keys, values)`` views ``[1, kv_heads, tokens, head_dim]`` of one slot."""
        assert self.buf is not None
        return [(self.buf[i, 0, slot, :, :tokens].unsqueeze(0), self.buf[i, 1, slot, :, :tokens].unsqueeze(0))
                for i in range(self.buf.shape[0])]


@dataclasses.dataclass(slots=True)
class _Lora:
    """One adapter's weights for one module group of one layer: ``x @ a @ b`` is its delta (scaling in ``b``)."""

    a: torch.Tensor  # [in, r_total]
    b: torch.Tensor  # [r_total, out]


class _Linear:
    """``x @ weight.T`` (+ bias). On the CPU in float32 through oneDNN with the weight reordered once into its
    blocked layout (``torch.ops.mkldnn``, what vLLM's CPU build does with its own oneDNN binding): on a decode batch
    that is about twice as fast as the dense product, whose small-row GEMMs run far below the core's peak (the A/B in
    docs/benchmarks.md). In bfloat16 too where oneDNN has bf16 kernels for the CPU (``avx512_bf16``, AMX): about
    half the float32 time on a 528-token prefill (``dtype=bfloat16``, never the default on the CPU). Elsewhere the
    dense product."""

    __slots__ = ("weight", "bias", "_packed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias, self._packed = weight, bias, None
        if weight.device.type == "cpu" and _onednn_packs(weight.dtype):
            try:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            except (RuntimeError, AttributeError):  # a torch build without the op: the dense product
                self._packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        out = x @ self.weight.t()
        return out if self.bias is None else out.add_(self.bias)


def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether :class:`_Linear` reorders a CPU weight of ``dtype`` for oneDNN."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return dtype == torch.bfloat16 and supported is not None and bool(supported())


@dataclasses.dataclass(slots=True)
class _Layer:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: _Linear  # [q + 2 kv, hidden]
    o: _Linear
    gate_up: _Linear  # [2 intermediate, hidden]
    down: _Linear
    modules: dict[str, torch.nn.Module]
    #: Per module group, per adapter name.
    lora: dict[str, dict[str, _Lora]]


#: The linears the packed forward fuses, by group (peft may wrap any of them).
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}


def _base(module: torch.nn.Module) -> torch.nn.Module:
    """The plain linear under a peft LoRA wrapper (or the module itself)."""
    return getattr(module, "base_layer", module)


def _fuse(linears: list[torch.nn.Module]) -> torch.Tensor:
    """One weight ``[sum of outs, in]`` for several linears; each linear's weight becomes a view of it."""
    fused = torch.cat([m.weight.detach() for m in linears], 0).contiguous()
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = torch.nn.Parameter(fused[start:start + rows], requires_grad=False)
        start += rows
    return fused


@dataclasses.dataclass(slots=True)
class _Batch:
    """What every layer of one forward shares: packed positions, the decode rows' slots and mask, adapter rows."""

    tokens: int
    #: Each row's last token in the packed batch.
    last: list[int]
    cos: torch.Tensor
    sin: torch.Tensor
    #: Decode rows (one new token each): their token offsets, slots, the longest context and the key mask.
    decode_offsets: torch.Tensor | None
    decode_slots: torch.Tensor | None
    decode_positions: torch.Tensor | None
    decode_len: int
    decode_masked: torch.Tensor | None
    all_decode: bool
    #: Prefill rows: (offset, new tokens, position, slot, query chunks); each chunk (start, end, additive mask or
    #: None for a plain causal chunk from position 0), the same in every layer.
    prefill: list[tuple[int, int, int, int, list[tuple[int, int, torch.Tensor | None]]]]
    #: (adapter, token indices or None for every token).
    adapters: list[tuple[str, torch.Tensor | None]]


class PackedModel:
    """A Llama-family forward over a loaded Hugging Face model's weights (peft's LoRA wrappers may sit on them)."""

    def __init__(self, model: torch.nn.Module) -> None:
        cfg = model.config
        reason = packed_support(cfg.to_dict())
        if reason is not None:
            raise NotImplementedError(f"the packed forward does not support {reason}")
        inner = model.model
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        self.eps = float(cfg.rms_norm_eps)
        self.embed = inner.embed_tokens.weight.detach()
        self.norm = inner.norm.weight.detach()
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        rotary = inner.rotary_emb
        inv_freq = rotary.inv_freq.to(self.device, torch.float32)
        self.inv_freq = torch.cat((inv_freq, inv_freq))  # both halves of a head
        self.rope_scaling = float(rotary.attention_scaling)
        #: The sign of rotate_half's first half, folded into sin (see _rope).
        self.rope_sign = torch.ones(self.inv_freq.shape[0], device=self.device)
        self.rope_sign[: inv_freq.shape[0]] = -1
        self.layers: list[_Layer] = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            modules = {"q_proj": attn.q_proj, "k_proj": attn.k_proj, "v_proj": attn.v_proj, "o_proj": attn.o_proj,
                       "gate_proj": mlp.gate_proj, "up_proj": mlp.up_proj, "down_proj": mlp.down_proj}
            qkv = [_base(modules[n]) for n in GROUPS["qkv"]]
            bias = torch.cat([m.bias.detach() for m in qkv]) if qkv[0].bias is not None else None
            self.layers.append(_Layer(
                in_norm=layer.input_layernorm.weight.detach(), post_norm=layer.post_attention_layernorm.weight.detach(),
                qkv=_Linear(_fuse(qkv), bias), o=_Linear(_base(attn.o_proj).weight.detach()),
                gate_up=_Linear(_fuse([_base(mlp.gate_proj), _base(mlp.up_proj)])),
                down=_Linear(_base(mlp.down_proj).weight.detach()), modules=modules, lora={g: {} for g in GROUPS}))
        self.intermediate = self.layers[0].down.weight.shape[1] if self.layers else 0
        self.head = _Linear(model.lm_head.weight.detach())
        #: Query tokens per attention call of a prefill (0: the whole prefill in one call), see _attention.
        self.prefill_chunk = _PREFILL_CHUNK if self.device.type == "cpu" else 0

    def new_pool(self, max_capacity: int) -> KVPool:
        return KVPool(len(self.layers), self.n_kv, self.head_dim, dtype=self.dtype, device=self.device,
                      max_capacity=max_capacity)

    # ----------------------------------------------------------------------------------------- adapters
    def add_adapter(self, name: str) -> None:
        """Read adapter ``name``'s LoRA weights from peft's wrappers into one stacked pair per module group."""
        for layer in self.layers:
            for group, members in GROUPS.items():
                a_parts, b_parts, outs = [], [], []
                for member in members:
                    module = layer.modules[member]
                    outs.append(_base(module).weight.shape[0])
                    lora_a = getattr(module, "lora_A", {})
                    if name not in lora_a:
                        b_parts.append(None)
                        continue
                    if getattr(module, "use_dora", {}).get(name, False):
                        raise AssetError(f"adapter {name!r} is a DoRA adapter: the packed forward runs LoRA only; "
                                         "serve it with engine_forward=hf")
                    a_parts.append(lora_a[name].weight.detach())  # [r, in]
                    b_parts.append(module.lora_B[name].weight.detach() * module.scaling[name])  # [out, r]
                if not a_parts:
                    layer.lora[group].pop(name, None)
                    continue
                a = torch.cat(a_parts, 0)  # [r_total, in]
                b = torch.zeros((sum(outs), a.shape[0]), dtype=a.dtype, device=a.device)
                rank = out = 0
                for part, size in zip(b_parts, outs):
                    if part is not None:
                        b[out:out + size, rank:rank + part.shape[1]] = part
                        rank += part.shape[1]
                    out += size
                layer.lora[group][name] = _Lora(a.t().contiguous(), b.t().contiguous())

    def remove_adapter(self, name: str) -> None:
        for layer in self.layers:
            for group in layer.lora.values():
                group.pop(name, None)

    # ------------------------------------------------------------------------------------------ forward
    def forward(self, rows: Sequence[ForwardRow], slots: Sequence[int], pool: KVPool) -> torch.Tensor:
        """One forward of ``rows`` (row i's KV in ``slots[i]`` of ``pool``, ``row.position`` tokens of it valid):
        writes each row's new K/V into its slot and returns the logits after each row's last token ``[rows, vocab]``.
        The caller has made room (:meth:`KVPool.ensure`) and advances the rows' lengths once this returned."""
        with torch.inference_mode():
            batch = self._batch(rows, slots)
            ids = torch.tensor([t for row in rows for t in row.token_ids], dtype=torch.long, device=self.device)
            h = self.embed.index_select(0, ids)
            for index, layer in enumerate(self.layers):
                h = self._layer(h, layer, pool.buf[index], batch)
            if batch.tokens != len(rows):
                h = h.index_select(0, torch.tensor(batch.last, dtype=torch.long, device=self.device))
            return self.head(F.rms_norm(h, (h.shape[-1],), self.norm, self.eps))

    def _batch(self, rows: Sequence[ForwardRow], slots: Sequence[int]) -> _Batch:
        device = self.device
        offsets = _offsets(rows)
        positions = [p for row in rows for p in range(row.position, row.position + len(row.token_ids))]
        # As transformers does: angles in float32, cos and sin scaled, then cast to the model's dtype.
        angles = torch.tensor(positions, dtype=torch.float32, device=device)[:, None] * self.inv_freq
        cos = (angles.cos() * self.rope_scaling).to(self.dtype)
        sin = (angles.sin() * self.rope_scaling * self.rope_sign).to(self.dtype)
        decode = [i for i, row in enumerate(rows) if len(row.token_ids) == 1]
        prefill = []
        for i, row in enumerate(rows):
            n, p = len(row.token_ids), row.position
            if n > 1:
                step = self.prefill_chunk or n
                chunks = [(start, min(n, start + step), None if p + start == 0 else
                           _causal_bias(p + start, min(n, start + step) - start, dtype=self.dtype, device=device))
                          for start in range(0, n, step)]
                prefill.append((offsets[i], n, p, slots[i], chunks))
        decode_offsets = decode_slots = decode_positions = decode_masked = None
        decode_len = 0
        if decode:
            decode_offsets = torch.tensor([offsets[i] for i in decode], dtype=torch.long, device=device)
            decode_slots = torch.tensor([slots[i] for i in decode], dtype=torch.long, device=device)
            decode_positions = torch.tensor([rows[i].position for i in decode], dtype=torch.long, device=device)
            decode_len = max(rows[i].position for i in decode) + 1
            # Per slot of the pool, the keys it may not attend to; a slot without a decode row attends to its first
            # key only (its output is never read, and a row with every key masked would be NaN).
            lengths = torch.ones(slots_count := max(slots) + 1, dtype=torch.long, device=device)
            lengths[decode_slots] = decode_positions + 1
            masked = torch.arange(decode_len, device=device)[None, :] >= lengths[:, None]
            # Additive: 0 where a slot's query may attend, -inf elsewhere, per slot and KV head (every grouped query
            # head of a slot shares its row). NOTE: the pool is zero-filled, so a masked key is finite and adding
            # -inf to its score gives -inf, never NaN.
            decode_masked = torch.zeros(masked.shape, dtype=self.dtype, device=device).masked_fill_(
                masked, float("-inf")).repeat_interleave(self.n_kv, 0).view(slots_count * self.n_kv, 1, decode_len)
        by_adapter: dict[str, list[int]] = {}
        for row, offset in zip(rows, offsets):
            if row.adapter is not None:
                by_adapter.setdefault(row.adapter, []).extend(range(offset, offset + len(row.token_ids)))
        adapters = [(name, None if len(index) == len(positions)
                     else torch.tensor(index, dtype=torch.long, device=device)) for name, index in by_adapter.items()]
        last = [offset + len(row.token_ids) - 1 for offset, row in zip(offsets, rows)]
        return _Batch(tokens=len(positions), last=last, cos=cos[:, None, :], sin=sin[:, None, :],
                      decode_offsets=decode_offsets, decode_slots=decode_slots, decode_positions=decode_positions,
                      decode_len=decode_len, decode_masked=decode_masked, all_decode=len(decode) == len(rows),
                      prefill=prefill, adapters=adapters)

    def _layer(self, h: torch.Tensor, layer: _Layer, kv: torch.Tensor, batch: _Batch) -> torch.Tensor:
        tokens, heads, kv_heads, dim = batch.tokens, self.n_heads, self.n_kv, self.head_dim
        x = F.rms_norm(h, (h.shape[-1],), layer.in_norm, self.eps)
        qkv = layer.qkv(x)
        _add_lora(qkv, x, layer.lora["qkv"], batch.adapters)
        # q and k rotate in one go (they are adjacent in the fused output)
        qk = _rope(qkv[:, :self.q_size + self.kv_size].view(tokens, heads + kv_heads, dim), batch.cos, batch.sin)
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, self.q_size + self.kv_size:].view(tokens, kv_heads, dim)
        attn = self._attention(q, k, v, kv, batch)
        o = layer.o(attn)
        _add_lora(o, attn, layer.lora["o"], batch.adapters)
        h = h + o
        x = F.rms_norm(h, (h.shape[-1],), layer.post_norm, self.eps)
        gate_up = layer.gate_up(x)
        _add_lora(gate_up, x, layer.lora["gate_up"], batch.adapters)
        act = F.silu(gate_up[:, :self.intermediate]) * gate_up[:, self.intermediate:]
        down = layer.down(act)
        _add_lora(down, act, layer.lora["down"], batch.adapters)
        return h + down

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                   batch: _Batch) -> torch.Tensor:
        """Write the new K/V into their slots of ``kv`` (``[2, slots, kv_heads, capacity, dim]``) and attend."""
        heads, kv_heads, dim = self.n_heads, self.n_kv, self.head_dim
        group = heads // kv_heads
        out = q.new_empty((batch.tokens, heads * dim)) if not batch.all_decode else None
        for offset, n, p, slot, chunks in batch.prefill:
            kv[0, slot, :, p:p + n] = k[offset:offset + n].transpose(0, 1)
            kv[1, slot, :, p:p + n] = v[offset:offset + n].transpose(0, 1)
            qq = q[offset:offset + n].transpose(0, 1)[None]
            for start, end, bias in chunks:
                # NOTE: 4D inputs take the CPU's flash kernel, grouped query heads included (enable_gqa: no repeated
                # K/V). Its causal case still computes every key block it touches whole (512 keys at a time), so a
                # long prefill runs in query chunks, each over the keys up to its last token (_PREFILL_CHUNK).
                keys, values = kv[0, slot, :, :p + end][None], kv[1, slot, :, :p + end][None]
                rows = F.scaled_dot_product_attention(qq[:, :, start:end], keys, values, attn_mask=bias,
                                                      is_causal=bias is None, enable_gqa=True)
                out[offset + start:offset + end] = rows[0].transpose(0, 1).reshape(end - start, heads * dim)
        if batch.decode_slots is None:
            return out
        offsets, slots, positions = batch.decode_offsets, batch.decode_slots, batch.decode_positions
        k_new, v_new = (k, v) if batch.all_decode else (k.index_select(0, offsets), v.index_select(0, offsets))
        kv[0, slots, :, positions] = k_new
        kv[1, slots, :, positions] = v_new
        # Every slot up to the highest decode slot attends to the first decode_len keys in one product; the grouped
        # query heads of a KV head share its keys (no repeated K/V).
        count, length = batch.decode_masked.shape[0] // kv_heads, batch.decode_len
        q_new = q if batch.all_decode else q.index_select(0, offsets)
        queries = q.new_zeros((count, kv_heads, group, dim))
        queries.index_copy_(0, slots, q_new.view(-1, kv_heads, group, dim))
        keys = kv[0, :count, :, :length].reshape(count * kv_heads, length, dim)
        values = kv[1, :count, :, :length].reshape(count * kv_heads, length, dim)
        scores = torch.baddbmm(batch.decode_masked, queries.view(count * kv_heads, group, dim), keys.transpose(1, 2),
                               alpha=dim ** -0.5)
        rows = torch.bmm(torch.softmax(scores, -1), values).view(count, kv_heads * group * dim)
        rows = rows.index_select(0, slots)
        if batch.all_decode:
            return rows
        out.index_copy_(0, offsets, rows)
        return out


def _causal_bias(past: int, n: int, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive mask ``[n, past + n]`` of ``n`` new tokens after ``past`` held ones: new token j sees the past
    and new tokens up to j (bottom-right aligned causal), 0 where it may attend and -inf elsewhere. Built once a
    forward (every layer shares it) and in the model's dtype, so the attention kernel converts nothing."""
    hidden = torch.arange(past + n, device=device)[None, :] > (past + torch.arange(n, device=device))[:, None]
    return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))


def _offsets(rows: Sequence[ForwardRow]) -> list[int]:
    offsets, offset = [], 0
    for row in rows:
        offsets.append(offset)
        offset += len(row.token_ids)
    return offsets


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary positions as transformers applies them (``x * cos + rotate_half(x) * sin``): rotating the halves is
    a roll by half the head, with the sign of the first half folded into ``signed_sin``."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


def _add_lora(out: torch.Tensor, x: torch.Tensor, loras: dict[str, _Lora],
              adapters: list[tuple[str, torch.Tensor | None]]) -> None:
    """``out += x @ A @ B`` on the rows of each adapter of the batch (in place)."""
    for name, index in adapters:
        lora = loras.get(name)
        if lora is None:
            continue
        if index is None:
            out.addmm_(x @ lora.a, lora.b)
        else:
            out.index_add_(0, index, (x.index_select(0, index) @ lora.a) @ lora.b)


class PackedEngine(ModelFacts, ServingEngine, TorchSampling, SamplingState):
    """A loaded model run by :class:`PackedModel`, every open sequence's KV in one :class:`KVPool` (what
    ``engine_forward=packed``, the default, serves with)."""

    #: Rows are packed, not padded: decode rows and prefill chunks share one forward.
    mixed_rows = True

    def __init__(self, config: EngineConfig, model: LoadedModel | None = None) -> None:
        super().__init__()
        self.config = config
        #: The base model, its adapters and tokenizer (loaded from ``config`` unless given).
        self.model = model if model is not None else LoadedModel(config)
        self.prefix_cache = make_prefix_cache(config.kv)
        self._packed = PackedModel(self.model.lm)
        for name in self.adapters:
            self._packed.add_adapter(name)  # a DoRA adapter fails the start here, naming engine_forward=hf
        # From here each adapter loaded is added (a failure unloads it again) and each unloaded removed.
        self.model.listen(self._packed)
        self._pool = self._packed.new_pool(self.context_length)
        self._slot: dict[int, int] = {}
        #: Tokens of KV each sequence with a slot holds.
        self._length: dict[int, int] = {}

    def compute_kv(self, adapter: str | None, token_ids: Sequence[int]) -> SequenceKV:
        """The KV of ``token_ids`` computed from scratch with ``adapter`` by this engine's forward (no cache read or
        written): what a snapshot's restored blocks are checked against. On the scheduler's thread."""
        if adapter is not None and adapter not in self.adapters:
            raise UnknownAdapterError(f"unknown adapter '{adapter}': {UNKNOWN_ADAPTER_HINT}")
        slot = self._pool.acquire()
        try:
            self._pool.ensure(len(token_ids))
            self._packed.forward([ForwardRow(-1, token_ids, 0, adapter)], [slot], self._pool)
            return [(k.clone(), v.clone()) for k, v in self._pool.layers(slot, len(token_ids))]
        finally:
            self._pool.free(slot)

    def forget_batches(self) -> None:
        """Nothing is kept between forwards (the pool keeps its size, :class:`KVPool`)."""

    # ------------------------------------------------------------------------------------ sequence state
    def load_prefix(self, seq_id: int, match: PrefixMatch | None) -> None:
        self._logits.pop(seq_id, None)
        if match is None or not match.num_tokens:
            self._drop_kv(seq_id)
            return
        slot = self._slot_of(seq_id)
        self._pool.ensure(match.num_tokens)
        start = 0
        for block in self.prefix_cache.load_blocks(match, self.dtype):  # each [layers, 2, kv_heads, tokens, dim]
            self._pool.buf[:, :, slot, :, start:start + block.shape[3]] = block
            start += block.shape[3]
        self._length[seq_id] = match.num_tokens

    def forward(self, rows: list[ForwardRow]) -> None:
        for row in rows:
            held = self._length.get(row.seq_id, 0)
            if row.position != held:
                raise RuntimeError(f"sequence {row.seq_id}: forward at position {row.position}, its KV holds {held}")
        slots = [self._slot_of(row.seq_id) for row in rows]
        self._pool.ensure(max(row.position + len(row.token_ids) for row in rows))
        logits = self._packed.forward(rows, slots, self._pool)
        # Committed only once the whole forward returned: a forward that raises leaves every length as it was
        # (what it wrote past a length is never read).
        for i, row in enumerate(rows):
            self._length[row.seq_id] = row.position + len(row.token_ids)
            self._logits[row.seq_id] = logits[i]

    def store_prefix(self, seq_id: int, hashes: list[BlockHash], *, start_block: int, source: BlockSource,
                     plan_id: str | None, owner: str, tenant: str, public_blocks: int,
                     tokens: Sequence[int], retention_s: float | None = None) -> None:
        layers = self._pool.layers(self._slot[seq_id], self._length[seq_id])
        self.prefix_cache.store(hashes, layers, start_block=start_block, source=source, plan_id=plan_id,
                                owner=owner, tenant=tenant, public_blocks=public_blocks, tokens=tokens,
                                retention_s=retention_s)

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self._drop_kv(seq_id)

    def _sequences_with_kv(self) -> Iterable[int]:
        return self._slot.keys()

    def _slot_of(self, seq_id: int) -> int:
        slot = self._slot.get(seq_id)
        if slot is None:
            slot = self._slot[seq_id] = self._pool.acquire()
            self._length[seq_id] = 0
        return slot

    def _drop_kv(self, seq_id: int) -> None:
        slot = self._slot.pop(seq_id, None)
        self._length.pop(seq_id, None)
        if slot is not None:
            self._pool.free(slot)
