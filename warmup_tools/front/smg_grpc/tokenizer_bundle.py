"""The LM tokenizer as smg's ``GetTokenizer`` stream: a deflate zip of the tokenizer folder's files at the zip's
root, sent in chunks of at most 64 KiB, the SHA-256 (hex) of the whole zip on the last chunk only.

Built once, from regular files only, each and all together bounded; the zip is deterministic (sorted names, a fixed
time stamp), so every replica of a model sends the same bytes and the same digest.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import io
import zipfile
from pathlib import Path
from typing import Iterator

from warmup_tools.common.errors import ConfigError
from warmup_tools.common.regular_file import read_regular

#: The files smg reads from a tokenizer bundle (names, or patterns).
BUNDLE_FILES: tuple[str, ...] = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json",
                                 "special_tokens_map.json", "chat_template.json", "*.jinja")
#: Largest chunk smg takes.
CHUNK_BYTES = 64 << 10
#: Largest file, and largest bundle, this worker sends (a large vocabulary's tokenizer.json is tens of MB).
MAX_FILE_BYTES = 64 << 20
MAX_BUNDLE_BYTES = 128 << 20
#: A fixed time stamp, so that the zip's bytes depend on the files alone.
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)


@dataclasses.dataclass(frozen=True, slots=True)
class TokenizerBundle:
    data: bytes
    sha256: str
    names: tuple[str, ...]

    @classmethod
    def from_folder(cls, folder: Path) -> TokenizerBundle:
        """The bundle of ``folder``'s tokenizer files; ConfigError when it has no ``tokenizer.json`` or a file is
        not a regular file or is too large."""
        try:
            present = sorted(entry.name for entry in folder.iterdir())
        except OSError as exc:
            raise ConfigError(f"the LM tokenizer folder {folder} cannot be listed: {exc.strerror}") from None
        names = [name for name in present if any(fnmatch.fnmatchcase(name, pattern) for pattern in BUNDLE_FILES)]
        if "tokenizer.json" not in names:
            raise ConfigError(f"the LM tokenizer folder {folder} has no tokenizer.json")
        out = io.BytesIO()
        total = 0
        with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as bundle:
            for name in names:
                try:
                    data, _ = read_regular(folder / name, MAX_FILE_BYTES, follow_symlinks=True)
                except (OSError, ValueError) as exc:
                    raise ConfigError(f"the tokenizer file {folder / name} is not bundled: {exc}") from None
                total += len(data)
                if total > MAX_BUNDLE_BYTES:
                    raise ConfigError(f"the tokenizer files of {folder} exceed {MAX_BUNDLE_BYTES} bytes")
                info = zipfile.ZipInfo(name, date_time=_ZIP_TIME)
                info.compress_type = zipfile.ZIP_DEFLATED
                info.external_attr = 0o644 << 16
                bundle.writestr(info, data)
        data = out.getvalue()
        return cls(data, hashlib.sha256(data).hexdigest(), tuple(names))

    def chunks(self) -> Iterator[tuple[bytes, str]]:
        """``(data, sha256)`` of each chunk: the digest on the last one only, empty on the others."""
        size = len(self.data)
        for start in range(0, size, CHUNK_BYTES):
            end = min(start + CHUNK_BYTES, size)
            yield self.data[start:end], self.sha256 if end == size else ""
