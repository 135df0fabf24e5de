"""The engine gate: live requests before warm-up, warm-up paced to its share of the engine's time."""

from __future__ import annotations

import queue
import threading

import pytest

from warmup_tools.common.errors import ConfigError
from warmup_tools.lora_adapter import service as lora_service
from warmup_tools.lora_adapter.service import EngineGate, warm_chunk_ends

HANG_S = 30.0  # only a thread that never gets there waits this long


class WaitRecorder(threading.Condition):
    """The gate's condition, telling the test which thread went to wait on it (the thread's name).

    A thread reports while it still holds the lock, which it gives up only inside ``wait``: so once the test
    has read a name, that thread waits on the gate before any thread the test starts after it can look.
    """

    def __init__(self) -> None:
        super().__init__()
        self.waiters: queue.Queue[str] = queue.Queue()

    def wait(self, timeout=None):
        self.waiters.put(threading.current_thread().name)
        return super().wait(timeout)

    def next_waiter(self) -> str:
        return self.waiters.get(timeout=HANG_S)


def recording_gate(priority: str) -> tuple[EngineGate, WaitRecorder]:
    gate = EngineGate(priority, warm_share=1.0)
    gate._cond = recorder = WaitRecorder()  # before any thread uses the gate
    return gate, recorder


def test_a_waiting_live_request_goes_before_the_next_warm_step():
    gate, recorder = recording_gate("live_first")
    order: list[str] = []
    holding, release = threading.Event(), threading.Event()

    def first_warm_step():
        with gate.background():
            holding.set()
            release.wait(HANG_S)
            order.append("warm 1")

    def next_warm_step():
        with gate.background():
            order.append("warm 2")

    def live_request():
        with gate.live():
            order.append("live")

    threads = [threading.Thread(target=first_warm_step, name="warm 1")]
    threads[0].start()
    assert holding.wait(HANG_S)
    threads.append(threading.Thread(target=next_warm_step, name="warm 2"))
    threads[1].start()
    assert recorder.next_waiter() == "warm 2"  # the second warm step is queued first...
    threads.append(threading.Thread(target=live_request, name="live"))
    threads[2].start()
    assert recorder.next_waiter() == "live" and gate.live_waiting == 1  # ...and the live request after it
    release.set()
    for thread in threads:
        thread.join(HANG_S)
    assert order == ["warm 1", "live", "warm 2"]


def test_warm_up_waits_while_a_live_request_holds_the_engine():
    gate, recorder = recording_gate("live_first")
    done = threading.Event()

    def warm_step():
        with gate.background():
            done.set()

    with gate.live():
        waiter = threading.Thread(target=warm_step, name="warm")
        waiter.start()
        assert recorder.next_waiter() == "warm"
        assert not done.is_set()  # warm-up waits while a live request holds the engine
    assert done.wait(HANG_S)
    waiter.join(HANG_S)


@pytest.mark.parametrize(("share", "rest"), [(0.5, 0.2), (0.25, 0.6), (1.0, None)])
def test_warm_steps_rest_so_they_hold_at_most_their_share(monkeypatch, share, rest):
    clock = iter([10.0, 10.2])
    slept: list[float] = []
    monkeypatch.setattr(lora_service.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(lora_service.time, "sleep", slept.append)
    gate = EngineGate("live_first", warm_share=share)
    with gate.background():
        pass
    assert slept == ([] if rest is None else [pytest.approx(rest)])
    # The engine is free during the rest: a live request does not wait for it.
    with gate.live():
        pass


def test_a_failing_step_releases_the_gate():
    gate = EngineGate("fifo", warm_share=1.0)
    with pytest.raises(RuntimeError):
        with gate.background():
            raise RuntimeError("warm prompt failed")
    with pytest.raises(RuntimeError):
        with gate.live():
            raise RuntimeError("request failed")
    with gate.live():
        pass


@pytest.mark.parametrize(("priority", "share"), [("newest", 0.5), ("fifo", 0.0), ("live_first", 1.5)])
def test_bad_gate_settings_are_refused_with_the_parameter_name(priority, share):
    with pytest.raises(ConfigError, match="warm_priority|warm_share"):
        EngineGate(priority, share)


@pytest.mark.parametrize(("tokens", "chunk", "block", "ends"), [
    (300, 128, 16, [128, 256, 300]),
    (256, 128, 16, [128, 256]),
    (100, 128, 16, [100]),
    (300, 0, 16, [300]),          # 0: whole prompts
    (300, 128, 0, [300]),         # no KV cache: chunks would only recompute
    (300, 100, 16, [96, 192, 288, 300]),  # chunks are whole blocks
    (40, 8, 16, [16, 32, 40]),    # at least one block
    (0, 128, 16, []),
])
def test_warm_chunks_are_whole_blocks_and_end_with_the_prompt(tokens, chunk, block, ends):
    assert warm_chunk_ends(tokens, chunk, block) == ends
