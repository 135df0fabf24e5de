"""Control inputs only from their owner: a model honours ``warmup_plan`` only on its own warm-up samples.

Triton exposes every model of the repository, and any client may set any input, so a client could send
``warmup_plan`` straight to a composing model to pin KV blocks outside the warm-up cap, unpin the
operator's plan, register tokenizer templates or force embeddings. The model therefore reads its own
``model_warmup`` samples at load (the data files ``stanzas`` wrote; their names and bytes come from the
model's config, which Triton hands the model and no client can change) and honours a request that
carries a control input only when its inputs are exactly one of those samples. A client that replays a
sample byte for byte re-warms a prefix the operator already planned, which changes nothing; anything
else is refused with an error that says to drop the input.

Why not a signature: it would need a secret inside the committed stanzas, or stanzas rewritten per
deployment. The samples already are the operator's word, and Triton runs them before the model is READY.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from warmup_tools.common.errors import InvalidInputError
from warmup_tools.triton.tensors import deserialize_tensor, serialize_tensor

#: The inputs that steer a model's caches rather than describe a request.
CONTROL_INPUTS = ("warmup_plan",)
#: The folder of a model's warm-up data files (Triton's convention).
WARMUP_DIR = "warmup"


class ControlInputError(InvalidInputError):
    """A client request carried a control input, which only the model's own warm-up samples may carry."""


class OwnWarmupSamples:
    """Digests of a model's own ``model_warmup`` samples (input names and bytes)."""

    def __init__(self, samples: Iterable[Mapping[str, tuple[str, bytes]]]) -> None:
        self._types: dict[str, str] = {}
        self._digests: set[bytes] = set()
        for sample in samples:
            for name, (data_type, _) in sample.items():
                self._types[name] = data_type
            self._digests.add(_digest({name: data for name, (_, data) in sample.items()}))

    def __len__(self) -> int:
        return len(self._digests)

    @classmethod
    def from_model_config(cls, model_config: Mapping[str, Any], model_dir: Path) -> OwnWarmupSamples:
        """From the model's config (as Triton hands it to ``initialize``) and its folder.

        A sample input without a data file (``zero_data``, ``random_data``) cannot be matched, so such a
        sample may not carry a control input.
        """
        samples = []
        for entry in model_config.get("model_warmup") or ():
            inputs = entry.get("inputs") or {}
            files = {name: spec.get("input_data_file") for name, spec in inputs.items()}
            if not all(files.values()):
                continue
            samples.append({name: (spec["data_type"], (Path(model_dir) / WARMUP_DIR / files[name]).read_bytes())
                            for name, spec in inputs.items()})
        return cls(samples)

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> OwnWarmupSamples:
        """From the ``args`` of a Python-backend model's ``initialize``."""
        return cls.from_model_config(json.loads(args["model_config"]), Path(args["model_repository"]))

    def is_sample(self, inputs: Mapping[str, np.ndarray | None]) -> bool:
        present = {name: array for name, array in inputs.items() if array is not None}
        if not present or any(name not in self._types for name in present):
            return False
        try:
            data = {name: serialize_tensor(array, self._types[name]) for name, array in present.items()}
        except (TypeError, ValueError, UnicodeError):
            return False
        return _digest(data) in self._digests

    def check(self, inputs: Mapping[str, np.ndarray | None]) -> bool:
        """True when ``inputs`` carry a control input and are one of the samples; False when they carry
        none; :class:`ControlInputError` when a client request carries one."""
        sent = [name for name in CONTROL_INPUTS if inputs.get(name) is not None]
        if not sent:
            return False
        if not self.is_sample(inputs):
            raise ControlInputError(
                f"input '{sent[0]}' is a control input: only this model's own warm-up samples may carry it; "
                "send the request without it (warm-up is planned by the operator with `warmup_tools stanzas`)")
        return True


def sample_plan_ids(model_config: Mapping[str, Any], model_dir: Path) -> set[str]:
    """The ``warmup_plan`` values the model's own warm-up samples carry (the plan they pin)."""
    plans = set()
    for entry in model_config.get("model_warmup") or ():
        spec = (entry.get("inputs") or {}).get(CONTROL_INPUTS[0]) or {}
        name = spec.get("input_data_file")
        if spec.get("data_type") == "TYPE_STRING" and name:
            data = (Path(model_dir) / WARMUP_DIR / name).read_bytes()
            plans.update(item.decode("utf-8", "replace") for item in
                         deserialize_tensor(data, "TYPE_STRING", [-1]).reshape(-1) if item)
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
