"""Engine profiles: what one step of a modelled engine (hardware x model) takes, and its KV size.

A profile is a JSON file, ``profiles/<name>.json`` beside this module (or any path), read by
:func:`load_profile`; the simulated engine (:mod:`warmup_tools.lora_adapter.simulated`) waits the time it
gives for each batched forward. Its step time is linear in a few counts of the batch (so it can be fitted by
least squares, :mod:`warmup_tools.lora_adapter.profile_fit`):

* a *decode row* brings one new token on top of its KV; any other row is a *prefill row* (a prompt or a chunk);
* ``prefill_ms = overhead_ms + ms_per_row * (P - 1) + ms_per_token * T + ms_per_token_context * A / 1000``,
  where ``P`` is the prefill rows, ``T`` their new tokens and ``A`` the keys those tokens attend to (a row of
  ``n`` tokens after ``p`` has ``n * p + n * (n + 1) / 2``): the attention's cost grows with the context;
* ``decode_ms = base_ms + ms_per_row * R + ms_per_1k_context_tokens * C / 1000``, where ``R`` is the decode rows
  and ``C`` their context (each row's ``p + 1`` keys);
* a step takes ``prefill_ms`` if it has prefill rows plus ``decode_ms`` if it has decode rows.

Keys: ``name``, ``hardware``, ``model``, ``source`` (where the figures come from), ``kv_bytes_per_token`` (what
the prefix cache and the running sequences count per token), ``kv_capacity_tokens`` (tokens of KV the
modelled device holds: size ``kv_cache_bytes`` within ``kv_capacity_tokens * kv_bytes_per_token``),
``prefill`` and ``decode`` (the coefficients above, each >= 0), and optionally ``device`` (:data:`DEVICES`: where
the modelled forward runs; ``gpu`` by default), ``notes``, ``sources`` (one citation per figure, keyed like
``"decode.base_ms"``) and ``fit`` (how a fitted profile was measured).
Any other key is an error. Every figure a simulated engine gives is *modelled*, with the profile's name.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping

from warmup_tools.common.errors import ConfigError

#: Where the shipped profiles are (package data).
PROFILE_DIR = Path(__file__).with_name("profiles")
#: The profile of this project's demo LM on a development machine's CPU, fitted by profile_fit.
DEFAULT_PROFILE = "cpu-demo-lm"

_TOP_KEYS = frozenset({"name", "hardware", "model", "source", "kv_bytes_per_token", "kv_capacity_tokens", "prefill",
                       "decode", "device", "notes", "sources", "fit"})
#: Where a profile's forward runs, and so how the simulated engine spends its time: ``gpu``, waited out (a sleep:
#: the host's cores stay free, as they do while a GPU computes); ``cpu``, computed for (a core is kept busy for the
#: step's time, so the replica's other processes contend with it as they do with a CPU forward).
DEVICES = ("gpu", "cpu")
_REQUIRED = ("name", "hardware", "model", "source", "kv_bytes_per_token", "kv_capacity_tokens", "prefill", "decode")


@dataclasses.dataclass(frozen=True, slots=True)
class PrefillCost:
    """Milliseconds of a step's prefill rows (module doc)."""

    overhead_ms: float
    #: Per prefill row beyond the first (an engine that pads and masks a batch pays per row).
    ms_per_row: float
    ms_per_token: float
    ms_per_token_context: float


@dataclasses.dataclass(frozen=True, slots=True)
class DecodeCost:
    """Milliseconds of a step's decode rows (module doc)."""

    base_ms: float
    ms_per_row: float
    ms_per_1k_context_tokens: float


@dataclasses.dataclass(frozen=True, slots=True)
class StepShape:
    """The counts of one batched forward that its modelled time depends on."""

    prefill_rows: int = 0
    prefill_tokens: int = 0
    #: Keys the prefill rows' new tokens attend to, in thousands.
    prefill_context_k: float = 0.0
    decode_rows: int = 0
    #: Keys the decode rows attend to, in thousands.
    decode_context_k: float = 0.0

    @classmethod
    def of(cls, rows: Iterable[tuple[int, int]]) -> StepShape:
        """From each row's ``(new_tokens, position)``."""
        prefill_rows = prefill_tokens = decode_rows = 0
        prefill_keys = decode_keys = 0
        for new, position in rows:
            if new == 1 and position > 0:
                decode_rows += 1
                decode_keys += position + 1
            else:
                prefill_rows += 1
                prefill_tokens += new
                prefill_keys += new * position + new * (new + 1) // 2
        return cls(prefill_rows, prefill_tokens, prefill_keys / 1000, decode_rows, decode_keys / 1000)


