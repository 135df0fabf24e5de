"""The sidecar's background thread: started once, its loop ends when stopped, and it can start again."""

from __future__ import annotations

import threading

from warmup_tools.sidecar.background import BackgroundThread


def test_a_loop_runs_on_its_named_thread_until_stopped_and_starts_again():
    worker = BackgroundThread("sidecar-test")
    entered, names = threading.Event(), []

    def loop(tag):
        names.append((tag, threading.current_thread().name))
        entered.set()
        worker.stopping.wait()  # a loop ends when asked to

    assert not worker.running
    worker.start(loop, "first")
    worker.start(loop, "ignored")  # running already: nothing more starts
    assert entered.wait(30) and worker.running
    worker.stop(timeout=30)
    assert not worker.running and names == [("first", "sidecar-test")]
    entered.clear()
    worker.start(loop, "again")  # stopping is cleared on a new start
    assert entered.wait(30)
    worker.stop(timeout=30)
    assert names[-1] == ("again", "sidecar-test")
