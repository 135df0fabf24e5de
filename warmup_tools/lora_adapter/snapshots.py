"""KV snapshots of one ``lora_adapter`` instance: restore at start, write periodically and at shutdown.

The file format is :mod:`warmup_tools.kv.snapshot`; restoring and every check before a block is trusted
are :mod:`warmup_tools.lora_adapter.snapshot_restore` (:class:`SnapshotKeeper` restores through it). This
module adds the writing: this instance's hot blocks, on a timer (``interval_s``) and once at shutdown.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from typing import Callable, TypeVar

from warmup_tools.kv.snapshot import SnapshotInfo, write_snapshot
from warmup_tools.lora_adapter.engine_api import SnapshotEngine
from warmup_tools.lora_adapter.settings import SnapshotConfig
from warmup_tools.lora_adapter.snapshot_restore import RestoreReport, SnapshotRestorer

__all__ = ["RestoreReport", "SnapshotKeeper"]

LOGGER = logging.getLogger(__name__)
T = TypeVar("T")


class SnapshotKeeper(SnapshotRestorer):
    """Restores an instance's prefix cache from a snapshot folder and writes its hot blocks back."""

    def __init__(self, engine: SnapshotEngine, config: SnapshotConfig, *, instance: str, plan_id: str | None = None,
                 run_on_engine: Callable[[Callable[[], T]], T] | None = None,
                 log: Callable[[str], None] | None = None, host: str | None = None,
                 on_write: Callable[[SnapshotInfo], None] | None = None, mac_key: bytes = b"",
                 rng: random.Random | None = None) -> None:
        super().__init__(engine, config, instance=instance, plan_id=plan_id, run_on_engine=run_on_engine, log=log,
                         host=host, mac_key=mac_key, rng=rng)
        self._on_write = on_write
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._write_lock = threading.Lock()
        self._last_written: bytes | None = None

    # ------------------------------------------------------------------------------------- write
    def write(self) -> SnapshotInfo | None:
        """Write this instance's hot blocks now (None when nothing changed since the last write)."""
        with self._write_lock:
            adapters = dict(self.engine.adapter_fingerprints)
            blocks = [b for b in self.cache.snapshot_blocks(self.config.max_bytes)
                      if not b.owner or b.owner in adapters]  # a retired adapter's KV is of no use to anyone
            signature = hashlib.sha256(b"".join(b.block_hash + (b.plan_id or "").encode() for b in blocks)).digest()
            if signature == self._last_written:
                return None
            info = write_snapshot(self.folder, self.name, self.identity, adapters, blocks, created=time.time(),
                                  mac_key=self._mac_key, arrays=self.cache.arrays)
            self._last_written = signature
            if self._on_write is not None:
                self._on_write(info)
            LOGGER.info("KV snapshot %s: %d block(s), %d bytes", info.manifest.name, info.blocks, info.payload_bytes)
            return info

    def start(self) -> None:
        """Write every ``interval_s`` on a thread of its own (0: only at :meth:`close`)."""
        if self.config.interval_s > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kv-snapshot", daemon=True)
            self._thread.start()

    def close(self) -> SnapshotInfo | None:
        """Stop the thread and write a last snapshot (errors are logged, never raised)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        return self._safe_write()

    # ----------------------------------------------------------------------------------- helpers
    def _loop(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            self._safe_write()

    def _safe_write(self) -> SnapshotInfo | None:
        try:
            return self.write()
        except Exception as exc:  # noqa: BLE001 - a full disk must not take the instance down
            self._log(f"KV snapshot {self.name}: write failed ({type(exc).__name__}: {exc})")
            return None

