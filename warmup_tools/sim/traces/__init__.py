"""Public production traces with prefix hash ids, read and scaled for a replay (sources: TRACES.md here).

A trace is one request per line: its arrival (ms from the trace's start), its input and output lengths in
tokens, and the ids of its prompt's blocks (``hash_ids``, ``source_block`` tokens each): two requests whose
lists start alike share that prefix. No text is in a trace; :class:`TracePrompts` makes it.

Two scales fit a trace to a smaller model and machine:

- **length**: each block becomes ``block_tokens`` tokens (a request of ``M`` blocks whose last holds ``tail``
  of ``source_block`` tokens gets ``(M - 1) * block_tokens + ceil(tail * block_tokens / source_block)``), so the
  structure of shared prefixes is kept whole while prompts fit the model's context; outputs are scaled by
  ``output_scale`` (at least one token, at most ``max_output_tokens``);
- **time**: arrivals are divided by ``speedup``.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import random
from pathlib import Path
from typing import Any, Iterator, Sequence

from warmup_tools.common.errors import ConfigError

HERE = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True, slots=True)
class TraceSource:
    """One trace file and what its ids mean."""

    path: Path
    #: Tokens per hash id in the original trace.
    source_block: int
    #: One line on what the trace is.
    about: str


TRACES: dict[str, TraceSource] = {
    "conversation": TraceSource(HERE / "mooncake_conversation.jsonl.gz", 512,
                                "Mooncake FAST'25 conversation trace: one hour of a chat service (12,031 requests)"),
    "synthetic": TraceSource(HERE / "mooncake_synthetic.jsonl.gz", 512,
                             "Mooncake FAST'25 synthetic trace: public datasets, Poisson arrivals, multi-turn "
                             "conversations in order (3,993 requests)"),
}


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a scaled trace."""

    #: Seconds from the trace's start (after ``speedup``).
    at_s: float
    hash_ids: tuple[int, ...]
    #: Prompt tokens after the length scale (the last block may be partial).
    input_tokens: int
    output_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class TraceScale:
    """How a trace is fitted to the model and machine that replay it."""

    #: Tokens each hash block becomes.
    block_tokens: int = 16
    #: Arrivals are divided by this (2: twice as fast).
    speedup: float = 1.0
    output_scale: float = 1.0 / 16
    max_output_tokens: int = 64
    #: Requests whose scaled prompt is longer are left out (the model's context, less the output).
    max_input_tokens: int = 1536
    #: Only requests arriving in [start_s, start_s + duration_s) of the original trace (None: to its end).
    start_s: float = 0.0
    duration_s: float | None = None
    #: At most this many requests (None: all).
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.block_tokens < 1 or self.max_output_tokens < 1 or self.max_input_tokens < 1:
            raise ConfigError("block_tokens, max_output_tokens and max_input_tokens must be at least 1")
        if not (self.speedup > 0 and self.output_scale > 0 and self.start_s >= 0):
            raise ConfigError("speedup and output_scale must be positive and start_s not negative")
        if (self.duration_s is not None and not self.duration_s > 0) or (self.limit is not None and self.limit < 1):
            raise ConfigError("duration_s and limit must be positive when given")


def load_trace(name: str, scale: TraceScale = TraceScale()) -> list[TraceRequest]:
    """The requests of trace ``name`` (:data:`TRACES`), scaled, in arrival order."""
    if name not in TRACES:
        raise ConfigError(f"unknown trace {name!r}; known: {', '.join(TRACES)}")
    source = TRACES[name]
    out: list[TraceRequest] = []
    end_ms = None if scale.duration_s is None else (scale.start_s + scale.duration_s) * 1000
    for row in _rows(source.path):
        ts = float(row["timestamp"])
        if ts < scale.start_s * 1000:
            continue
        if end_ms is not None and ts >= end_ms:
            break
        request = scale_request(row, source.source_block, scale)
        if request.input_tokens > scale.max_input_tokens:
            continue
        out.append(request)
        if scale.limit is not None and len(out) >= scale.limit:
            break
    return out


def scale_request(row: dict[str, Any], source_block: int, scale: TraceScale) -> TraceRequest:
    """One trace line under ``scale``; :class:`ConfigError` for a line that is not a trace request."""
    try:
        ids = tuple(int(h) for h in row["hash_ids"])
        length, output, ts = int(row["input_length"]), int(row["output_length"]), float(row["timestamp"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"not a trace request: {str(row)[:200]} ({exc})") from None
    if not ids or not (len(ids) - 1) * source_block < length <= len(ids) * source_block or output < 0:
        raise ConfigError(f"a trace request's lengths do not fit its {len(ids)} blocks: {str(row)[:200]}")
    tail = length - (len(ids) - 1) * source_block
    tokens = (len(ids) - 1) * scale.block_tokens + math.ceil(tail * scale.block_tokens / source_block)
    outputs = min(scale.max_output_tokens, max(1, round(output * scale.output_scale)))
    return TraceRequest(ts / 1000 / scale.speedup - scale.start_s / scale.speedup, ids, tokens, outputs)


class TracePrompts:
    """Text for hash ids: each id is the same ``block_tokens`` words wherever it appears, each word one token of
    ``tokenizer`` after a space, so a prompt of ``n`` scaled tokens is exactly ``n`` tokens (plus the tokenizer's
    special tokens) and two prompts share exactly the tokens of their shared blocks."""

    def __init__(self, tokenizer: Any, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._encode = tokenizer.encode
        self.words = single_token_words(tokenizer)
        if len(self.words) < 64:
            raise ConfigError("the tokenizer has fewer than 64 words that are one token after a space")
        self._blocks: dict[int, str] = {}

    def prompt(self, request: TraceRequest) -> str:
        parts, left = [], request.input_tokens
        for h in request.hash_ids:
            words = self._block(h)
            parts.append(words if left >= self.block_tokens else words[:left])
            left -= len(parts[-1])
            if left <= 0:
                break
        return "".join(" " + w for block in parts for w in block)

    def _block(self, hash_id: int) -> list[str]:
        # NOTE: seeded by the id alone (not by Python's hash()): the same text in every process and run.
        rng = random.Random(f"trace-block-{hash_id}")
        return [rng.choice(self.words) for _ in range(self.block_tokens)]


def single_token_words(tokenizer: Any) -> list[str]:
    """Alphabetic words of at least three letters that ``tokenizer`` encodes as one token after a space,
    sorted (so a seeded choice among them is the same everywhere)."""
    words = []
    for piece in tokenizer.get_vocab():
        word = piece[1:] if piece[:1] in ("Ġ", "▁") else ""
        if len(word) >= 3 and word.isascii() and word.isalpha():
            if len(tokenizer.encode(" " + word, add_special_tokens=False)) == 1:
                words.append(word)
    return sorted(words)


def _rows(path: Path) -> Iterator[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                yield json.loads(line)


def prefix_reuse(requests: Sequence[TraceRequest]) -> float:
    """The share of the requests' blocks that an earlier request of the list also carried after an identical
    prefix (what an unbounded prefix cache would serve)."""
    nodes: dict[tuple[int, int], int] = {}  # (parent node, hash id) -> node: the trie of prefixes seen
    hit = total = 0
    for r in requests:
        parent = -1
        for h in r.hash_ids:
            node = nodes.get((parent, h))
            if node is None:
                node = nodes[(parent, h)] = len(nodes)
            else:
                hit += 1
            parent = node
        total += len(r.hash_ids)
    return hit / total if total else 0.0
