"""The fleet in trust mode, run as compose and Kubernetes ship it: keys made by ``deploy-secrets``, the router
started by ``warmup_tools router`` with the deployment's control-plane key, each replica a ``warmup_tools
sidecar`` in trust mode, and each replica's membership a ``warmup_tools join`` process. A tenant's request with
its key is routed and served warm, a wrong key gets 401, nobody without the control-plane key can add or remove
a worker, and a replica killed and started again takes requests again."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import openai
import pytest

from tests.waiting import wait_for
from warmup_tools.common.deployment import DeploymentSecrets
from warmup_tools.demo.prompts import USER_QUESTIONS, demo_prompt
from warmup_tools.fleet.process import Child
from warmup_tools.fleet.replica import Replica
from warmup_tools.fleet.router import RouterClient
from warmup_tools.fleet.settings import FleetSettings
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.server.process import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]


def _cli(*argv: str) -> str:
    done = subprocess.run([sys.executable, "-m", "warmup_tools", *argv], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def shipped(served_assets, tmp_path_factory):
    """deploy-secrets, the router, two trust-mode replicas and one join process each, as compose runs them."""
    work = tmp_path_factory.mktemp("trust-fleet")
    secrets = DeploymentSecrets(work / "secrets")
    _cli("deploy-secrets", "--dir", str(secrets.folder))
    settings = FleetSettings(port=free_port("127.0.0.1"), prometheus_port=free_port("127.0.0.1"),
                             secrets_dir=secrets.folder, assets_dir=served_assets, work_dir=work,
                             health_check_interval_s=1, membership_interval_s=1.0)
    router_url = f"http://127.0.0.1:{settings.port}"
    env = {"PATH": f"{sys.executable.rsplit('/', 1)[0]}:/usr/bin:/bin", "HOME": str(work)}
    router = Child("router", [sys.executable, "-m", "warmup_tools", "router", "--host", "127.0.0.1",
                              "--port", str(settings.port), "--prometheus-port", str(settings.prometheus_port),
                              "--secrets-dir", str(secrets.folder)], {**env, "PYTHONPATH": str(REPO_ROOT)},
                   work / "router.log", cwd=REPO_ROOT)
    control = RouterClient(router_url, 1, router, control_key=secrets.read_key(secrets.router_key))
    replicas = [Replica(f"r{i}", settings, work, work / "control", work / "snapshots",
                        request_log_dir=work / "requests") for i in (1, 2)]
    joins = [Child(f"join-{r.name}", [sys.executable, "-m", "warmup_tools", "join", "--router", router_url,
                                      "--replica", r.url, "--secrets-dir", str(secrets.folder), "--interval-s", "1"],
                   {**env, "PYTHONPATH": str(REPO_ROOT)}, work / f"join-{r.name}.log", cwd=REPO_ROOT)
             for r in replicas]
    try:
        router.start()
        wait_for(lambda: _status(f"{router_url}/liveness") == 200, "the router answers", detail=router.log_tail)
        for replica in replicas:
            replica.start()
        for join in joins:
            join.start()
        for replica in replicas:
            replica.wait_warm()
        wait_for(lambda: _joined(control, replicas), "both replicas joined",
                 detail=lambda: "\n".join(j.log_tail() for j in joins))
        yield secrets, control, replicas
    finally:
        for join in joins:
            join.stop(signal.SIGTERM, 60)
        for replica in replicas:
            replica.stop()
        router.stop(signal.SIGTERM, 30)


def _status(url: str, method: str = "GET", body: dict | None = None, key: str | None = None) -> int:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode() if body else None, method=method,
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (urllib.error.URLError, OSError):
        return 0


def _joined(control: RouterClient, replicas: list[Replica]) -> bool:
    """Whether the router routes every model each replica serves to it."""
    ready = {w["url"] for w in control.workers() if w.get("status") == "ready"}
    return ready == {f"{r.url}/m/{model}" for r in replicas for model in r.models()}


def _sdk(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def test_a_tenant_with_its_key_is_routed_and_served_warm(shipped):
    secrets, control, _ = shipped
    with _sdk(control.url, secrets.read_key(secrets.load_key)) as sdk:  # tenant `default`, what Locust sends
        answer = sdk.completions.create(model="support", max_tokens=4,
                                        prompt=demo_prompt("support", USER_QUESTIONS["support"][0]))
    assert answer.usage.prompt_tokens_details.cached_tokens > 0  # the planned system prompt was warm


def test_a_wrong_or_missing_key_gets_401_through_the_router(shipped):
    secrets, control, _ = shipped
    with _sdk(control.url, "sk-not-a-tenant-key") as sdk, pytest.raises(openai.AuthenticationError):
        sdk.completions.create(model="support", max_tokens=4, prompt="Hello")
    body = {"model": "support", "prompt": "Hello", "max_tokens": 4}
    assert _status(f"{control.url}/v1/completions", "POST", body) == 401
    # The router's own key is not a tenant's.
    assert _status(f"{control.url}/v1/completions", "POST", body,
                   key=secrets.read_key(secrets.router_key)) == 401


def test_nobody_without_the_control_key_adds_or_removes_a_worker(shipped):
    secrets, control, replicas = shipped
    before = control.workers()
    attacker = {"url": "http://127.0.0.1:9/m/support", "runtime_type": "generic", "models": [{"id": "support"}]}
    for key in (None, secrets.read_key(secrets.load_key), secrets.read_key(secrets.probe_key)):
        assert _status(f"{control.url}/workers", "POST", attacker, key=key) == 401
        assert _status(f"{control.url}/workers/{before[0]['id']}", "DELETE", key=key) == 401
        assert _status(f"{control.url}/workers", key=key) == 401  # nor lists the replicas' internal URLs
    assert sorted(w["id"] for w in control.workers()) == sorted(w["id"] for w in before)


def test_a_replica_killed_and_started_again_takes_requests_again(shipped):
    secrets, control, replicas = shipped
    victim = replicas[0]
    victim.process.stop(signal.SIGKILL, 0)  # the whole replica: sidecar, tritonserver, stubs, front
    victim.start()
    victim.wait_warm()
    wait_for(lambda: _joined(control, replicas), "the restarted replica is in rotation again")
    # New prefixes: behind cache_aware, each goes to the worker with the least cached text, so they alternate.
    with _sdk(control.url, secrets.read_key(secrets.load_key)) as sdk:
        def routed_there() -> bool:
            sdk.completions.create(model="support", max_tokens=2, prompt=f"{uuid.uuid4().hex} is an order number. "
                                                                         "Where is my parcel?")
            return victim.requests_taken() > 0

        wait_for(routed_there, "a request routed to the restarted replica", poll_s=0)


def test_warmup_tools_fleet_with_a_secrets_dir_runs_the_same_trust_mode(shipped, served_assets, tmp_path):
    """``warmup_tools fleet --secrets-dir`` (the Fleet class: in-process memberships) routes in trust mode too."""
    from warmup_tools.fleet.fleet import Fleet

    secrets, _, _ = shipped
    settings = FleetSettings(replicas=1, port=0, secrets_dir=secrets.folder, assets_dir=served_assets,
                             work_dir=tmp_path, membership_interval_s=1.0)
    with Fleet(settings) as fleet:
        assert fleet.worker_ids  # joined: its membership read /v1/models with the probe tenant's key
        with _sdk(fleet.router.url, secrets.read_key(secrets.load_key)) as sdk:
            answer = sdk.completions.create(model="support", max_tokens=2,
                                            prompt=demo_prompt("support", USER_QUESTIONS["support"][1]))
        assert answer.usage.prompt_tokens_details.cached_tokens > 0
        assert _status(f"{fleet.router.url}/workers") == 401


# ----------------------------------------------------------------------------------- the router's surface, routing
#: Copies of tenant A's prompt that tenant B sends in the routing probe. Were B's copies routed by A's state (as
#: cache_aware did: 10 of 10), every one would go to A's replica; routed without it, all N land there only by
#: chance, at most 2**-N = 6e-8 were each a coin toss (least_load, the trust-mode policy, alternates them).
PROBE_COPIES = 24


@pytest.fixture(scope="module")
def second_tenant(shipped) -> str:
    """The key of a second tenant, ``acme`` (the front and tokenizer_cache read the keys file again on change)."""
    secrets, _, _ = shipped
    return _cli("tenant-key", "acme", "--keys-file", str(secrets.tenant_keys), "--secret-file",
                str(secrets.deployment_secret)).strip()


def _routed_to(replicas: list[Replica], send) -> int:
    """Which replica (its index) took the one request ``send()`` makes (each front counts what it took)."""
    before = [r.requests_taken() for r in replicas]
    send()
    after = [r.requests_taken() for r in replicas]
    took = [i for i, (b, a) in enumerate(zip(before, after)) if a > b]
    assert len(took) == 1, f"one request, taken by replicas {took}"
    return took[0]


def test_another_tenants_copy_of_a_prompt_does_not_follow_where_the_first_tenant_sent_it(shipped, second_tenant):
    """The two-tenant probe: A sends prompt P several times, B then sends P; in trust mode the router keeps no state
    built from requests' text, so B's copies land on A's replica no more than a fresh prompt of B's does."""
    secrets, control, replicas = shipped
    wait_for(lambda: _joined(control, replicas), "both replicas in rotation")
    secret_prompt = (f"{uuid.uuid4().hex} Internal memo for tenant A only: the merger with Initech closes on "
                     "Friday; tell nobody. Summarise the memo in one line.")

    def sender(key: str, prompt: str):
        def send() -> None:
            with _sdk(control.url, key) as sdk:
                sdk.completions.create(model="support", max_tokens=1, prompt=prompt)
        return send

    tenant_a = secrets.read_key(secrets.load_key)
    a_took = [_routed_to(replicas, sender(tenant_a, secret_prompt)) for _ in range(6)]
    x = a_took[-1] if a_took.count(0) == a_took.count(1) else max((0, 1), key=a_took.count)  # A's replica
    copies = [_routed_to(replicas, sender(second_tenant, secret_prompt)) for _ in range(PROBE_COPIES)]
    fresh = [_routed_to(replicas, sender(second_tenant, f"{uuid.uuid4().hex} What are your opening hours?"))
             for _ in range(PROBE_COPIES)]
    on_x, fresh_on_x = copies.count(x), fresh.count(x)
    print(f"routing probe: A's {len(a_took)} went to replicas {a_took}; of B's {PROBE_COPIES} copies {on_x} went to "
          f"A's replica, of B's {PROBE_COPIES} fresh prompts {fresh_on_x}")
    assert on_x < PROBE_COPIES, (f"all {PROBE_COPIES} of tenant B's copies went to tenant A's replica "
                                 f"(A's went {a_took}; B's fresh prompts: {fresh_on_x} there)")


def test_the_router_stores_no_conversation_and_its_model_list_asks_a_key_where_the_gateway_sends_it(shipped):
    """smg keeps no history (nothing to fill, nothing to read back by id); /v1/models, which the gateway and the
    Ingress send to a replica's front, answers only a tenant key in trust mode."""
    secrets, control, replicas = shipped
    item = {"type": "message", "role": "user", "content": "x" * 4096}
    request = urllib.request.Request(f"{control.url}/v1/conversations", data=json.dumps({"items": [item]}).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            created = json.loads(response.read()).get("id", "none")
    except urllib.error.HTTPError:
        created = "none"
    assert _status(f"{control.url}/v1/conversations/{created}") == 404
    assert _status(f"{control.url}/v1/conversations/{created}/items") == 404
    for replica in replicas:
        assert _status(f"{replica.url}/v1/models") == 401
        assert _status(f"{replica.url}/v1/models/support") == 401
        assert _status(f"{replica.url}/v1/models", key="sk-not-a-tenant-key") == 401
        assert _status(f"{replica.url}/v1/models", key=secrets.read_key(secrets.load_key)) == 200
    # The router refuses a body the front would refuse, from its declared length, before it reads it.
    from warmup_tools.front.settings import FrontSettings

    host, port = control.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.putrequest("POST", "/v1/completions")
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(FrontSettings().max_body_bytes + 1))
        connection.endheaders()
        assert connection.getresponse().status == 413
    finally:
        connection.close()


