"""tritonserver as a trusted part of the replica, run as compose ships it: the sidecar started with the triton
service's command line, in trust mode with the files ``deploy-secrets`` makes.

The tests' tritonserver is the nvidia-pytriton wheel's 2.51, which a chunked request body of a million one-byte
chunks crashes (CVE-2025-23310/23311, fixed in 25.07, the shipped image's release): here its HTTP and gRPC listen
on the loopback only, such a request sent to every port the replica publishes is answered without reaching it,
and every Triton API the project does not use from outside answers only the sidecar's per-run key, over HTTP and
gRPC. The direct-access proxy (deploy/gateway/triton-direct.conf) is run in front of the same server when nginx
is installed."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from multiprocessing import shared_memory
from pathlib import Path

import pytest
import yaml

from tests.waiting import wait_for
from warmup_tools.common.deployment import MOUNT, DeploymentSecrets
from warmup_tools.fleet.process import Child
from warmup_tools.fleet.replica import wait_warm
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.server.process import GRPC_HEADER_PREFIX, RepositoryKey, free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

COMPOSE = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
PORT_FLAGS = ("--http-port", "--grpc-port", "--metrics-port", "--sidecar-port", "--front-port")
#: One request body of a million one-byte chunks (about 6 MB on the wire).
CHUNKS = 1_000_000
#: Paths the flood is sent to on every port: a Triton route that reads the body, and the front's generation route.
FLOOD_PATHS = ("/v2/models/ensemble/generate", "/v1/completions")


class Shipped:
    """The replica: its sidecar process (tritonserver, the sidecar, the OpenAI front), its ports and keys."""

    def __init__(self, work: Path, assets: Path) -> None:
        self.secrets = DeploymentSecrets(work / "secrets")
        done = subprocess.run([sys.executable, "-m", "warmup_tools", "deploy-secrets", "--dir",
                               str(self.secrets.folder)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        service = COMPOSE["services"]["triton"]
        command = list(service["command"])
        assert command[:4] == ["python3", "-m", "warmup_tools", "sidecar"]
        argv = [sys.executable, *command[1:]]
        self.ports = {}
        for flag in PORT_FLAGS:
            self.ports[flag] = free_port()
            argv[argv.index(flag) + 1] = str(self.ports[flag])
        argv[argv.index("--model-repository") + 1] = str(REPO_ROOT / "model_repository")
        argv[argv.index("--fleet-log-dir") + 1] = str(work / "logs")
        argv += ["--replica-name", service["hostname"], "--assets-dir", str(assets), "--control-dir",
                 str(work / "control"), "--log-file", str(work / "tritonserver.log")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get(
            "PYTHONPATH")])])}
        for name, value in service["environment"].items():
            if name in ("TRITONSERVER_HOME", "WARMUP_REDIS_URL_FILE"):
                continue  # the wheel's tritonserver; no Redis runs here (the tier is optional)
            env[name] = str(value).replace(str(MOUNT), str(self.secrets.folder))
        env["WARMUP_SNAPSHOT_DIR"] = str(work / "snapshots")
        self.front_url = f"http://127.0.0.1:{self.ports['--front-port']}"
        self.process = Child("replica", argv, env, work / "replica.log", cwd=REPO_ROOT)
        self.log_path = work / "tritonserver.log"

    def tritonserver_pid(self) -> int | None:
        found = [pid for pid, argv in _tree(self.process.pid) if argv and argv[0].endswith(b"/tritonserver")]
        return found[0] if found else None

    def tritonserver_argv(self) -> list[str]:
        pid = self.tritonserver_pid()
        assert pid is not None, "no tritonserver runs under the sidecar"
        return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]

    def repository_key(self) -> RepositoryKey:
        """The sidecar's per-run key, as tritonserver's command line carries it."""
        spec = next(a for a in self.tritonserver_argv() if a.startswith("--http-restricted-api="))
        header, value = spec.split(":", 1)[1].split("=", 1)
        return RepositoryKey(header, value)

    def listening(self) -> dict[int, set[str]]:
        """Port -> the addresses it listens on, for every process of the replica (the sidecar's, tritonserver,
        the Python backend stubs)."""
        inodes: set[str] = set()
        for pid, _ in _tree(self.process.pid):
            try:
                for fd in Path(f"/proc/{pid}/fd").iterdir():
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
            except OSError:
                continue
        found: dict[int, set[str]] = {}
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    address, port = fields[1].split(":")
                    found.setdefault(int(port, 16), set()).add(_address(address))
        return found

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def _tree(root: int | None) -> list[tuple[int, list[bytes]]]:
    """``root`` and every process below it: (pid, argv)."""
    parents: dict[int, int] = {}
    argvs: dict[int, list[bytes]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argvs[int(proc.name)] = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = [], [root] if root is not None else []
    while frontier:
        pid = frontier.pop()
        found.append((pid, argvs.get(pid, [])))
        frontier += [child for child, parent in parents.items() if parent == pid]
    return found


def _address(hex_address: str) -> str:
    """An address of /proc/net/tcp{,6} (little-endian words) as text."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)


