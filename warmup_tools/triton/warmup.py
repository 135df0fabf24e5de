"""Control inputs only from their owner, and only while the model loads: a model honours its own
``model_warmup`` samples (``warmup_plan``, and the tenant a sample names without a key) only as the
samples Triton runs before the model is READY.

Triton exposes every model of the repository, and any client may set any input, so a client could send
``warmup_plan`` straight to a composing model to pin KV blocks outside the warm-up cap, unpin the
operator's plan, register tokenizer templates or force embeddings, and in trust mode a sample's tenant
needs no key. The model therefore reads its own ``model_warmup`` samples at load (the data files
``stanzas`` wrote; their names and bytes come from the model's config, which Triton hands the model and
no client can change) and knows the exact run Triton makes of them: after ``initialize`` and before the
instance is READY, each sample in config order, ``max(count, 1)`` times, each time ``batch_size``
requests in one ``execute`` (a ``batch_size`` of 0 is skipped; Triton's ``TritonModelInstance::WarmUp``).
No client request reaches an instance before that. :class:`OwnWarmupSamples` follows that schedule: a
request is a sample only if it is, byte for byte, the next one the schedule expects; the first request
that is not, or the end of the schedule, closes the window for good. After load, a request identical to a
sample is an ordinary client request: a control input in it is refused, and its tenant needs a key in
trust mode. A reload (the sidecar's recovery) starts new instances, which run their samples again.

Why not a signature: it would need a secret inside the committed stanzas, or stanzas rewritten per
deployment. The samples already are the operator's word, and Triton runs them before the model is READY.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from warmup_tools.common.errors import InvalidInputError
from warmup_tools.triton.tensors import deserialize_tensor, serialize_tensor

#: The inputs that steer a model's caches rather than describe a request.
#: NOTE: ``warmup_plan`` first: :func:`sample_plan_ids` reads it as ``CONTROL_INPUTS[0]``.
CONTROL_INPUTS = ("warmup_plan", "warmup_retention_s")
#: The folder of a model's warm-up data files (Triton's convention).
WARMUP_DIR = "warmup"

#: One ``model_warmup`` entry: its inputs (name -> data type and bytes; None when an input has no data
#: file, so the sample cannot be matched) and how many requests Triton runs of it.
Sample = tuple["Mapping[str, tuple[str, bytes]] | None", int]


class ControlInputError(InvalidInputError):
    """A client request carried a control input, which only the model's own warm-up samples may carry."""


class OwnWarmupSamples:
    """A model's own ``model_warmup`` samples, in the order and number Triton runs them at load."""

    def __init__(self, samples: Iterable[Sample]) -> None:
        self._types: dict[str, str] = {}
        #: The digest of each request Triton will send, in order (None: a sample that cannot be matched).
        self._schedule: list[bytes | None] = []
        self._samples = 0
        for inputs, runs in samples:
            digest = None
            if inputs is not None:
                self._samples += 1
                for name, (data_type, _) in inputs.items():
                    self._types[name] = data_type
                digest = _digest({name: data for name, (_, data) in inputs.items()})
            self._schedule.extend([digest] * runs)
        self._next = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """The number of samples that can be matched (those whose every input has a data file)."""
        return self._samples

    @property
    def loading(self) -> bool:
        """True until the samples' run is over (or a request that is not the next sample arrived)."""
        return self._next < len(self._schedule)

    @classmethod
    def from_model_config(cls, model_config: Mapping[str, Any], model_dir: Path) -> OwnWarmupSamples:
        """From the model's config (as Triton hands it to ``initialize``) and its folder.

        A sample input without a data file (``zero_data``, ``random_data``) cannot be matched: such a
        sample keeps its place in the schedule but never counts as a sample (it may not carry a control
        input).
        """
        samples: list[Sample] = []
        for entry in model_config.get("model_warmup") or ():
            runs = int(entry.get("batch_size") or 0) * max(int(entry.get("count") or 0), 1)
            if runs == 0:
                continue  # NOTE: Triton skips a sample of batch_size 0
            inputs = entry.get("inputs") or {}
            files = {name: spec.get("input_data_file") for name, spec in inputs.items()}
            data = None
            if inputs and all(files.values()):
                data = {name: (spec["data_type"], (Path(model_dir) / WARMUP_DIR / files[name]).read_bytes())
                        for name, spec in inputs.items()}
            samples.append((data, runs))
        return cls(samples)

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> OwnWarmupSamples:
        """From the ``args`` of a Python-backend model's ``initialize``."""
        return cls.from_model_config(json.loads(args["model_config"]), Path(args["model_repository"]))

    def claim(self, inputs: Mapping[str, np.ndarray | None]) -> bool:
        """Whether this request is the next of the model's own warm-up samples while it loads. Call it
        once per request, in the order ``execute`` receives them: every call moves the schedule on, and
        a request that is not the expected sample closes it."""
        with self._lock:
            if self._next >= len(self._schedule):
                return False
            expected = self._schedule[self._next]
            if expected is not None and self._digest_of(inputs) == expected:
                self._next += 1
                return True
            # NOTE: an unmatchable sample (zero or random data) moves the schedule on like a sample; anything
            # else is not Triton's warm-up, which runs before any client request: the window closes.
            self._next = self._next + 1 if expected is None else len(self._schedule)
            return False

    def check(self, inputs: Mapping[str, np.ndarray | None]) -> bool:
        """:meth:`claim` this request; a control input in a request that is not a sample raises
        :class:`ControlInputError`. Returns whether it is one of the model's own samples, run at load."""
        sample = self.claim(inputs)
        sent = [name for name in CONTROL_INPUTS if inputs.get(name) is not None]
        if sent and not sample:
            raise ControlInputError(
                f"input '{sent[0]}' is a control input: only this model's own warm-up samples, while it loads, "
                "may carry it; send the request without it (warm-up is planned by the operator with "
                "`warmup_tools stanzas`)")
        return sample

    def _digest_of(self, inputs: Mapping[str, np.ndarray | None]) -> bytes | None:
        present = {name: array for name, array in inputs.items() if array is not None}
        if not present or any(name not in self._types for name in present):
            return None
        try:
            return _digest({name: serialize_tensor(array, self._types[name]) for name, array in present.items()})
        except (TypeError, ValueError, UnicodeError):
            return None


def sample_plan_ids(model_config: Mapping[str, Any], model_dir: Path) -> set[str]:
    """The ``warmup_plan`` values the model's own warm-up samples carry (the plan they pin)."""
    plans = set()
    for entry in model_config.get("model_warmup") or ():
        spec = (entry.get("inputs") or {}).get(CONTROL_INPUTS[0]) or {}
        name = spec.get("input_data_file")
        if spec.get("data_type") == "TYPE_STRING" and name:
            data = (Path(model_dir) / WARMUP_DIR / name).read_bytes()
            plans.update(item.decode("utf-8", "replace") for item in
                         deserialize_tensor(data, "TYPE_STRING", [-1]) if item)
    return plans


def own_plan_id(args: Mapping[str, Any]) -> str | None:
    """The plan a Python-backend model's warm-up samples pin (from ``initialize``'s ``args``); None when
    they carry none or several."""
    plans = sample_plan_ids(json.loads(args["model_config"]), Path(args["model_repository"]))
    return next(iter(plans)) if len(plans) == 1 else None


def _digest(data: Mapping[str, bytes]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(data):
        h.update(name.encode("utf-8") + b"\0" + len(data[name]).to_bytes(8, "little") + data[name])
    return h.digest()