def test_the_gateway_as_shipped_passes_only_the_served_routes_to_the_trust_mode_fleet(shipped, tmp_path):
    """deploy/gateway/nginx.conf run by a real nginx in front of this fleet (its upstreams pointed at the router and
    the replicas' fronts): generation with a tenant key is served and names no replica; the model list asks a key;
    the worker API, conversations, responses, the router's metrics and every other path answer 404; a body of a
    million one-byte chunks is re-framed by the gateway and refused as no JSON, and the fleet serves on."""
    import shutil

    from tests.integration.test_triton_surface import chunked_flood

    secrets, control, replicas = shipped
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    assert Path(nginx).exists(), "nginx is not installed: `make test` installs Debian's nginx-light"
    port = free_port("127.0.0.1")
    conf = (REPO_ROOT / "deploy" / "gateway" / "nginx.conf").read_text()
    fronts = "".join(f"server {r.url.removeprefix('http://')};\n" for r in replicas)
    for shipped_line, here in [("server router:30000;", f"server {control.url.removeprefix('http://')};"),
                               ("server triton:9000;\n", fronts), ("server triton-2:9000;", ""),
                               ("listen 30000;", f"listen 127.0.0.1:{port};")]:
        assert shipped_line in conf, shipped_line
        conf = conf.replace(shipped_line, here)
    (tmp_path / "logs").mkdir()
    (tmp_path / "nginx.conf").write_text(conf)
    argv = [nginx, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-e", "stderr",
            "-g", f"daemon off; pid {tmp_path / 'nginx.pid'};"]
    gateway = Child("gateway", argv, {"PATH": "/usr/sbin:/usr/bin:/bin"}, tmp_path / "nginx.log")
    url = f"http://127.0.0.1:{port}"
    key = secrets.read_key(secrets.load_key)
    try:
        gateway.start()
        wait_for(lambda: _status(f"{url}/gateway-health") == 200, "the gateway answers", detail=gateway.log_tail)
        with _sdk(url, key) as sdk:
            raw = sdk.chat.completions.with_raw_response.create(
                model="support", max_tokens=2, messages=[{"role": "user", "content": USER_QUESTIONS["support"][0]}])
            assert raw.parse().choices[0].message.content is not None
            assert not [h for h in raw.headers if h.lower().startswith("x-smg")], dict(raw.headers)
            assert sdk.completions.create(model="support", prompt="Hello", max_tokens=2).choices
        assert _status(f"{url}/v1/models") == 401
        assert _status(f"{url}/v1/models", key=key) == 200
        for method, path in [("GET", "/workers"), ("POST", "/workers"), ("GET", "/v1/conversations/x"),
                             ("POST", "/v1/conversations"), ("POST", "/v1/responses"), ("GET", "/metrics"),
                             ("GET", "/liveness"), ("GET", "/v1/chat/completions/../../workers"),
                             ("POST", "/v1/embeddings"), ("GET", "/health")]:
            body = {"url": "http://127.0.0.1:1"} if method == "POST" else None
            assert _status(url + path, method, body, key=control._control_key) == 404, (method, path)
        # nginx reads the chunks and passes the body on with its length (a million bytes, under the 1 MiB bound):
        # it is no JSON, and the answer says so.
        answer = chunked_flood(port, "/v1/completions", {"Authorization": f"Bearer {key}"})
        assert answer.startswith(b"HTTP/1.1 400") and b"invalid_json" in answer, answer[:300]
        with _sdk(url, key) as sdk:
            assert sdk.completions.create(model="support", prompt="Hello", max_tokens=2).choices
    finally:
        gateway.stop(signal.SIGQUIT, 10)
