"""A real redis-server for tests: started on a free port, stopped (or killed) afterwards."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

REDIS_SERVER = shutil.which("redis-server")


class RedisServer:
    """One redis-server subprocess on a fixed port, which a test may stop and start again."""

    def __init__(self, port: int, work_dir: Path) -> None:
        self.port = port
        self.work_dir = work_dir
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 10.0) -> None:
        log = open(self.work_dir / "redis.log", "ab")
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.work_dir)],
            stdout=log, stderr=subprocess.STDOUT,
        )
        log.close()
        admin = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self.log_tail()}")
                try:
                    if admin.ping():
                        return
                except redis.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer PING within {timeout}s: {self.log_tail()}")
                time.sleep(0.02)
        finally:
            admin.close()

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    def pause(self) -> None:
        """Stop the process (SIGSTOP): connections stay open and new ones are accepted, nothing answers."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def admin(self) -> "redis.Redis":
        return redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=2)

    def log_tail(self) -> str:
        path = self.work_dir / "redis.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


