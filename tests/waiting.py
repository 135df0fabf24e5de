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


def wait_for_generation_to_leave(metrics_url: str, adapter: str, tokens_before: float) -> None:
    """Until lora_adapter counted tokens of ``adapter`` beyond ``tokens_before`` and runs and queues no sequence:
    a generation on ``adapter`` that began after ``tokens_before`` was read (and nothing else on it) has left.

    NOTE: never a wait for the generation to be seen running, a state it may have left before any scrape. The
    tokens counter only grows, and an instance counts a step's tokens after it set the running gauge for that
    step: tokens past ``tokens_before`` with no sequence running means the generation was counted and is gone.
    Its last tokens may be counted just after the gauge fell: they are, once a later request was answered."""
    from warmup_tools.server.client import metric_sum, scrape_metrics

    def left() -> bool:
        samples = scrape_metrics(metrics_url)
        busy = (metric_sum(samples, "warmup_scheduler_running_sequences")
                + metric_sum(samples, "warmup_scheduler_waiting_sequences"))
        return not busy and metric_sum(samples, "warmup_output_tokens_total", adapter=adapter) > tokens_before

    wait_for(left, f"the generation on {adapter} leaving the running batch")