def _is_loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "::ffff:127.0.0.1")


@pytest.fixture(scope="module")
def shipped(served_assets, tmp_path_factory):
    replica = Shipped(tmp_path_factory.mktemp("shipped-replica"), served_assets)
    try:
        replica.process.start()
        wait_warm(replica.front_url, 900, gone=replica.process.exited)
        yield replica
    finally:
        replica.process.stop(timeout_s=120)


def chunked_flood(port: int, path: str, headers: dict[str, str], timeout_s: float = 120.0) -> bytes:
    """One ``Transfer-Encoding: chunked`` request whose body is a million one-byte chunks, sent with a raw socket;
    what was answered until the server closed the connection (empty: nothing). Bounded by ``timeout_s``."""
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": f"127.0.0.1:{port}", "Content-Type": "application/json",
                                               "Transfer-Encoding": "chunked", "Connection": "close",
                                               **headers}.items())
    payload = f"POST {path} HTTP/1.1\r\n{head}\r\n".encode() + b"1\r\nx\r\n" * CHUNKS + b"0\r\n\r\n"
    deadline = time.monotonic() + timeout_s
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        try:
            sock.sendall(payload)
        except OSError:
            pass  # the server answered and closed before the body ended: read what it said
        try:
            while time.monotonic() < deadline:
                piece = sock.recv(65536)
                if not piece:
                    break
                answer += piece
        except OSError:
            pass
    return answer


def _status(answer: bytes) -> bytes:
    """The status line of an HTTP/1 answer (empty when there was none)."""
    return answer.split(b"\r\n", 1)[0] if answer.startswith(b"HTTP/1.") else b""


