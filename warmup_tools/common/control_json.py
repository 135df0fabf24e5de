"""Reading a JSON file of the control folder: bounded in size and in nesting before the parser sees it.

The control folder (``desired.json``, ``plan.json``, the status files) is written by the operator's CLI
and by the instances, but whoever can write the folder can put anything there, and every instance and the
sidecar re-read it while serving. The parser is :func:`json.loads` (C, linear in the file's size); it
recurses once per nesting level and raises ``RecursionError`` on a file of 100,000 ``[``, which no
``except ValueError`` catches: here that is a format error too, and a document that parsed is then measured,
without recursion, against :data:`MAX_DEPTH`. Every failure is a
:class:`~warmup_tools.common.errors.FileFormatError` that names the file and the cause.

NOTE: no regular expression or other scan runs over the raw bytes first: a pre-scan that skipped strings with
a backtracking pattern took exponential time on one unclosed quote, holding the GIL of every thread of the
process that read the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, BinaryIO

from warmup_tools.common.errors import FileFormatError

#: Deepest nesting a control file may have. The formats need 4 (document, adapters or items, one entry,
#: its list); the margin is for formats that grow, not for documents that recurse.
MAX_DEPTH = 32


def read_capped(file: BinaryIO, max_bytes: int, what: str) -> bytes:
    """At most ``max_bytes`` of an open file; FileFormatError naming ``what`` when it holds more."""
    raw = file.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise FileFormatError(f"{what}: larger than {max_bytes} bytes")
    return raw


def nesting_depth(value: Any) -> int:
    """How deep the arrays and objects of a parsed JSON value nest (0 for a scalar), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in node if isinstance(child, (dict, list)))
    return deepest


def loads_bounded(raw: bytes, what: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """Parse ``raw`` as JSON that nests at most ``max_depth`` deep; FileFormatError naming ``what`` otherwise.

    The messages say what is wrong and where, never the bad content.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileFormatError(f"{what}: not JSON (not UTF-8 at byte {exc.start})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FileFormatError(f"{what}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise FileFormatError(f"{what}: nested deeper than the parser's recursion limit, more than the "
                              f"{max_depth} levels allowed") from None
    depth = nesting_depth(value)
    if depth > max_depth:
        raise FileFormatError(f"{what}: nested {depth} levels deep, more than the {max_depth} allowed")
    return value


def read_json_bounded(path: Path, *, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """Read and parse a control file of at most ``max_bytes``; FileFormatError (naming the file) otherwise."""
    try:
        with open(path, "rb") as file:
            raw = read_capped(file, max_bytes, str(path))
    except OSError as exc:
        raise FileFormatError(f"{path}: cannot read ({exc.strerror or type(exc).__name__})") from None
    return loads_bounded(raw, str(path), max_depth=max_depth)
