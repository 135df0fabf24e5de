"""One loaded model: the base causal LM, its LoRA adapters and its tokenizer, and the facts the engine serves by.

:class:`LoadedModel` loads through the ordinary Hugging Face paths (``AutoModelForCausalLM``, ``PeftModel``), so a
real model folder and real adapter folders work by changing config parameters. It computes nothing: the forwards
that run it (:class:`~warmup_tools.lora_adapter.hf.HfEngine`, the Hugging Face reference, and
:class:`~warmup_tools.lora_adapter.packed.PackedEngine`, the default) each hold one, as vLLM's model runner holds
the model its loader built. A forward that keeps something per adapter (the packed forward's stacked LoRA weights,
the Hugging Face forward's per-row hooks) registers an :class:`AdapterListener` and is told when an adapter was
loaded and before one is unloaded.

:class:`ModelFacts` gives such a forward the members of
:class:`~warmup_tools.lora_adapter.serving.ServingEngine` and the protocols that come from the model (tokenizer,
vocabulary, context, adapters and their fingerprints, dtype, device), read from its ``model``.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator, Protocol

import torch

from warmup_tools.common.digests import fingerprint_folder
from warmup_tools.common.errors import UNKNOWN_ADAPTER_HINT, AssetError, UnknownAdapterError
from warmup_tools.kv.config import KVShape
from warmup_tools.lora_adapter.devices import reuse_freed_memory, select_device, select_dtype
from warmup_tools.lora_adapter.serving import eos_ids, load_tokenizer
from warmup_tools.lora_adapter.settings import DEFAULT_CONTEXT_LENGTH, EngineConfig, discover_adapters

LOGGER = logging.getLogger(__name__)


class AdapterListener(Protocol):
    """What a forward keeps per adapter, kept in step with the loaded model's adapters."""

    def add_adapter(self, name: str) -> None:
        """Adapter ``name`` was just loaded into peft's modules; raising unloads it again (the load fails)."""

    def remove_adapter(self, name: str) -> None:
        """Adapter ``name`` is about to leave peft's modules (also after a failed :meth:`add_adapter`)."""


