"""Reading a JSON file of the control folder: bounded in size and in nesting before the parser sees it.

The control folder (``desired.json``, ``plan.json``, the status files) is written by the operator's CLI
and by the instances, but whoever can write the folder can put anything there, and every instance and the
sidecar re-read it while serving. :func:`json.loads` recurses once per nesting level, so a file of
100,000 ``[`` raises ``RecursionError``, which no ``except ValueError`` catches. Here the nesting depth
is measured first, without recursion, on the file's bytes with its strings taken out, and every failure
is a :class:`~warmup_tools.common.errors.FileFormatError` that names the file and the cause.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any, BinaryIO

from warmup_tools.common.errors import FileFormatError

#: Deepest nesting a control file may have. The formats need 4 (document, adapters or items, one entry,
#: its list); the margin is for formats that grow, not for documents that recurse.
MAX_DEPTH = 32

#: A JSON string with its escapes (``"a \\" b"``): brackets inside strings do not nest.
_STRING = re.compile(rb'"(?:[^"\\]+|\\.)*"', re.DOTALL)
_BRACKETS = b"[]{}"
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _BRACKETS)
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def read_capped(file: BinaryIO, max_bytes: int, what: str) -> bytes:
    """At most ``max_bytes`` of an open file; FileFormatError naming ``what`` when it holds more."""
    raw = file.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise FileFormatError(f"{what}: larger than {max_bytes} bytes")
    return raw


def nesting_depth(raw: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest (0 for a scalar), in linear time, no recursion."""
    skeleton = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    # NOTE: map, accumulate and max all run in C: a 16 MiB file of brackets costs well under a second.
    return max(itertools.accumulate(map(_STEP.__getitem__, skeleton)), default=0)


def loads_bounded(raw: bytes, what: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """Parse ``raw`` as JSON that nests at most ``max_depth`` deep; FileFormatError naming ``what`` otherwise.

    The messages say what is wrong and where, never the bad content.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileFormatError(f"{what}: not JSON (not UTF-8 at byte {exc.start})") from None
    depth = nesting_depth(raw)
    if depth > max_depth:
        raise FileFormatError(f"{what}: nested {depth} levels deep, more than the {max_depth} allowed")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise FileFormatError(f"{what}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:  # NOTE: not reachable below MAX_DEPTH; kept so no parser error can escape
        raise FileFormatError(f"{what}: nested too deep to parse") from None


def read_json_bounded(path: Path, *, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """Read and parse a control file of at most ``max_bytes``; FileFormatError (naming the file) otherwise."""
    try:
        with open(path, "rb") as file:
            raw = read_capped(file, max_bytes, str(path))
    except OSError as exc:
        raise FileFormatError(f"{path}: cannot read ({exc.strerror or type(exc).__name__})") from None
    return loads_bounded(raw, str(path), max_depth=max_depth)
