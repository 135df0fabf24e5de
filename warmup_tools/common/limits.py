"""Bounds that more than one process enforces on the same input, defined once."""

from __future__ import annotations

#: The largest body of an OpenAI API request: the front's default ``max_body_bytes`` (413 above it), and the
#: router's ``--max-payload-size``, so that smg refuses what a front would before it buffers it to route.
MAX_BODY_BYTES = 1 << 20
