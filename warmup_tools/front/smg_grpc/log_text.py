"""The prompt text of a gRPC worker request, for ``lora_adapter``'s request log.

smg sends token ids alone, so without this the request log (what the planner learns the hot prefixes from) would
hold gRPC traffic as records without a prompt, and a fleet on the gRPC path would never be planned for. The ids are
decoded with the LM's tokenizer and the text is kept only when it round-trips: encoded as ``tokenizer_cache`` and the
planner encode (``add_special_tokens=True``), it gives the same ids, so a plan made from the log warms exactly the
blocks smg's requests ask for. A prompt that does not round-trip (a tokenizer that adds a BOS the router also sent,
ids no text gives) is logged without its text.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

LOGGER = logging.getLogger(__name__)


class LogText:
    """Decodes prompts with the LM's ``tokenizer.json`` (the ``tokenizers`` library: no torch, no transformers)."""

    def __init__(self, tokenizer_json: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(tokenizer_json))
        self.unmatched = 0

    @classmethod
    def from_folder(cls, folder: Path | None) -> "LogText | None":
        if folder is None or not (Path(folder) / "tokenizer.json").is_file():
            return None
        try:
            return cls(Path(folder) / "tokenizer.json")
        except Exception as exc:  # noqa: BLE001 - a tokenizer file the library cannot read: log without text
            LOGGER.warning("the gRPC worker logs prompts without text: %s cannot be read (%s)", folder, exc)
            return None

    def __call__(self, ids: Sequence[int]) -> str | None:
        """The text whose encoding is ``ids``, or None."""
        ids = list(ids)
        try:
            text = self._tokenizer.decode(ids, skip_special_tokens=False)
            if self._tokenizer.encode(text, add_special_tokens=True).ids == ids:
                return text
        except Exception:  # noqa: BLE001 - ids the tokenizer cannot decode: no text
            pass
        self.unmatched += 1
        return None
