"""Helper processes the benchmarks start and stop, and what they ask of a running server: an OpenAI front beside
a tritonserver (:func:`front_process`), a throwaway redis-server (:func:`local_redis`), a sidecar's ``/ready``
(:func:`ready_status`). Each process is stopped when its ``with`` block ends."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

from warmup_tools.server.process import TritonServer, free_port


class _Front:
    def __init__(self, url: str, pid: int) -> None:
        self.url = url
        self.pid = pid

    def cpu_seconds(self) -> float:
        """The front process's CPU time so far (user and system, from /proc)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")



@contextlib.contextmanager
def front_process(server: TritonServer, assets_dir: Path, pipeline: str,
                   checkout: Path | None = None, grpc_worker_port: int = 0) -> Iterator[_Front]:
    """``python -m warmup_tools front`` in a process of its own, as a deployment runs it beside tritonserver
    (in this process its event loop would share the interpreter with the benchmark's clients); stopped with
    SIGINT, then SIGKILL after 10 s. ``checkout``: the package of another checkout of the project instead of
    this one (run from there, so that it is the one imported)."""
    import httpx

    port = free_port()
    command = [sys.executable, "-m", "warmup_tools", "front", "--front-port", str(port), "--pipeline", pipeline,
               "--triton-grpc-url", server.grpc_url, "--triton-metrics-url", server.metrics_url,
               "--model-repository", str(server.model_repository)]
    env = {**os.environ, "WARMUP_ASSETS_DIR": str(assets_dir)}
    if grpc_worker_port:
        env["WARMUP_FRONT_GRPC_WORKER_PORT"] = str(grpc_worker_port)
    if checkout is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(checkout), env.get("PYTHONPATH"))))
    process = subprocess.Popen(command, env=env, cwd=checkout, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the front did not start: {' '.join(command)}")
            time.sleep(0.2)
        yield _Front(url, process.pid)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def local_redis() -> Iterator[str | None]:
    """A throwaway redis-server on a free port (its URL), stopped afterwards; None without redis-server."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    import redis

    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="bench-redis-"))
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(work)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        admin = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)
        for _ in range(100):
            try:
                if admin.ping():
                    break
            except redis.ConnectionError:
                time.sleep(0.05)
        admin.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)


def ready_status(sidecar_url: str, timeout_s: float = 10) -> int:
    """``GET /ready``'s status code; 0 while nothing answers."""
    try:
        with urllib.request.urlopen(sidecar_url + "/ready", timeout=timeout_s) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        exc.close()
        return exc.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0
