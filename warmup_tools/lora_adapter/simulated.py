"""A simulated engine for ``lora_adapter``: everything real but the forward (``engine=simulated``).

:class:`SimulatedEngine` loads no weights. The tokenizer is the base model folder's own (prompts, block
hashes, plans and the front see real token ids); adapters are discovered under ``adapter_root`` and
fingerprinted like the real engine's, but not loaded. The scheduler, the KV prefix cache (hashes, scopes,
pinning, eviction, budgets), plans, snapshots, the request log and the metrics run unchanged on top of it.

Only :meth:`SimulatedEngine.forward_batch` differs:

* a token's KV is a tiny numpy array, ``[1, 1, tokens, 2]`` in one layer holding each token's id and position,
  so cached blocks, snapshots and their verification (:meth:`compute_kv`) work as for a real model; the
  prefix cache counts each token at the profile's ``kv_bytes_per_token`` (``PrefixCache(bytes_per_token=)``),
  as do running sequences, so budgets hold what the modelled device would;
* the next token is a function of the whole KV a row attends to (every id at its position) and of the
  adapter's name and fingerprint: a request computed from cached blocks and the same request computed from
  scratch give the same tokens; about one token in :data:`EOS_EVERY` is the end of sequence. Sampling
  parameters do not change it (a model whose logits put all the mass on one token: a seed, a temperature or a
  penalty picks that token too);
* each forward takes the profile's step time for its batch
  (:meth:`~warmup_tools.lora_adapter.profile.EngineProfile.step_ms`), divided by ``engine_speedup``: the
  small real work is done first, then the rest is spent as the profile's device would
  (:data:`~warmup_tools.lora_adapter.profile.DEVICES`): waited out for a GPU (``time.sleep``, so a replica costs
  little CPU), computed for on a CPU (:func:`occupy_core`: this thread's CPU time, so the processes beside it
  contend with it as they do with the real CPU forward, whose profile was fitted on a quiet machine).

Every time it gives is modelled, from the profile it names (:attr:`SimulatedEngine.label`).

Its process imports neither torch nor transformers: KV payloads are numpy arrays
(:class:`~warmup_tools.kv.arrays.NumpyArrays`) and the tokenizer is read with ``tokenizers``, so a simulated replica
costs a fraction of a real one's memory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from warmup_tools.common.digests import fingerprint_folder, tokenizer_fingerprint
from warmup_tools.common.errors import UNKNOWN_ADAPTER_HINT, AssetError, UnknownAdapterError
from warmup_tools.kv.arrays import kv_arrays
from warmup_tools.lora_adapter.profile import EngineProfile, StepShape, load_profile
from warmup_tools.lora_adapter.runner import BatchRow, RowOutput, SequenceKV, SequenceRunner
from warmup_tools.lora_adapter.serving import ServingEngine, eos_ids, load_tokenizer, make_prefix_cache
from warmup_tools.lora_adapter.settings import DEFAULT_CONTEXT_LENGTH, EngineConfig, discover_adapters

LOGGER = logging.getLogger(__name__)

#: About one generated token in this many is the end of sequence.
EOS_EVERY = 64
_PRIME = (1 << 31) - 1
_MASK64 = (1 << 64) - 1


@dataclasses.dataclass(frozen=True, slots=True)
class SimulatedModelConfig:
    """The KV shape the simulated engine's payloads have (what a snapshot's identity records)."""

    num_hidden_layers: int = 1
    num_attention_heads: int = 1
    num_key_value_heads: int = 1
    head_dim: int = 2
    hidden_size: int = 2

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class SimulatedEngine(ServingEngine, SequenceRunner):
    """The ``lora_adapter`` engine without a model: real tokenizer, adapters' identities and prefix cache;
    forwards that take a profile's time (module doc). ``sleep`` and ``clock`` are for tests."""

    def __init__(self, config: EngineConfig, *, profile: EngineProfile | None = None,
                 sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.perf_counter,
                 occupy: Callable[[float], None] | None = None) -> None:
        super().__init__()
        self.config = config
        self.profile = profile or load_profile(config.profile)
        self.speedup = config.speedup
        self._sleep, self._clock = sleep, clock
        #: How the rest of a forward's time is spent: a sleep (a GPU profile), or keeping this core busy.
        self._spend = sleep if self.profile.device == "gpu" else (occupy or occupy_core)
        self.device = "cpu"
        self.dtype = np.dtype(np.float32)
        model_config = _read_model_config(config.base_model)
        self.tokenizer, self._public_ids = load_tokenizer(config)
        self.model_config = SimulatedModelConfig()
        self.context_length = int(model_config.get("max_position_embeddings", DEFAULT_CONTEXT_LENGTH))
        self.vocab_size = int(model_config.get("vocab_size") or len(self.tokenizer))
        #: Generated tokens are drawn below this (ids the tokenizer can decode).
        self._token_range = min(self.vocab_size, len(self.tokenizer))
        self.eos_token_ids = eos_ids(model_config.get("eos_token_id"), self.tokenizer)
        self._eos = min(self.eos_token_ids) if self.eos_token_ids else None
        # NOTE: not the weights' fingerprint (none are read): this engine's KV is not the model's, so its block
        # hashes and snapshots must never meet a real engine's.
        self.base_fingerprint = "simulated-" + hashlib.sha256(
            f"{self.profile.name}\x1f{tokenizer_fingerprint(self.tokenizer)}".encode()).hexdigest()[:16]
        #: Modelled bytes: what a token costs on the profile's device, whatever the payload's size.
        self.kv_bytes_per_token = self.profile.kv_bytes_per_token
        # NOTE: the cache keeps modelled time (its TTLs, pin deadlines and live-check windows are the trace's
        # seconds): wall time times the replay's speedup (the engine's own, unless a bench models a faster engine).
        scale = config.time_scale or config.speedup
        self.prefix_cache = make_prefix_cache(config.kv, bytes_per_token=self.kv_bytes_per_token,
                                              clock=lambda: time.monotonic() * scale, arrays=kv_arrays("numpy"))
        budget = config.kv.budget_bytes
        if budget > self.profile.kv_capacity_tokens * self.kv_bytes_per_token:
            LOGGER.warning("kv_cache_bytes %d is more than profile %s's device holds (%d tokens of %d bytes)",
                           budget, self.profile.name, self.profile.kv_capacity_tokens, self.kv_bytes_per_token)
        self.adapters: dict[str, Path] = {}
        self.adapter_fingerprints: dict[str, str] = {}
        self._adapter_salts: dict[str | None, int] = {}
        #: Forwards run and their modelled seconds (before ``speedup``), for benchmarks.
        self.steps = 0
        self.modelled_seconds = 0.0
        for name, path in discover_adapters(config.adapter_root, config.adapters).items():
            self._add_adapter(name, path)
        LOGGER.info("simulated engine: %s, adapters %s", self.label, sorted(self.adapters))

    @property
    def label(self) -> str:
        """How this engine's figures are labelled (``modelled, profile <name>``)."""
        return self.profile.label

    # ----------------------------------------------------------------------------------- public API
    def forward_batch(self, rows: Sequence[BatchRow]) -> list[RowOutput]:
        """Each row's next token (its ``logits``) and KV, after waiting the profile's time for this batch."""
        started = self._clock()
        outputs = [self._row(row) for row in rows]
        seconds = self.step_seconds(rows)
        self.steps += 1
        self.modelled_seconds += seconds
        remaining = seconds / self.speedup - (self._clock() - started)
        if remaining > 0:
            self._spend(remaining)
        return outputs

    def step_seconds(self, rows: Sequence[BatchRow]) -> float:
        """The modelled seconds of one forward of ``rows`` (before ``speedup``)."""
        return self.profile.step_ms(StepShape.of((len(row.token_ids), row.position) for row in rows)) / 1000.0

    def compute_kv(self, adapter: str | None, token_ids: Sequence[int]) -> SequenceKV:
        """The KV of ``token_ids`` from scratch (what snapshots' restored blocks are checked against)."""
        if adapter is not None and adapter not in self.adapters:
            raise UnknownAdapterError(f"unknown adapter '{adapter}': {UNKNOWN_ADAPTER_HINT}")
        kv = _token_kv(token_ids, 0)
        return [(kv, kv)]

    def forget_batches(self) -> None:
        """Nothing is kept between forwards."""

    def _new_generator(self, params: object) -> None:
        """No randomness: the next token is the forward's (module doc)."""

    def _pick(self, logits: int, params: object, generator: object, tokens: Sequence[int]) -> int:
        return logits

    def load_adapter(self, name: str, folder: str | None = None) -> None:
        """Register (or re-fingerprint, after its weights changed) the adapter ``name`` from under adapter_root."""
        paths = discover_adapters(self.config.adapter_root, (folder or name,))
        self.unload_adapter(name)
        self._add_adapter(name, next(iter(paths.values())))

    def unload_adapter(self, name: str) -> None:
        self.adapters.pop(name, None)
        self.adapter_fingerprints.pop(name, None)
        self._adapter_salts.pop(name, None)

    # ------------------------------------------------------------------------------------- helpers
    def _add_adapter(self, name: str, path: Path) -> None:
        LOGGER.info("registering adapter %s from %s (simulated: no weights loaded)", name, path)
        self.adapters[name] = path
        self.adapter_fingerprints[name] = fingerprint_folder(path)

    def _row(self, row: BatchRow) -> RowOutput:
        new = _token_kv(row.token_ids, row.position)
        keys = np.concatenate([row.past[0][0], new], axis=2) if row.past else new
        return RowOutput(self._next_token(keys[0, 0], row.adapter), [(keys, keys)])

    def _next_token(self, kv: np.ndarray, adapter: str | None) -> int:
        """A function of every (id, position) in ``kv`` (``[tokens, 2]``) and of the adapter's identity."""
        ids, positions = kv[:, 0].astype(np.int64), kv[:, 1].astype(np.int64)
        weights = (positions * 0x9E3779B1 + 0x7F4A7C15) % _PRIME + 1
        mixed = _splitmix(int(((ids + 1) * weights % _PRIME).sum()) ^ self._adapter_salt(adapter))
        if self._eos is not None and mixed % EOS_EVERY == 0:
            return self._eos
        return (mixed >> 8) % self._token_range

    def _adapter_salt(self, adapter: str | None) -> int:
        salt = self._adapter_salts.get(adapter)
        if salt is None:
            text = "" if adapter is None else f"{adapter}\x1f{self.adapter_fingerprints.get(adapter, '')}"
            salt = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
            self._adapter_salts[adapter] = salt
        return salt



