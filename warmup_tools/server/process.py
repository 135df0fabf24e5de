"""One object that runs a real tritonserver: start, readiness, logs, stop.

Modelled on pytriton's ``triton_server.py``: the server is started with an explicit environment,
readiness is polled against a deadline (only connection errors mean "not ready yet"), the log is
captured to a file, and stopping sends SIGINT, waits a bounded time, then SIGKILLs the whole process
group (tritonserver and its Python backend stubs).

Two distributions are supported:

* the ``nvidia-pytriton`` wheel, which bundles tritonserver 2.51 with the Python backend: used on
  machines without the NGC image (development, CI);
* a system install such as the NGC image's ``/opt/tritonserver`` (``TRITONSERVER_HOME``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Mapping, Sequence

from warmup_tools.common.errors import ServerError

LOGGER = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1

# NOTE: PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process. Every
# tritonserver is spawned from this one thread, which lives as long as the process: a server restarted
# by the sidecar's monitor thread must not die when that thread ends, and still dies with the process.
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tritonserver-spawner")


@dataclasses.dataclass(frozen=True, slots=True)
class TritonDistribution:
    """Where a tritonserver binary, its backends and its shared libraries are."""

    binary: Path
    backend_directory: Path
    library_path: Path | None = None
    cache_directory: Path | None = None

    @classmethod
    def locate(cls, work_dir: Path) -> "TritonDistribution":
        """Find a tritonserver: ``TRITONSERVER_HOME`` first, then the pytriton wheel.

        ``work_dir`` is where the wheel's Python backend is laid out with the stub that matches
        this interpreter (the wheel ships one stub per Python version).
        """
        home = os.environ.get("TRITONSERVER_HOME")
        if home:
            return cls.from_home(Path(home))
        try:
            return cls.from_pytriton(work_dir)
        except ModuleNotFoundError:
            default_home = Path("/opt/tritonserver")
            if (default_home / "bin" / "tritonserver").exists():
                return cls.from_home(default_home)
            raise ServerError(
                "no tritonserver found: install the 'local' extra (nvidia-pytriton) "
                "or set TRITONSERVER_HOME to a Triton install such as /opt/tritonserver"
            ) from None

    @classmethod
    def from_home(cls, home: Path) -> "TritonDistribution":
        binary = home / "bin" / "tritonserver"
        if not binary.exists():
            raise ServerError(f"{binary} does not exist; TRITONSERVER_HOME must point at a Triton install")
        caches = home / "caches"
        return cls(binary, home / "backends", None, caches if caches.exists() else None)

    @classmethod
    def from_pytriton(cls, work_dir: Path) -> "TritonDistribution":
        import pytriton  # optional dependency

        dist = Path(pytriton.__file__).parent / "tritonserver"
        libs = Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
        if not stub.exists():
            raise ServerError(f"the pytriton wheel has no Python backend stub for Python {version}")
        backend_dir = work_dir / "backends"
        python_dir = backend_dir / "python"
        python_dir.mkdir(parents=True, exist_ok=True)
        # NOTE: the Python backend looks for its stub next to libtriton_python.so, so the wheel's
        # files are laid out in a folder of our own with the stub for this interpreter.
        for src in (dist / "backends" / "python" / "libtriton_python.so",
                    dist / "backends" / "python" / "triton_python_backend_utils.py",
                    stub):
            dst = python_dir / src.name
            if not dst.exists() or dst.stat().st_size != src.stat().st_size:
                shutil.copy2(src, dst)
        return cls(dist / "bin" / "tritonserver", backend_dir, libs, dist / "caches")


#: Triton's API groups that nothing outside the replica uses (``--http-restricted-api``,
#: ``--grpc-restricted-protocol``): shared memory, logging, trace, statistics and the model repository answer only
#: a request that carries the per-run key. Inference, health, metadata and model configuration stay open to the
#: front and the sidecar beside the server (which alone reach its ports: SECURITY.md, "Ports").
#: NOTE: the shared-memory API is the entry of CVE-2025-23319/23320/23334 (registering the Python backend's own
#: regions), and none of these groups is needed to serve: a deployment that wants them passes the key.
RESTRICTED_APIS: tuple[str, ...] = ("shared-memory", "logging", "trace", "statistics", "model-repository")

#: The prefix tritonserver expects before a restricted protocol's header name in gRPC metadata.
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"


@dataclasses.dataclass(frozen=True, slots=True)
class RepositoryKey:
    """The per-run key of Triton's restricted APIs (:data:`RESTRICTED_APIS`: the model repository's load, unload
    and index, shared memory, logging, trace and statistics).

    Passed as ``--http-restricted-api=<apis>:<header>=<value>`` and ``--grpc-restricted-protocol=<apis>:<header>=
    <value>`` (Triton's "Limit Endpoint Access"; over gRPC the metadata key is ``triton-grpc-protocol-<header>``).
    Without it those endpoints answer 403 (gRPC: UNAVAILABLE with the restriction named).
    """

    header: str
    value: str

    @classmethod
    def generate(cls, header: str = "warmup-repository-key") -> "RepositoryKey":
        """A random key for one run; give it only to the process that may load and unload models."""
        return cls(header, secrets.token_urlsafe(24))

    def server_args(self) -> list[str]:
        spec = f"{','.join(RESTRICTED_APIS)}:{self.header}={self.value}"
        return [f"--http-restricted-api={spec}", f"--grpc-restricted-protocol={spec}"]

    def http_headers(self) -> dict[str, str]:
        return {self.header: self.value}

    def grpc_headers(self) -> dict[str, str]:
        """The key as gRPC metadata (tritonclient.grpc's ``headers=``)."""
        return {GRPC_HEADER_PREFIX + self.header: self.value}

    def probe_secret(self) -> str:
        """The per-run secret the sidecar proves its probe tenant with in open mode (derived from the key;
        the server hands it to its models as ``WARMUP_PROBE_SECRET``, see :mod:`warmup_tools.triton.trust`)."""
        return hmac.new(self.value.encode("utf-8"), b"warmup-probe-secret", hashlib.sha256).hexdigest()

    def __repr__(self) -> str:  # never log the secret
        return f"RepositoryKey(header={self.header!r}, value=<hidden>)"


@dataclasses.dataclass(slots=True)
class ServerPorts:
    http: int
    grpc: int
    metrics: int

    @classmethod
    def free(cls) -> "ServerPorts":
        return cls(free_port(), free_port(), free_port())


class TritonServer:
    """A tritonserver process serving one model repository.

    Use as a context manager, or call :meth:`start` / :meth:`stop` yourself::

        with TritonServer(repo, ports=ServerPorts.free(), env={"WARMUP_ASSETS_DIR": "/a"}) as server:
            server.wait_ready(timeout=300)
            ...
    """

    def __init__(
        self,
        model_repository: Path,
        *,
        ports: ServerPorts | None = None,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        work_dir: Path | None = None,
        log_path: Path | None = None,
        log_verbose: int = 0,
        host: str = "127.0.0.1",
        metrics_host: str = "",
        exit_timeout_s: int = 15,
        explicit_model_control: bool = False,
        repository_key: RepositoryKey | None = None,
    ) -> None:
        self.model_repository = Path(model_repository).resolve()
        if not self.model_repository.is_dir():
            raise ServerError(f"model repository {self.model_repository} is not a folder")
        self.ports = ports or ServerPorts.free()
        self.host = host
        #: Where the metrics port listens; empty: ``host``, as tritonserver itself does.
        self.metrics_host = metrics_host or host
        self._own_work_dir = work_dir is None
        self.work_dir = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="warmup-triton-"))
        self.log_path = Path(log_path) if log_path else self.work_dir / "tritonserver.log"
        self._env_overrides = dict(env or {})
        self._extra_args = list(extra_args)
        self._log_verbose = log_verbose
        self._exit_timeout_s = exit_timeout_s
        self.explicit_model_control = explicit_model_control
        # NOTE: every server restricts RESTRICTED_APIS: without a key given, one nobody holds. A caller that needs
        # those APIs (the sidecar's reloads) passes its own key or reads this one.
        self.repository_key = repository_key or RepositoryKey.generate()
        self._process: subprocess.Popen[bytes] | None = None
        self._log_file = None
        #: Held by :meth:`restart` from the stop to the start, by :meth:`stop` and by :meth:`exited`.
        self._lifecycle = threading.RLock()

    # ----------------------------------------------------------------------------------- public API
    @property
    def http_url(self) -> str:
        return f"{_connect_host(self.host)}:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"{_connect_host(self.host)}:{self.ports.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"http://{_connect_host(self.metrics_host)}:{self.ports.metrics}/metrics"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> None:
        """Start tritonserver in its own process group; returns once the process is spawned."""
        if self.is_alive():
            raise ServerError(f"tritonserver already running (pid {self.pid})")
        dist = TritonDistribution.locate(self.work_dir)
        cmd = self.command(dist)
        env = self.environment(dist)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab", buffering=0)
        LOGGER.info("starting tritonserver: %s", " ".join(cmd).replace(self.repository_key.value, "<hidden>"))
        if not is_loopback(self.host):
            LOGGER.warning("tritonserver's HTTP and gRPC listen on %s: reachable from outside this host, they serve "
                           "every model and every input; only the front and the sidecar beside it need them "
                           "(keep 127.0.0.1, or put deploy/gateway/triton-direct.conf in front: SECURITY.md)",
                           self.host)
        self._process = _SPAWNER.submit(
            subprocess.Popen,
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            # NOTE: a new session makes tritonserver the leader of a process group holding its
            # stubs, so stop() can signal them all. PDEATHSIG makes the server die with the thread
            # that started it (_SPAWNER's, which lives as long as this process), so a killed test run
            # or CLI leaves nothing behind.
            start_new_session=True,
            preexec_fn=_die_with_parent,
        ).result()

    def restart(self, grace_s: float) -> None:
        """Stop (SIGINT, at most ``grace_s``, then SIGKILL the process group) and start again, same ports
        and environment; returns once the new process is spawned (:meth:`wait_ready` next).

        NOTE: every client connection drops when the old process goes, which is what ends a request that
        a dead stub holds (Triton never answers it); requests elsewhere get ``grace_s`` to finish. A KV
        snapshot folder in the environment makes the new instances start warm.
        """
        with self._lifecycle:
            self.stop(timeout=grace_s)
            self.start()

    def exited(self) -> bool:
        """Whether tritonserver is not running, a :meth:`restart` under way not counted (it is waited for)."""
        with self._lifecycle:
            return not self.is_alive()

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Poll ``/v2/health/ready`` until it answers 200, the process exits, or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        url = f"http://{self.http_url}/v2/health/ready"
        while True:
            if not self.is_alive():
                raise ServerError(
                    f"tritonserver exited with code {self.returncode} before it was ready; "
                    f"errors in its log:\n{self.log_errors()}\nlog tail:\n{self.log_tail(20)}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        LOGGER.info("tritonserver ready on http %s grpc %s", self.http_url, self.grpc_url)
                        return
            except urllib.error.HTTPError as exc:
                exc.close()  # the server answers but is not ready yet (models loading)
            except (urllib.error.URLError, ConnectionError, TimeoutError, socket.timeout):
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise ServerError(
                    f"tritonserver not ready after {timeout:.0f}s; log tail:\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGINT, wait up to ``timeout`` (default: its exit timeout and 15 s), then SIGKILL the process group.
        Returns the exit code."""
        with self._lifecycle:
            return self._stop(timeout if timeout is not None else self._exit_timeout_s + 15.0)

    def _stop(self, timeout: float) -> int | None:
        process = self._process
        if process is None:
            return None
        try:
            if process.poll() is None:
                LOGGER.info("stopping tritonserver (pid %d)", process.pid)
                # NOTE: SIGINT goes to tritonserver alone: it unloads its models and stops its stubs
                # itself. Signalling the stubs too would kill them under the server's feet.
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    LOGGER.warning("tritonserver did not stop within %.0fs; killing it", timeout)
                    _signal_group(process.pid, signal.SIGKILL)
                    process.wait(timeout=10)
            # NOTE: stubs are in the server's process group; make sure none outlives it.
            _signal_group(process.pid, signal.SIGKILL)
        finally:
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None
        return process.returncode

    def stub_pids(self, model: str) -> list[int]:
        """Process ids of ``model``'s Python backend stubs (one per instance).

        NOTE: each instance's ``triton_python_backend_stub`` is a child of tritonserver and its command
        line holds the model's ``model.py`` path (``.../<model>/<version>/model.py``) and instance name.
        """
        if self.pid is None:
            return []
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            if ppid == self.pid and argv and argv[0].endswith(b"triton_python_backend_stub") and any(
                    f"/{model}/".encode() in arg for arg in argv[1:2]):
                found.append(int(proc.name))
        return sorted(found)

    def cleanup(self) -> None:
        """Remove the work folder if this object created it."""
        if self._own_work_dir and not self.is_alive():
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def is_alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._process.poll() if self._process else None

    def logs(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.logs().splitlines()[-lines:])

    def log_errors(self, limit: int = 20) -> str:
        """Triton's error lines (severity E) and model load failures, the first place to look."""
        lines = [line for line in self.logs().splitlines()
                 if line.startswith("E") or "failed to load" in line or "Failed to" in line]
        return "\n".join(line[:2000] for line in lines[:limit]) or "(none)"

    def command(self, dist: TritonDistribution) -> list[str]:
        cmd = [
            str(dist.binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={dist.backend_directory}",
            f"--http-port={self.ports.http}",
            f"--grpc-port={self.ports.grpc}",
            f"--metrics-port={self.ports.metrics}",
            f"--http-address={self.host}",
            f"--grpc-address={self.host}",
            f"--metrics-address={self.metrics_host}",
            "--allow-metrics=true",
            "--strict-readiness=true",
            "--exit-on-error=true",
            # NOTE: on SIGINT Triton waits this long for in-flight requests and open client
            # connections; stop() waits a little longer before it kills.
            f"--exit-timeout-secs={self._exit_timeout_s}",
            f"--log-verbose={self._log_verbose}",
        ]
        if dist.cache_directory is not None:
            cmd.append(f"--cache-directory={dist.cache_directory}")
        if self.explicit_model_control:
            # NOTE: explicit mode with every model loaded at start is what lets an outside actor (the
            # sidecar) repair a model: with the default mode "none" the repository API refuses load and
            # unload. A load of a model already loaded is a no-op, so a repair is unload, then load.
            cmd += ["--model-control-mode=explicit", "--load-model=*"]
        return cmd + self.repository_key.server_args() + self._extra_args

    def environment(self, dist: TritonDistribution) -> dict[str, str]:
        """The server's environment: this one, the venv's ``bin`` first on PATH, Triton's libraries."""
        env = dict(os.environ)
        # NOTE: the Python backend stub runs `python` from PATH; putting this interpreter's bin first
        # makes the stubs import this environment's packages (torch, warmup_tools, ...).
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        paths = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
        # NOTE: the stub links libpython3.X.so.1.0 dynamically. If the loader finds the system's copy
        # first (say Debian's 3.11.2) while the interpreter on PATH is another patch release (pyenv's
        # 3.11.7), its extension modules fail with undefined symbols (seen: _ssl and _PyModule_Add).
        # Putting this interpreter's own libpython first makes the stub run the same Python.
        libdir = sysconfig.get_config_var("LIBDIR")
        if sysconfig.get_config_var("Py_ENABLE_SHARED") and libdir and libdir not in paths:
            paths.insert(0, libdir)
        if dist.library_path is not None:
            paths.append(str(dist.library_path))
        if paths:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(paths)
        # NOTE: the stubs must import the same warmup_tools as this process. With an editable install
        # shared by several checkouts (git worktrees), site-packages points at one of them; putting this
        # package's own folder first makes a worktree's server run that worktree's code.
        package_root = str(Path(__file__).resolve().parents[2])
        python_path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != package_root]
        env["PYTHONPATH"] = os.pathsep.join([package_root, *python_path])
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env["WARMUP_PROBE_SECRET"] = self.repository_key.probe_secret()
        env.update(self._env_overrides)
        return env

    # ------------------------------------------------------------------------------ context manager
    def __enter__(self) -> "TritonServer":
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        self.cleanup()


#: Where :func:`free_port` picks from: below the kernel's ephemeral range, which outgoing connections draw from.
_PORT_FLOOR = 10000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()
_ports_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, for a server this process is about to start.

    NOTE: not a port the kernel picks for ``bind(0)``: those come from the ephemeral range, which every outgoing
    connection on the host draws from too, so one of them could take the port before the server binds it (a fleet
    of eight replicas starting at once, 40 ports and their clients' connections, hit that). The port is drawn at
    random below the ephemeral range, checked bindable, and never handed out twice by this process."""
    low = _ephemeral_low()
    with _ports_lock:
        for _ in range(200) if low > _PORT_FLOOR + 1000 else ():
            port = secrets.randbelow(low - _PORT_FLOOR) + _PORT_FLOOR
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # no room below the range: the kernel's
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        _handed_out.add(port)
        return port


def free_port_block(host: str, count: int, tries: int = 200) -> int:
    """The first of ``count`` consecutive TCP ports that were free a moment ago (a replica's gRPC worker listeners):
    :func:`free_port`'s draw, the ports after it checked bindable, all of them recorded as handed out."""
    for _ in range(tries):
        first = free_port(host)
        with _ports_lock:
            block = range(first + 1, first + count)
            if first + count - 1 <= 65535 and all(p not in _handed_out and _bindable(host, p) for p in block):
                _handed_out.update(block)
                return first
    raise ServerError(f"no {count} consecutive free ports on {host} in {tries} tries")


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def is_loopback(host: str) -> bool:
    """Whether an address to listen on is reachable from this host only (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _connect_host(host: str) -> str:
    """The address a client on this host connects to for a server listening on ``host`` (a wildcard: the loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, host)


def _die_with_parent() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