@dataclasses.dataclass(frozen=True, slots=True)
class EngineProfile:
    """One hardware x model profile (module doc)."""

    name: str
    hardware: str
    model: str
    source: str
    kv_bytes_per_token: int
    kv_capacity_tokens: int
    prefill: PrefillCost
    decode: DecodeCost
    device: str = "gpu"
    notes: str = ""
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)
    fit: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def step_ms(self, shape: StepShape) -> float:
        """Modelled milliseconds of one batched forward."""
        ms = 0.0
        if shape.prefill_rows:
            p = self.prefill
            ms += (p.overhead_ms + p.ms_per_row * (shape.prefill_rows - 1) + p.ms_per_token * shape.prefill_tokens
                   + p.ms_per_token_context * shape.prefill_context_k)
        if shape.decode_rows:
            d = self.decode
            ms += d.base_ms + d.ms_per_row * shape.decode_rows + d.ms_per_1k_context_tokens * shape.decode_context_k
        return ms

    @property
    def label(self) -> str:
        """How a figure from this profile is labelled."""
        return f"modelled, profile {self.name}"

    @classmethod
    def from_json(cls, data: Any, origin: str) -> EngineProfile:
        """A profile from its JSON object; ``origin`` names the file in errors (:class:`ConfigError`)."""
        if not isinstance(data, dict):
            raise ConfigError(f"engine profile {origin}: not a JSON object")
        unknown = sorted(set(data) - _TOP_KEYS)
        missing = [key for key in _REQUIRED if key not in data]
        if unknown or missing:
            raise ConfigError(f"engine profile {origin}: " + "; ".join(
                part for part in (f"unknown key(s) {', '.join(unknown)}" if unknown else "",
                                  f"missing key(s) {', '.join(missing)}" if missing else "") if part))
        for key in ("name", "hardware", "model", "source", "notes"):
            if not isinstance(data.get(key, ""), str) or (key in _REQUIRED and not data[key]):
                raise ConfigError(f"engine profile {origin}: {key} must be a non-empty text")
        sources = data.get("sources", {})
        if not isinstance(sources, dict) or not all(isinstance(v, str) for v in sources.values()):
            raise ConfigError(f"engine profile {origin}: sources must map figures to texts")
        if not isinstance(data.get("fit", {}), dict):
            raise ConfigError(f"engine profile {origin}: fit must be an object")
        if data.get("device", "gpu") not in DEVICES:
            raise ConfigError(f"engine profile {origin}: device must be one of {', '.join(DEVICES)}")
        return cls(
            name=data["name"], hardware=data["hardware"], model=data["model"], source=data["source"],
            kv_bytes_per_token=_count(data, "kv_bytes_per_token", origin),
            kv_capacity_tokens=_count(data, "kv_capacity_tokens", origin),
            prefill=PrefillCost(**_costs(data, "prefill", PrefillCost, origin)),
            decode=DecodeCost(**_costs(data, "decode", DecodeCost, origin)), device=data.get("device", "gpu"),
            notes=data.get("notes", ""), sources=dict(sources), fit=dict(data.get("fit", {})))

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for key in ("notes", "sources", "fit"):
            if not data[key]:
                del data[key]
        return data


def load_profile(name_or_path: str | Path) -> EngineProfile:
    """A shipped profile by name (``cpu-demo-lm``), or a profile file by path; raises :class:`ConfigError`."""
    text = str(name_or_path)
    path = Path(text) if ("/" in text or text.endswith(".json")) else PROFILE_DIR / f"{text}.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"engine profile {text!r}: {path} does not exist; shipped profiles: "
                          f"{', '.join(profile_names())}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"engine profile {path}: not readable JSON ({exc})") from None
    return EngineProfile.from_json(data, str(path))


def profile_names() -> list[str]:
    """The shipped profiles' names."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def _count(data: Mapping[str, Any], key: str, origin: str) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"engine profile {origin}: {key} must be a whole number >= 1, got {value!r}")
    return value


def _costs(data: Mapping[str, Any], key: str, kind: type, origin: str) -> dict[str, float]:
    section = data[key]
    names = [field.name for field in dataclasses.fields(kind)]
    if not isinstance(section, dict) or set(section) != set(names):
        raise ConfigError(f"engine profile {origin}: {key} must hold exactly {', '.join(names)}")
    for name, value in section.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"engine profile {origin}: {key}.{name} must be a finite number >= 0, got {value!r}")
    return {name: float(section[name]) for name in names}