class LoadedModel:
    """A base causal LM (and peft's wrapper once an adapter is loaded), its adapters and tokenizer, on one device."""

    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoModelForCausalLM

        self.config = config
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        reuse_freed_memory(config.reuse_freed_mib)
        self.device = select_device(config.device)
        self.dtype = select_dtype(config.dtype, self.device)
        if not (config.base_model / "config.json").exists():
            raise AssetError(
                f"base model folder {config.base_model} has no config.json; "
                "build the demo assets with `python -m warmup_tools assets` or point base_model at a model folder"
            )
        self.tokenizer, self.public_ids = load_tokenizer(config)
        model = AutoModelForCausalLM.from_pretrained(config.base_model, dtype=self.dtype, use_safetensors=True)
        model.to(self.device).eval()
        #: The Hugging Face model (peft's LoRA layers sit in it once an adapter is loaded).
        self.lm = model
        #: peft's wrapper of :attr:`lm` (None until the first adapter is loaded).
        self.peft = None
        self.model_config = model.config
        self.context_length = int(getattr(model.config, "max_position_embeddings", DEFAULT_CONTEXT_LENGTH))
        self.vocab_size = int(model.config.vocab_size)
        self.eos_token_ids = eos_ids(getattr(model.config, "eos_token_id", None), self.tokenizer)
        self.base_fingerprint = fingerprint_folder(config.base_model)
        #: KV bytes one token of a running sequence takes (full precision, as the forward computes it).
        self.kv_bytes_per_token = int(KVShape.from_model_config(model.config.to_dict()).bytes_per_token(
            "fp", torch.empty((), dtype=self.dtype).element_size(), config.kv.block_size))
        #: Loaded adapters: name -> folder, and name -> the fingerprint of its files.
        self.adapters: dict[str, Path] = {}
        self.adapter_fingerprints: dict[str, str] = {}
        self._listeners: list[AdapterListener] = []
        for name, path in discover_adapters(config.adapter_root, config.adapters).items():
            self._load(name, path)

    def listen(self, listener: AdapterListener) -> None:
        """Tell ``listener`` of every adapter load and unload from now on (it adds the loaded ones itself)."""
        self._listeners.append(listener)

    def load_adapter(self, name: str, folder: str | None = None) -> None:
        """Load (or reload, after its weights changed) the adapter ``name`` from under adapter_root."""
        paths = discover_adapters(self.config.adapter_root, (folder or name,))
        path = next(iter(paths.values()))
        if name in self.adapters:
            self.unload_adapter(name)
        self._load(name, path)

    def unload_adapter(self, name: str) -> None:
        """Free an adapter's weights. Its KV blocks stay until evicted but can never match again
        once the adapter is reloaded with other weights (the fingerprint is part of every key)."""
        if name not in self.adapters:
            return
        for listener in self._listeners:
            listener.remove_adapter(name)
        others = [a for a in self.adapters if a != name]
        if others and self.peft.active_adapter == name:
            self.peft.set_adapter(others[0])  # requests set their own; this only avoids peft's warning
        self.peft.delete_adapter(name)
        del self.adapters[name]
        self.adapter_fingerprints.pop(name, None)

    @contextlib.contextmanager
    def adapter(self, name: str | None) -> Iterator[None]:
        """Run what is inside with adapter ``name`` active in peft (None: the base model, adapters disabled)."""
        if name is None:
            if self.peft is None or not self.adapters:
                yield
            else:
                with self.peft.disable_adapter():
                    yield
            return
        if name not in self.adapters:
            raise UnknownAdapterError(f"unknown adapter '{name}': {UNKNOWN_ADAPTER_HINT}")
        # NOTE: peft's set_adapter walks every module (about 7 ms on the demo model): only on a change.
        if self.peft.active_adapter != name:
            self.peft.set_adapter(name)
        yield

    def _load(self, name: str, path: Path) -> None:
        from peft import PeftModel

        LOGGER.info("loading adapter %s from %s", name, path)
        if self.peft is None:
            self.peft = PeftModel.from_pretrained(self.lm, path, adapter_name=name, is_trainable=False)
            self.peft.to(self.device).eval()
            self.lm = self.peft.get_base_model()
        else:
            self.peft.load_adapter(path, adapter_name=name, is_trainable=False)
            self.peft.to(self.device)
        self.adapters[name] = path
        self.adapter_fingerprints[name] = fingerprint_folder(path)
        try:
            for listener in self._listeners:
                listener.add_adapter(name)
        except BaseException:
            self.unload_adapter(name)
            raise


class ModelFacts:
    """What a forward over a :class:`LoadedModel` (its ``model``) serves by, read from the model: the members
    :class:`~warmup_tools.lora_adapter.serving.ServingEngine` and the callers' protocols name, and the adapters'
    load and unload."""

    model: LoadedModel

    @property
    def tokenizer(self) -> object:
        return self.model.tokenizer

    @property
    def _public_ids(self) -> tuple[tuple[int, ...], ...]:
        return self.model.public_ids

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def context_length(self) -> int:
        return self.model.context_length

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.model.eos_token_ids

    @property
    def base_fingerprint(self) -> str:
        return self.model.base_fingerprint

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    @property
    def model_config(self) -> object:
        return self.model.model_config

    @property
    def adapters(self) -> dict[str, Path]:
        return self.model.adapters

    @property
    def adapter_fingerprints(self) -> dict[str, str]:
        return self.model.adapter_fingerprints

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def load_adapter(self, name: str, folder: str | None = None) -> None:
        """Load (or reload, after its weights changed) the adapter ``name`` from under adapter_root."""
        self.model.load_adapter(name, folder)

    def unload_adapter(self, name: str) -> None:
        """Free an adapter's weights (:meth:`LoadedModel.unload_adapter`)."""
        self.model.unload_adapter(name)
