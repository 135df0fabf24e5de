"""The sidecar's background loops (the monitor, the rolling re-plan, the canary) each run on one daemon thread
that :meth:`BackgroundThread.stop` ends: one definition of starting and stopping them."""

from __future__ import annotations

import threading
from typing import Any, Callable


class BackgroundThread:
    """One named daemon thread; its loop waits on :attr:`stopping` between rounds and ends once it is set."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self, loop: Callable[..., None], *args: Any) -> None:
        """Run ``loop(*args)`` on the thread; nothing when it runs already."""
        if self._thread is not None:
            return
        self.stopping.clear()
        self._thread = threading.Thread(target=loop, args=args, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the loop to end and wait for it at most ``timeout`` seconds."""
        self.stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
