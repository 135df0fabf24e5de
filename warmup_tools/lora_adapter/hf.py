"""The Hugging Face reference forward (``engine_forward=hf``): the loaded model's own ``forward``, with peft's layers.

:class:`HfEngine` runs a :class:`~warmup_tools.lora_adapter.loaded.LoadedModel` through the Hugging Face model
itself: batched, padded forwards in which rows of different adapters share one forward through peft's per-row
``adapter_names``. It is the reference the default forward
(:class:`~warmup_tools.lora_adapter.packed.PackedEngine`) is checked against, and serves models the packed forward
does not compute. One engine serves one model instance, behind the continuous-batching scheduler
(:mod:`warmup_tools.lora_adapter.scheduler`), which sees it through the torch-free
:class:`~warmup_tools.lora_adapter.engine_api.SequenceEngine` and handles token ids only.

Who owns what: the engine owns the tensors. :meth:`HfEngine.forward_batch` runs one forward for many sequences with
different adapters; the per-sequence state around it (each sequence's KV, the logits of its last forward, its seeded
generator, loading a cache match into KV, storing KV blocks, sampling) is
:class:`~warmup_tools.lora_adapter.runner.SequenceRunner`. The scheduler owns the decisions: admission, the prefix
cache's matching, reservations and single flight, which tokens each step computes, preemption, and what a sampled
token means for its request. The tests check the output against plain Hugging Face and peft (tests/reference.py, as
vLLM's tests compare against Hugging Face's ``generate``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from warmup_tools.lora_adapter.loaded import LoadedModel, ModelFacts
from warmup_tools.lora_adapter.runner import BatchRow, RowOutput, SequenceKV, SequenceRunner
from warmup_tools.lora_adapter.sampling import TorchSampling
from warmup_tools.lora_adapter.serving import ServingEngine, make_prefix_cache
from warmup_tools.lora_adapter.settings import EngineConfig

#: peft's name for "no adapter" in a mixed-adapter batch (``adapter_names=[...]``).
BASE_ADAPTER_NAME = "__base__"


class HfEngine(ModelFacts, ServingEngine, TorchSampling, SequenceRunner):
    """Batched forwards of a loaded model through Hugging Face and peft, and each sequence's state."""

    def __init__(self, config: EngineConfig, model: LoadedModel | None = None) -> None:
        super().__init__()
        self.config = config
        #: The base model, its adapters and tokenizer (loaded from ``config`` unless given).
        self.model = model if model is not None else LoadedModel(config)
        self.prefix_cache = make_prefix_cache(config.kv)
        self._rows = _RowAdapters(self.model)
        self.model.listen(self._rows)
        #: The last two batched forwards (cache, rows' KV, all rows of one length), for reuse.
        self._recent_batches: list[tuple[object, list[SequenceKV], bool]] = []

    # ----------------------------------------------------------------------------------- public API
    def forward_batch(self, rows: Sequence[BatchRow]) -> list[RowOutput]:
        """One forward for several sequences, each with its own KV, position and adapter.

        The batch is padded: past KV left-padded to the longest past, new tokens right-padded to the
        longest row, with an explicit 4D mask and per-row position ids, so each row computes exactly
        what it would alone. Rows with different adapters (or the base model) share the forward through
        peft's per-row ``adapter_names``.
        """
        from transformers import DynamicCache

        batch = len(rows)
        new_len = max(len(row.token_ids) for row in rows)
        cache = self._reusable_cache(rows)
        if batch == 1:
            return [self._forward_row(rows[0], cache)]
        past_len = cache.get_seq_length() if cache is not None else max(row.position for row in rows)
        if cache is None and past_len:
            cache = DynamicCache(ddp_cache_data=self._padded_past(rows, past_len), config=self.model_config)
        elif cache is None:
            cache = DynamicCache(config=self.model_config)
        ids = torch.full((batch, new_len), self._pad_id, dtype=torch.long, device=self.device)
        positions = torch.zeros((batch, new_len), dtype=torch.long, device=self.device)
        # NOTE: a 4D mask is used as given by transformers (no padding or packing inference from
        # position ids); True means "may attend". Keys: [padded past | new tokens].
        allowed = torch.zeros((batch, 1, new_len, past_len + new_len), dtype=torch.bool, device=self.device)
        causal = torch.ones((new_len, new_len), dtype=torch.bool, device=self.device).tril()
        for i, row in enumerate(rows):
            n = len(row.token_ids)
            ids[i, :n] = torch.tensor(list(row.token_ids), dtype=torch.long, device=self.device)
            # Padded query positions repeat the last real position: harmless, and never read.
            positions[i] = torch.arange(new_len, device=self.device).clamp(max=n - 1) + row.position
            allowed[i, 0, :, past_len - row.position:past_len] = True
            allowed[i, 0, :, past_len:] = causal
            allowed[i, 0, :, past_len + n:] = False
            allowed[i, 0, n:, past_len:past_len + n] = True  # padded queries see real keys only (no empty row)
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        last = sorted({len(row.token_ids) - 1 for row in rows})
        with torch.inference_mode(), self._rows.use([row.adapter for row in rows]):
            out = self.model.lm(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                           logits_to_keep=torch.tensor(last, device=self.device))
        outputs = []
        for i, row in enumerate(rows):
            n = len(row.token_ids)
            start, end = past_len - row.position, past_len + n
            # NOTE: a row's KV is a view of the batch's cache (its real tokens are contiguous there):
            # no copy per row and step; the next step copies it only if the batch changed.
            kv: SequenceKV = [(layer.keys[i:i + 1, :, start:end], layer.values[i:i + 1, :, start:end])
                              for layer in cache.layers]
            outputs.append(RowOutput(out.logits[i, last.index(n - 1)], kv))
        uniform = all(len(row.token_ids) == new_len for row in rows)
        self._recent_batches = [*self._recent_batches[-1:], (cache, [o.kv for o in outputs], uniform)]
        return outputs

    def _forward_row(self, row: BatchRow, cache: object | None) -> RowOutput:
        """One sequence alone: its KV as it is (no padding), no explicit mask, its adapter made peft's active
        one. NOTE: a single stream runs this every step, so it costs what decoding the request by itself costs
        (the one-stream comparison in CHANGELOG.md)."""
        from transformers import DynamicCache

        if cache is None:
            cache = (DynamicCache(ddp_cache_data=[(k, v) for k, v in row.past], config=self.model_config)
                     if row.position else DynamicCache(config=self.model_config))
        ids = torch.tensor([list(row.token_ids)], dtype=torch.long, device=self.device)
        # An adapter row runs with its adapter set (peft's plain LoRA forward); a base row through the per-row
        # names (peft's disable_adapter walks every module on entry and exit).
        use = self.model.adapter(row.adapter) if row.adapter is not None else self._rows.use([None])
        with torch.inference_mode(), use:
            out = self.model.lm(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        end = row.position + len(row.token_ids)
        kv: SequenceKV = [(layer.keys[:, :, :end], layer.values[:, :, :end]) for layer in cache.layers]
        self._recent_batches = [*self._recent_batches[-1:], (cache, [kv], True)]
        return RowOutput(out.logits[0, -1], kv)

    def forget_batches(self) -> None:
        """Drop the caches kept for reuse (the scheduler calls this when nothing runs)."""
        self._recent_batches.clear()

    def _reusable_cache(self, rows: Sequence[BatchRow]) -> object | None:
        """The cache of a recent forward if these rows are exactly its rows, in order, each continuing
        from what that forward returned: in steady decoding the batch then grows by one column and is
        not rebuilt from each row's KV."""
        for index, (cache, kvs, uniform) in enumerate(self._recent_batches):
            # Every row of that batch ended at its last column only if all rows had the same new tokens.
            if uniform and len(kvs) == len(rows) and all(row.past is kv for row, kv in zip(rows, kvs)):
                del self._recent_batches[index]  # its cache grows in place from here on
                return cache
        return None

    def compute_kv(self, adapter: str | None, token_ids: Sequence[int]) -> SequenceKV:
        """The KV of ``token_ids`` computed from scratch with ``adapter`` (no cache read or written):
        what a snapshot's restored blocks are checked against."""
        from transformers import DynamicCache

        with self.model.adapter(adapter), torch.inference_mode():
            cache = DynamicCache(config=self.model_config)
            self._forward(torch.tensor([list(token_ids)], dtype=torch.long, device=self.device), cache)
            return [(layer.keys, layer.values) for layer in cache.layers]

    # ------------------------------------------------------------------------------------- helpers
    def _forward(self, input_ids: torch.Tensor, cache: object) -> torch.Tensor:
        out = self.model.lm(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    @property
    def _pad_id(self) -> int:
        pad = getattr(self.model_config, "pad_token_id", None)
        return int(pad) if isinstance(pad, int) else 0

    def _padded_past(self, rows: Sequence[BatchRow], past_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(keys, values)`` of shape ``[batch, kv_heads, past_len, head_dim]``, left-padded."""
        template = next(row.past for row in rows if row.past)
        layers = []
        for layer_index, (k0, _) in enumerate(template):
            shape = (len(rows), k0.shape[1], past_len, k0.shape[3])
            keys = torch.zeros(shape, dtype=k0.dtype, device=k0.device)
            values = torch.zeros(shape, dtype=k0.dtype, device=k0.device)
            for i, row in enumerate(rows):
                if row.position:
                    k, v = row.past[layer_index]
                    keys[i, :, past_len - row.position:] = k[0]
                    values[i, :, past_len - row.position:] = v[0]
            layers.append((keys, values))
        return layers


class _RowAdapters:
    """Runs the next forward with one adapter per batch row (peft's mixed-batch LoRA forward).

    NOTE: ``PeftModel(..., adapter_names=...)`` would do the same, but it walks every module twice per call to check
    the names and to register its injecting hooks (about 5 ms a step on the demo model); here the hooks are
    registered once per peft module (:meth:`add_adapter`, as the loaded model's
    :class:`~warmup_tools.lora_adapter.loaded.AdapterListener`) and read the names of the current forward. Names are
    checked before (:meth:`~warmup_tools.lora_adapter.serving.ServingEngine.check_request`, and the scheduler before
    each step).
    """

    def __init__(self, model: LoadedModel) -> None:
        self._model = model
        #: Adapter name per batch row of the forward running now (None: not a mixed-adapter forward).
        self._current: list[str] | None = None
        self._hooked: set[int] = set()
        if model.peft is not None:
            self._install()

    @contextlib.contextmanager
    def use(self, adapters: list[str | None]) -> Iterator[None]:
        if self._model.peft is None or not self._model.adapters:
            yield
            return
        self._current = [name or BASE_ADAPTER_NAME for name in adapters]
        try:
            yield
        finally:
            self._current = None

    def add_adapter(self, name: str) -> None:
        self._install()

    def remove_adapter(self, name: str) -> None:
        """Nothing is kept per adapter (a hook stays on its module)."""

    def _install(self) -> None:
        from peft.tuners.lora import LoraLayer
        from peft.utils.other import AuxiliaryTrainingWrapper

        for module in self._model.peft.modules():
            if isinstance(module, (LoraLayer, AuxiliaryTrainingWrapper)) and id(module) not in self._hooked:
                module.register_forward_pre_hook(self._inject, with_kwargs=True)
                self._hooked.add(id(module))

    def _inject(self, module: object, args: tuple, kwargs: dict) -> None:
        rows = self._current
        if rows is not None:
            kwargs["adapter_names"] = rows
