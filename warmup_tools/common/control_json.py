"""Reading a JSON file of the control folder: bounded in size and in nesting before the parser sees it.

The control folder (``desired.json``, ``plan.json``, the status files) is written by the operator's CLI
and by the instances, but whoever can write the folder can put anything there, and every instance and the
sidecar re-read it while serving. The parser is :func:`json.loads` (C, linear in the file's size); it
recurses once per nesting level and raises ``RecursionError`` on a file of 100,000 ``[``, which no
``except ValueError`` catches: here that is a format error too, and a document that parsed is then measured,
without recursion, against :data:`MAX_DEPTH`. Every failure is a
:class:`~warmup_tools.common.errors.FileFormatError` that names the file and the cause.

A reader that names ``max_values`` also bounds what parsing costs: the parser makes one Python object per JSON
value (a ``[]`` of 3 bytes is a list of 56 bytes and more), so 16 MiB of ``[[],[],...]`` took 5.7 s and 774 MiB
to parse. :func:`json_values` counts the values on the raw bytes first, with C-speed bytes operations only
(``translate``, ``replace``, ``split``, ``join``: each one pass, no pattern), and a file with more is refused
before it is parsed. A format whose entries hold long lists of numbers (a plan's token ids) names
``max_containers`` instead: :func:`json_containers` counts its arrays and objects the same way, the values that
cost most to make (an empty list, 3 bytes, is 56 bytes and more; a number ``0,`` is a pointer to a shared int).

NOTE: no regular expression runs over the raw bytes: a pre-scan that skipped strings with a backtracking
pattern took exponential time on one unclosed quote, holding the GIL of every thread of the process that read
the file (and a possessive pattern is still quadratic on an unclosed run of escaped quotes: each one starts a
new attempt that scans to the end).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, BinaryIO

from warmup_tools.common.errors import FileFormatError
from warmup_tools.common.regular_file import FileTooLarge, read_regular

#: Deepest nesting a control file may have. The formats need 4 (document, adapters or items, one entry,
#: its list); the margin is for formats that grow, not for documents that recurse.
MAX_DEPTH = 32


def read_capped(file: BinaryIO, max_bytes: int, what: str) -> bytes:
    """At most ``max_bytes`` of an open file; FileFormatError naming ``what`` when it holds more."""
    raw = file.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise FileFormatError(f"{what}: larger than {max_bytes} bytes")
    return raw


#: Every byte but those :func:`json_values` counts with: the quote and ``,`` ``[`` ``{``.
_NOT_COUNTED = bytes(b for b in range(256) if b not in b'",[{')
#: Every byte but those :func:`json_containers` counts with: the quote and ``[`` ``{``.
_NOT_CONTAINERS = bytes(b for b in range(256) if b not in b'"[{')
#: Bytes :func:`_outside_strings` splits at a time (its lists of pieces stay small).
_CHUNK = 1 << 20


def json_values(raw: bytes) -> int:
    """At most how many values (arrays, objects, strings, numbers, literals; not the keys) the JSON ``raw`` holds,
    counted without parsing it: one, and one per ``,``, ``[`` and ``{`` outside strings (each value but a
    container's first follows a comma; each first one is in a container). Linear in ``len(raw)``.

    Strings are found as JSON delimits them: every escaped backslash and escaped quote removed, the quotes left
    alternate open and close. For a document that is not JSON the count is some number; the parser refuses it.
    """
    return 1 + _outside_strings(raw, _NOT_COUNTED)


def json_containers(raw: bytes) -> int:
    """How many arrays and objects the JSON ``raw`` holds, counted without parsing it: its ``[`` and ``{`` outside
    strings (found as :func:`json_values` finds them). Linear in ``len(raw)``."""
    return _outside_strings(raw, _NOT_CONTAINERS)


def _outside_strings(raw: bytes, not_counted: bytes) -> int:
    """How many bytes of ``raw`` that ``not_counted`` leaves (quotes aside) are outside its JSON strings."""
    # Escapes out of the way, "\\" first (so that "\\\"" is a backslash and an escaped quote, and "\\"" a
    # backslash and a closing quote), on the raw bytes (the byte after a backslash must still be there), then only
    # the bytes that count; no backslash is left but one outside any string (not JSON: it counts nothing).
    marks = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, not_counted)
    # Two quotes side by side hold nothing counted between them (an empty string, or a key's close and its
    # value's open): out, they keep the parity and spare the split one piece each.
    marks = marks.replace(b'""', b"")
    count, inside = 0, False
    for start in range(0, len(marks), _CHUNK):
        pieces = marks[start:start + _CHUNK].split(b'"')
        # Outside strings: the even pieces, or the odd ones while the chunk begins inside a string; every byte of
        # a piece is counted.
        count += len(b"".join(pieces[1::2] if inside else pieces[0::2]))
        inside ^= (len(pieces) - 1) % 2 == 1
    return count


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


def loads_bounded(raw: bytes, what: str, *, max_depth: int = MAX_DEPTH, max_values: int | None = None,
                  max_containers: int | None = None) -> Any:
    """Parse ``raw`` as JSON that nests at most ``max_depth`` deep and, with ``max_values``, holds at most that
    many values (:func:`json_values`), with ``max_containers`` at most that many arrays and objects
    (:func:`json_containers`), both counted before parsing; FileFormatError naming ``what`` otherwise.

    The messages say what is wrong and where, never the bad content.
    """
    if max_values is not None:
        values = json_values(raw)
        if values > max_values:
            raise FileFormatError(f"{what}: {values} JSON values by its commas and brackets, more than the "
                                  f"{max_values} allowed (refused before parsing)")
    if max_containers is not None:
        containers = json_containers(raw)
        if containers > max_containers:
            raise FileFormatError(f"{what}: {containers} JSON arrays and objects by its brackets, more than the "
                                  f"{max_containers} allowed (refused before parsing)")
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


def read_file_capped(path: Path, max_bytes: int, what: str) -> bytes:
    """A control file's bytes, at most ``max_bytes`` (FileFormatError naming ``what`` when it holds more), from a
    regular file only: a FIFO there is refused, not waited on (:func:`~warmup_tools.common.regular_file.read_regular`,
    whose OSErrors pass through: ``FileNotFoundError``, ``NotARegularFile``)."""
    try:
        return read_regular(path, max_bytes, follow_symlinks=True)[0]
    except FileTooLarge:
        raise FileFormatError(f"{what}: larger than {max_bytes} bytes") from None


def read_json_bounded(path: Path, *, max_bytes: int, max_depth: int = MAX_DEPTH,
                      max_values: int | None = None, max_containers: int | None = None) -> Any:
    """Read (:func:`read_file_capped`) and parse a control file of at most ``max_bytes``; FileFormatError (naming the
    file) otherwise."""
    try:
        raw = read_file_capped(path, max_bytes, str(path))
    except OSError as exc:
        raise FileFormatError(f"{path}: cannot read ({exc.strerror or type(exc).__name__})") from None
    return loads_bounded(raw, str(path), max_depth=max_depth, max_values=max_values,
                         max_containers=max_containers)
