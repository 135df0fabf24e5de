"""A replica's name: what it is called in the shared folders (its request-log folder, its KV snapshot files, its
coverage and status reports), from a setting or else the host name.

The name is joined into paths, so it must be one safe path component: letters, digits, ``.``, ``_`` and ``-``,
starting and ending with a letter or digit (so never ``.`` or ``..``; and a KV snapshot's file name, which drops
a trailing ``.`` or ``_``, still ends with the name), at most :data:`MAX_NAME_BYTES`. A bad name, set or taken
from the host, is a :class:`~warmup_tools.common.errors.ConfigError` where it enters, never a path.
"""

from __future__ import annotations

import re
import socket

from warmup_tools.common.errors import ConfigError

#: A host name's longest (RFC 1035); far more than a replica name needs.
MAX_NAME_BYTES = 253
_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")


def replica_name(name: str | None = None) -> str:
    """``name`` (else this host's name), checked as one safe path component; ConfigError naming it otherwise."""
    chosen = name or socket.gethostname()
    where = "the replica name" if name else "the host name (the replica name when none is set)"
    if not is_replica_name(chosen):
        raise ConfigError(f"{where} {chosen!r} cannot name a folder or file: use 1 to {MAX_NAME_BYTES} letters, "
                          "digits, '.', '_' or '-', starting and ending with a letter or digit (set replica_name / "
                          "--replica-name / WARMUP_REPLICA_NAME)")
    return chosen


def is_replica_name(name: str) -> bool:
    """Whether ``name`` passes :func:`replica_name`'s check (a folder or file named otherwise is no replica's)."""
    return len(name.encode("utf-8")) <= MAX_NAME_BYTES and _NAME.fullmatch(name) is not None
