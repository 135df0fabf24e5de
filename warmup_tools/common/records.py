"""The request record: one line of the request log, the unit the planner learns from.

One typed, versioned record crosses three processes: ``lora_adapter`` writes it
(:mod:`warmup_tools.lora_adapter.request_log`), the traffic generator writes the same shape
(:mod:`warmup_tools.sim.traffic`), and the planner and the Locust replay read it back through
:func:`read_request_log`. Version 1 logs written before the ``v`` field existed read as version 1.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from warmup_tools.common.digests import prompt_digest
from warmup_tools.common.jsonl import ReadStats, iter_json_lines

#: The record layout this package writes and reads; a newer one is skipped and counted, not guessed at.
RECORD_VERSION = 1
#: The tenant of health probes (the sidecar's readiness probes, one every few seconds): never logged, so a
#: plan never learns from them. Probes use their own tenant so their cache entries never mix with a real
#: tenant's either.
#: A valid tenant name (see ``triton.inputs``), reserved for probes.
PROBE_TENANT = "warmup-sidecar-probe"

#: The JSON keys of a record, in the order they are written.
RECORD_KEYS = ("v", "ts", "tenant", "adapter", "prompt_digest", "prompt", "prompt_tokens", "cached_tokens",
               "ttft_ms", "output_tokens", "cluster", "template")
#: A key written after those only when the record has it: a chat request's role spans.
ROLES_KEY = "roles"
#: A key written only when the record has it: the cached prompt tokens that came from the plan's pinned blocks.
PLANNED_KEY = "planned_tokens"
#: A rendered conversation's role spans, as the OpenAI front sends them (the request parameter
#: ``chat_roles``) and the log keeps them: at most this many spans, roles of at most 16 characters.
MAX_ROLE_SPANS = 64
_ROLE = re.compile(r"[a-z_]{1,16}")


class RecordError(ValueError):
    """A JSON object is not a request record; the message names the field."""


@dataclasses.dataclass(frozen=True, slots=True)
class RequestRecord:
    """One served (or generated) request. Fields a generator cannot know are None."""

    #: Epoch seconds at arrival.
    ts: float
    tenant: str = "default"
    #: The LoRA adapter; "" for the base model.
    adapter: str = ""
    prompt_digest: str | None = None
    #: The prompt text; None when the log is redacted.
    prompt: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    ttft_ms: float | None = None
    output_tokens: int | None = None
    cluster: int | None = None
    #: The traffic generator's ground-truth template label (tests only; a real log has none).
    template: str | None = None
    #: A chat request's role structure: ``((role, start, end), ...)``, the characters of ``prompt`` (the
    #: rendered conversation) each message became; None for a raw prompt.
    roles: tuple[tuple[str, int, int], ...] | None = None
    #: Of ``cached_tokens``, those from KV blocks the warm-up plan pinned (None: not recorded).
    planned_tokens: int | None = None

    @classmethod
    def served(cls, *, ts: float, tenant: str, adapter: str | None, prompt: str | None, prompt_tokens: int,
               cached_tokens: int, ttft_ms: float, output_tokens: int, cluster: int, redact: bool,
               digest_key: bytes = b"", roles: tuple[tuple[str, int, int], ...] | None = None,
               planned_tokens: int | None = None) -> RequestRecord:
        """The record of a request ``lora_adapter`` served (the prompt dropped when ``redact``; the digest
        keyed with ``digest_key`` in trust mode)."""
        return cls(ts=round(ts, 3), tenant=tenant, adapter=adapter or "",
                   prompt_digest=prompt_digest(prompt, digest_key) if prompt is not None else None,
                   prompt=None if redact else prompt, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                   ttft_ms=round(ttft_ms, 2), output_tokens=output_tokens, cluster=cluster, roles=roles or None,
                   planned_tokens=planned_tokens)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RequestRecord:
        """Validate one JSON object; :class:`RecordError` names the field that is wrong."""
        version = data.get("v", 1)
        if version != RECORD_VERSION:
            raise RecordError(f"record version {version!r}; this package reads version {RECORD_VERSION}")
        ts = data.get("ts")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
            raise RecordError(f"'ts' must be epoch seconds, got {ts!r}")
        prompt = data.get("prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise RecordError(f"'prompt' must be text, got {type(prompt).__name__}")
        digest = data.get("prompt_digest")
        return cls(
            ts=float(ts),
            tenant=str(data.get("tenant") or "default"),
            adapter=str(data.get("adapter") or ""),
            prompt_digest=str(digest) if digest else None,
            prompt=prompt if prompt else None,
            prompt_tokens=_optional(data, "prompt_tokens", int),
            cached_tokens=_optional(data, "cached_tokens", int),
            ttft_ms=_optional(data, "ttft_ms", float),
            output_tokens=_optional(data, "output_tokens", int),
            cluster=_optional(data, "cluster", int),
            template=None if data.get("template") is None else str(data["template"]),
            roles=_roles(data.get(ROLES_KEY)),
            planned_tokens=_optional(data, PLANNED_KEY, int),
        )

    def to_json(self, *, with_template: bool = False) -> dict[str, Any]:
        """The JSON object in :data:`RECORD_KEYS` order; a redacted record has no ``prompt`` key."""
        out: dict[str, Any] = {"v": RECORD_VERSION}
        for key in RECORD_KEYS[1:]:
            value = getattr(self, key)
            if key == "prompt" and value is None:
                continue
            if key == "template" and not with_template:
                continue
            out[key] = value
        if self.roles is not None:
            out[ROLES_KEY] = [list(span) for span in self.roles]
        if self.planned_tokens is not None:
            out[PLANNED_KEY] = self.planned_tokens
        return out


def log_files(paths: str | Path | Iterable[str | Path]) -> list[Path]:
    """``paths`` with every folder replaced by the request logs in it and in its subfolders one level down (a
    fleet's log folder holds one per replica): ``*.jsonl``, ``*.jsonl.gz`` and the rotated ``*.jsonl.N`` files
    (oldest first, so records come roughly in time order)."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    out: list[Path] = []
    for path in map(Path, paths):
        if not path.is_dir():
            out.append(path)
            continue
        for folder in [path, *sorted(p for p in path.iterdir() if p.is_dir())]:
            found = [p for p in folder.iterdir() if p.is_file() and _log_rank(p.name) is not None]
            out += sorted(found, key=lambda p: (p.name.split(".jsonl")[0], -_log_rank(p.name)))
    return out


def _log_rank(name: str) -> int | None:
    """0 for a current log, ``N`` for its ``N``-th rotated backup (``.jsonl.N``), None for other files."""
    if name.endswith((".jsonl", ".jsonl.gz")):
        return 0
    head, _, suffix = name.rpartition(".")
    return int(suffix) if head.endswith(".jsonl") and suffix.isdigit() else None


def read_request_log(paths: str | Path | Iterable[str | Path],
                     stats: ReadStats | None = None) -> Iterator[RequestRecord]:
    """Request records from JSON-lines logs (gzip too); bad lines and bad records are skipped and
    counted in ``stats`` with their file and line."""
    stats = stats if stats is not None else ReadStats()
    for path, line, data in iter_json_lines(paths, stats):
        try:
            yield RequestRecord.from_json(data)
        except RecordError as exc:
            stats.records -= 1
            stats.skip(path, line, str(exc))


def parse_role_spans(text: str, max_bytes: int = 4096) -> tuple[tuple[str, int, int], ...]:
    """The ``chat_roles`` request parameter (JSON ``[[role, start, end], ...]``), checked; RecordError if not."""
    if len(text) > max_bytes:
        raise RecordError(f"'chat_roles' is longer than {max_bytes} characters")
    try:
        data = json.loads(text)
    except ValueError:
        raise RecordError("'chat_roles' is not JSON") from None
    return _roles(data) or ()


def _roles(value: Any) -> tuple[tuple[str, int, int], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_ROLE_SPANS:
        raise RecordError(f"'roles' must be a list of at most {MAX_ROLE_SPANS} [role, start, end] spans")
    spans, end = [], 0
    for span in value:
        if (not isinstance(span, list) or len(span) != 3 or not isinstance(span[0], str)
                or not _ROLE.fullmatch(span[0]) or any(isinstance(v, bool) or not isinstance(v, int)
                                                       for v in span[1:]) or not end <= span[1] <= span[2]):
            raise RecordError(f"'roles' holds {str(span)[:40]!r}: spans are [role, start, end], in order")
        spans.append((span[0], span[1], span[2]))
        end = span[2]
    return tuple(spans)


def _optional(data: Mapping[str, Any], key: str, cast: type) -> Any:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecordError(f"'{key}' must be a number or null, got {value!r}")
    return cast(value)
