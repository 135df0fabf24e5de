"""The generation engine behind the ``lora_adapter`` model: a causal LM with many LoRA adapters, computed by the
Hugging Face model with peft's layers (``engine_forward=hf``; the default forward is
:class:`~warmup_tools.lora_adapter.packed.PackedEngine`, which loads through this class).

The base model and adapters load through the ordinary Hugging Face paths (``AutoModelForCausalLM``,
``PeftModel``), so a real model folder and real adapter folders work by changing config parameters.
One engine serves one model instance, behind the continuous-batching scheduler
(:mod:`warmup_tools.lora_adapter.scheduler`), which sees it through the torch-free
:class:`~warmup_tools.lora_adapter.engine_api.SequenceEngine` and handles token ids only.

Who owns what: the engine owns the tensors. :meth:`LoraEngine.forward_batch` runs one forward for many
sequences with different adapters; the per-sequence state around it (each sequence's KV, the logits of its
last forward, its seeded generator, loading a cache match into KV, storing KV blocks, sampling) is
:class:`~warmup_tools.lora_adapter.runner.SequenceRunner`, which this class inherits. The scheduler owns the
decisions: admission, the prefix cache's matching, reservations and single flight, which tokens each step
computes, preemption, and what a sampled token means for its request. The tests check the output against
plain Hugging Face and peft (tests/reference.py, as vLLM's tests compare against Hugging Face's ``generate``).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator, Sequence

import torch

from warmup_tools.common.digests import fingerprint_folder
from warmup_tools.common.errors import UNKNOWN_ADAPTER_HINT, AssetError, UnknownAdapterError
from warmup_tools.kv.config import KVShape
from warmup_tools.lora_adapter.devices import select_device, select_dtype
from warmup_tools.lora_adapter.engine_api import GenerationStep  # noqa: F401 (imported from here too)
from warmup_tools.lora_adapter.runner import BatchRow, RowOutput, SequenceKV
from warmup_tools.lora_adapter.serving import ServingEngine, eos_ids, make_prefix_cache
from warmup_tools.lora_adapter.settings import DEFAULT_CONTEXT_LENGTH, EngineConfig, discover_adapters

LOGGER = logging.getLogger(__name__)


#: peft's name for "no adapter" in a mixed-adapter batch (``adapter_names=[...]``).
BASE_ADAPTER_NAME = "__base__"


class LoraEngine(ServingEngine):
    """Loads a base causal LM plus LoRA adapters; runs batched forwards and holds each sequence's state."""

    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoModelForCausalLM

        super().__init__()
        self.config = config
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        self.device = select_device(config.device)
        self.dtype = select_dtype(config.dtype, self.device)
        if not (config.base_model / "config.json").exists():
            raise AssetError(
                f"base model folder {config.base_model} has no config.json; "
                "build the demo assets with `python -m warmup_tools assets` or point base_model at a model folder"
            )
        self._load_tokenizer(config)
        model = AutoModelForCausalLM.from_pretrained(config.base_model, dtype=self.dtype, use_safetensors=True)
        model.to(self.device).eval()
        self.model_config = model.config
        self.context_length = int(getattr(model.config, "max_position_embeddings", DEFAULT_CONTEXT_LENGTH))
        self.vocab_size = int(model.config.vocab_size)
        self.eos_token_ids = eos_ids(getattr(model.config, "eos_token_id", None), self.tokenizer)
        self.base_fingerprint = fingerprint_folder(config.base_model)
        #: KV bytes one token of a running sequence takes (full precision, as the forward computes it).
        self.kv_bytes_per_token = int(KVShape.from_model_config(model.config.to_dict()).bytes_per_token(
            "fp", torch.empty((), dtype=self.dtype).element_size(), config.kv.block_size))
        self.prefix_cache = make_prefix_cache(config.kv)
        self._peft = None
        self._lm = model
        #: Adapter name per batch row of the forward running now (None: not a mixed-adapter forward).
        self._current_rows: list[str] | None = None
        self._row_hooked: set[int] = set()
        #: The last two batched forwards (cache, rows' KV, all rows of one length), for reuse.
        self._recent_batches: list[tuple[object, list[SequenceKV], bool]] = []
        for name, path in discover_adapters(config.adapter_root, config.adapters).items():
            self._load_adapter(name, path)

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
        with torch.inference_mode(), self._row_adapters([row.adapter for row in rows]):
            out = self._lm(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
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
        use = self._adapter(row.adapter) if row.adapter is not None else self._row_adapters([None])
        with torch.inference_mode(), use:
            out = self._lm(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
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

    def load_adapter(self, name: str, folder: str | None = None) -> None:
        """Load (or reload, after its weights changed) the adapter ``name`` from under adapter_root."""
        paths = discover_adapters(self.config.adapter_root, (folder or name,))
        path = next(iter(paths.values()))
        if name in self.adapters:
            self.unload_adapter(name)
        self._load_adapter(name, path)

    def unload_adapter(self, name: str) -> None:
        """Free an adapter's weights. Its KV blocks stay until evicted but can never match again
        once the adapter is reloaded with other weights (the fingerprint is part of every key)."""
        if name not in self.adapters:
            return
        others = [a for a in self.adapters if a != name]
        if others and self._peft.active_adapter == name:
            self._peft.set_adapter(others[0])  # requests set their own; this only avoids peft's warning
        self._peft.delete_adapter(name)
        del self.adapters[name]
        self.adapter_fingerprints.pop(name, None)

    def compute_kv(self, adapter: str | None, token_ids: Sequence[int]) -> SequenceKV:
        """The KV of ``token_ids`` computed from scratch with ``adapter`` (no cache read or written):
        what a snapshot's restored blocks are checked against."""
        from transformers import DynamicCache

        with self._adapter(adapter), torch.inference_mode():
            cache = DynamicCache(config=self.model_config)
            self._forward(torch.tensor([list(token_ids)], dtype=torch.long, device=self.device), cache)
            return [(layer.keys, layer.values) for layer in cache.layers]

    # ------------------------------------------------------------------------------------- helpers
    def _forward(self, input_ids: torch.Tensor, cache: object) -> torch.Tensor:
        out = self._lm(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]

    @contextlib.contextmanager
    def _row_adapters(self, adapters: list[str | None]) -> Iterator[None]:
        """Run the next forward with one adapter per batch row (peft's mixed-batch LoRA forward).

        NOTE: ``PeftModel(..., adapter_names=...)`` would do the same, but it walks every module twice
        per call to check the names and to register its injecting hooks (about 5 ms a step on the demo
        model); here the hooks are registered once and read the names of the current forward. Names are
        checked before (:meth:`check_request`, and the scheduler before each step).
        """
        if self._peft is None or not self.adapters:
            yield
            return
        self._current_rows = [name or BASE_ADAPTER_NAME for name in adapters]
        try:
            yield
        finally:
            self._current_rows = None

    def _install_row_hooks(self) -> None:
        from peft.tuners.lora import LoraLayer
        from peft.utils.other import AuxiliaryTrainingWrapper

        hooked = self._row_hooked
        for module in self._peft.modules():
            if isinstance(module, (LoraLayer, AuxiliaryTrainingWrapper)) and id(module) not in hooked:
                module.register_forward_pre_hook(self._inject_row_adapters, with_kwargs=True)
                hooked.add(id(module))

    def _inject_row_adapters(self, module: object, args: tuple, kwargs: dict) -> None:
        rows = self._current_rows
        if rows is not None:
            kwargs["adapter_names"] = rows

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

    @contextlib.contextmanager
    def _adapter(self, name: str | None) -> Iterator[None]:
        if name is None:
            if self._peft is None or not self.adapters:
                yield
            else:
                with self._peft.disable_adapter():
                    yield
            return
        if name not in self.adapters:
            raise UnknownAdapterError(f"unknown adapter '{name}': {UNKNOWN_ADAPTER_HINT}")
        # NOTE: peft's set_adapter walks every module (about 7 ms on the demo model): only on a change.
        if self._peft.active_adapter != name:
            self._peft.set_adapter(name)
        yield

    def _load_adapter(self, name: str, path: Path) -> None:
        from peft import PeftModel

        LOGGER.info("loading adapter %s from %s", name, path)
        if self._peft is None:
            self._peft = PeftModel.from_pretrained(self._lm, path, adapter_name=name, is_trainable=False)
            self._peft.to(self.device).eval()
            self._lm = self._peft.get_base_model()
        else:
            self._peft.load_adapter(path, adapter_name=name, is_trainable=False)
            self._peft.to(self.device)
        self.adapters[name] = path
        self.adapter_fingerprints[name] = fingerprint_folder(path)
        self._install_row_hooks()
