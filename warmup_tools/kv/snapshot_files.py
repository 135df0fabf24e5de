"""The file names of KV snapshots in their shared folder (:mod:`warmup_tools.kv.snapshot` has the format).

One writer (an instance of one replica) owns the files of its snapshot name: ``<name>.manifest.json``, its
payloads ``<name>.<sha256[:16]>.safetensors`` and, while it writes one of them, a temporary file beside it
(``.<file>.<random>.tmp``, :func:`warmup_tools.common.files.write_atomic`). Nothing here imports torch: the
sidecar, which removes the files of writers that are gone, reads these names too.
"""

from __future__ import annotations

import re

MANIFEST_SUFFIX = ".manifest.json"
PAYLOAD_SUFFIX = ".safetensors"

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_PAYLOAD = re.compile(r"(?P<name>.+)\.[0-9a-f]{16}" + re.escape(PAYLOAD_SUFFIX))
_TEMPORARY = re.compile(r"\.(?P<file>.+)\.[A-Za-z0-9_]+\.tmp")


def snapshot_name(instance: str, host: str) -> str:
    """The file stem of one writer's snapshot: its instance name and host, filename-safe."""
    return _UNSAFE.sub("_", f"{instance}@{host}").strip("._") or "snapshot"


def payload_file(name: str, sha256: str) -> str:
    """The file name of snapshot ``name``'s payload whose bytes hash to ``sha256`` (hex)."""
    return f"{name}.{sha256[:16]}{PAYLOAD_SUFFIX}"


def snapshot_of(file_name: str) -> str | None:
    """The snapshot name whose writer owns ``file_name`` (its manifest, a payload, or a temporary file of
    either); None for a file that is none of these."""
    temporary = _TEMPORARY.fullmatch(file_name)
    if temporary is not None:
        file_name = temporary["file"]
    if file_name.endswith(MANIFEST_SUFFIX):
        return file_name[:-len(MANIFEST_SUFFIX)] or None
    payload = _PAYLOAD.fullmatch(file_name)
    return payload["name"] if payload is not None else None