def _complete(replica: Shipped) -> dict:
    key = replica.secrets.read_key(replica.secrets.load_key)
    request = urllib.request.Request(f"{replica.front_url}/v1/completions", method="POST",
                                     data=json.dumps({"model": "support", "prompt": "Hello", "max_tokens": 2}).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_tritonserver_listens_on_the_replicas_loopback_only(shipped):
    argv = shipped.tritonserver_argv()
    assert "--http-address=127.0.0.1" in argv and "--grpc-address=127.0.0.1" in argv
    listening = shipped.listening()
    for flag in ("--http-port", "--grpc-port"):
        assert listening[shipped.ports[flag]] and all(_is_loopback(a) for a in listening[shipped.ports[flag]]), flag
    published = {port for port, addresses in listening.items() if not all(_is_loopback(a) for a in addresses)}
    # What compose publishes: the OpenAI front; on the host's loopback, the sidecar and Triton's metrics.
    assert published == {shipped.ports[f] for f in ("--front-port", "--sidecar-port", "--metrics-port")}


def test_a_million_one_byte_chunks_through_every_published_port_never_reach_tritonserver(shipped):
    pid = shipped.tritonserver_pid()
    published = sorted(port for port, addresses in shipped.listening().items()
                       if not all(_is_loopback(a) for a in addresses))
    assert published
    auth = {"Authorization": f"Bearer {shipped.secrets.read_key(shipped.secrets.load_key)}"}
    for port in published:
        for path in FLOOD_PATHS:
            answer = chunked_flood(port, path, auth)  # whatever the answer (a 4xx, a closed connection) ...
            assert b"HTTP/1.1 2" not in _status(answer), (port, path, answer[:300])
            assert shipped.tritonserver_pid() == pid and not shipped.process.exited(), (
                f"tritonserver went away after the flood to port {port} {path}:\n{shipped.log()[-3000:]}")
    assert "Signal (" not in shipped.log()
    answer = _complete(shipped)  # a real inference, through the front, still served
    assert answer["usage"]["completion_tokens"] >= 1
    assert shipped.tritonserver_pid() == pid


RESTRICTED_HTTP = [  # (method, path, body) of each restricted API group
    ("POST", "/v2/systemsharedmemory/region/{region}/register", "register"),
    ("GET", "/v2/logging", None),
    ("POST", "/v2/logging", {"log_verbose_level": 0}),
    ("GET", "/v2/trace/setting", None),
    ("GET", "/v2/models/stats", None),
    ("POST", "/v2/repository/index", {}),
]


def _http(url: str, method: str, body: object, headers: dict[str, str]) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except urllib.error.URLError as exc:
        return 0, str(exc.reason)  # nothing listens (yet)


def test_the_restricted_apis_answer_the_per_run_key_only_over_http(shipped):
    key = shipped.repository_key()
    http = f"http://127.0.0.1:{shipped.ports['--http-port']}"
    region = shared_memory.SharedMemory(create=True, size=64)
    try:
        for method, path, body in RESTRICTED_HTTP:
            url = http + path.format(region="warmup-test")
            payload = {"key": f"/{region.name}", "offset": 0, "byte_size": 64} if body == "register" else body
            status, text = _http(url, method, payload, {"Content-Type": "application/json"})
            assert status == 403 and "restricted" in text, (method, path, status, text)
            status, text = _http(url, method, payload, {"Content-Type": "application/json", **key.http_headers()})
            assert status == 200, (method, path, status, text)
        status, _ = _http(f"{http}/v2/systemsharedmemory/region/warmup-test/unregister", "POST", {}, key.http_headers())
        assert status == 200
    finally:
        region.close()
        region.unlink()
    # Inference and health stay open to the front and the sidecar beside the server.
    assert _http(f"{http}/v2/health/ready", "GET", None, {})[0] == 200


def test_the_restricted_apis_answer_the_per_run_key_only_over_grpc(shipped):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    key = shipped.repository_key()
    assert set(key.grpc_headers()) == {GRPC_HEADER_PREFIX + key.header}
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{shipped.ports['--grpc-port']}")
    region = shared_memory.SharedMemory(create=True, size=64)
    calls = {
        "shared-memory": lambda h: client.register_system_shared_memory("warmup-test", f"/{region.name}", 64,
                                                                        headers=h),
        "logging": lambda h: client.get_log_settings(headers=h),
        "logging update": lambda h: client.update_log_settings({"log_verbose_level": 0}, headers=h),
        "trace": lambda h: client.get_trace_settings(headers=h),
        "statistics": lambda h: client.get_inference_statistics(headers=h),
        "model-repository": lambda h: client.get_model_repository_index(headers=h),
    }
    try:
        for name, call in calls.items():
            with pytest.raises(InferenceServerException, match="restricted") as refused:
                call(None)
            assert refused.value.status() == "StatusCode.UNAVAILABLE", name
            call(key.grpc_headers())  # no error with the key
        client.unregister_system_shared_memory("warmup-test", headers=key.grpc_headers())
        assert client.is_server_ready() and client.is_model_ready("ensemble")
    finally:
        client.close()
        region.close()
        region.unlink()


def test_the_direct_access_proxy_passes_inference_and_health_only(shipped, tmp_path):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    assert Path(nginx).exists(), "nginx is not installed: `make test` installs Debian's nginx-light"
    http_port, grpc_port = free_port(), free_port()
    conf = (REPO_ROOT / "deploy" / "gateway" / "triton-direct.conf").read_text()
    conf = (conf.replace("127.0.0.1:8000", f"127.0.0.1:{shipped.ports['--http-port']}")
            .replace("127.0.0.1:8001", f"127.0.0.1:{shipped.ports['--grpc-port']}")
            .replace("listen 8100;", f"listen 127.0.0.1:{http_port};")
            .replace("listen 8101 http2;", f"listen 127.0.0.1:{grpc_port} http2;"))
    (tmp_path / "logs").mkdir()
    (tmp_path / "nginx.conf").write_text(conf)
    proxy = Child("nginx", [nginx, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-e", "stderr", "-g",
                            f"daemon off; pid {tmp_path / 'nginx.pid'};"], dict(os.environ), tmp_path / "nginx.log")
    pid = shipped.tritonserver_pid()
    key = shipped.repository_key()
    try:
        proxy.start()
        base = f"http://127.0.0.1:{http_port}"
        wait_for(lambda: _http(f"{base}/v2/health/live", "GET", None, {})[0] == 200, "nginx passes health",
                 detail=proxy.log_tail)
        assert _http(f"{base}/v2/models/ensemble", "GET", None, {})[0] == 200
        assert _http(f"{base}/v2/models/ensemble/ready", "GET", None, {})[0] == 200
        # Nothing else, with or without the key: repository, statistics, logging, trace, shared memory, config.
        for method, path, body in [*RESTRICTED_HTTP, ("GET", "/v2/models/ensemble/config", None),
                                   ("GET", "/v2/models/ensemble/stats", None), ("GET", "/v2", None),
                                   ("GET", "/v2/health/live/../../repository/index", None)]:
            status, _ = _http(base + path.format(region="x"), method, {} if body == "register" else body,
                              key.http_headers())
            assert status == 404, (method, path, status)
        # The chunked body is read and re-framed by nginx: tritonserver gets it with a Content-Length, and answers
        # (500, its status for a body that is no JSON) that it is no JSON. The gRPC port speaks HTTP/2 only: it
        # answers HTTP/1.1 with a GOAWAY frame.
        answer = chunked_flood(http_port, "/v2/models/ensemble/generate", {})
        assert b"failed to parse the request JSON" in answer, answer[:300]
        assert not _status(chunked_flood(grpc_port, "/v2/models/ensemble/generate", {}))
        assert shipped.tritonserver_pid() == pid and "Signal (" not in shipped.log()
        # An inference through the proxy, over HTTP and gRPC; the other gRPC methods are not passed.
        status, text = _http(f"{base}/v2/models/ensemble/generate", "POST",
                             {"text_input": "Hello", "max_tokens": 2,
                              "tenant_id": "default", "tenant_key": shipped.secrets.read_key(shipped.secrets.load_key)},
                             {"Content-Type": "application/json"})
        assert status == 200 and json.loads(text)["text_output"], text
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        try:
            assert client.is_server_live() and client.is_model_ready("ensemble")
            assert client.get_model_metadata("ensemble").name == "ensemble"
            for call in (lambda: client.get_model_repository_index(headers=key.grpc_headers()),
                         lambda: client.get_inference_statistics(headers=key.grpc_headers()),
                         lambda: client.get_model_config("ensemble")):
                with pytest.raises(InferenceServerException) as refused:
                    call()
                assert refused.value.status() == "StatusCode.UNIMPLEMENTED", refused.value
        finally:
            client.close()
    finally:
        proxy.stop(timeout_s=30)
