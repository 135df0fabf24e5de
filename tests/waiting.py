"""Waiting for what another process or thread does, without depending on how fast the machine is.

A test that cannot be told (an event, a stream's response) polls: it checks a condition again and again
and fails only after ``HANG_S``, a bound that only a hang reaches, never a check of speed.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")

#: Long enough for the slowest machine the tests run on; only something that never happens waits this long.
HANG_S = 300.0


def wait_for(condition: Callable[[], T], what: str, *, timeout_s: float = HANG_S, poll_s: float = 0.05,
             detail: Callable[[], str] = lambda: "") -> T:
    """``condition()``'s first truthy value; AssertionError naming ``what`` (and ``detail()``) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout_s:g} s{detail()}")
        time.sleep(poll_s)