def _token_kv(token_ids: Sequence[int], position: int) -> np.ndarray:
    """``[1, 1, tokens, 2]``: each token's id and position."""
    ids = np.asarray(list(token_ids), dtype=np.float32)
    positions = np.arange(position, position + len(ids), dtype=np.float32)
    return np.stack((ids, positions), axis=1).reshape(1, 1, len(ids), 2)


#: What :func:`occupy_core` hashes: large enough that hashlib computes without the GIL (over 2 KiB).
_BUSY_BUFFER = bytes(64 << 10)


def occupy_core(seconds: float) -> None:
    """Keep this thread computing for ``seconds`` of its own CPU time (its wall time grows when other processes
    want the core too). NOTE: the work is SHA-256 over a 64 KiB buffer, which hashlib computes with the GIL
    released, so the process's other threads (Triton's responses, the detokenizer) run beside it as they do beside
    a torch forward."""
    deadline = time.thread_time() + seconds
    while time.thread_time() < deadline:
        hashlib.sha256(_BUSY_BUFFER).digest()


def _splitmix(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def _read_model_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AssetError(f"base model folder {model_dir} has no config.json; the simulated engine reads its "
                         "tokenizer, vocabulary and context from there") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise AssetError(f"{path} is not readable JSON ({exc})") from None
