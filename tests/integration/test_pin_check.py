"""The live check against a real tritonserver: a replica whose pins stop paying releases them.

A ``lora_adapter`` with a small KV budget serves a live plan whose pinned prefixes are never asked again, while live
traffic cycles through its own repeating prompts, more than the room the pins leave. The live traffic misses on
blocks evicted because of the pins (the cache's shadow list counts those hits), the pinned blocks get none, and
once a window of ``kv_pin_check_s`` with enough lookups closes the pins are released: the instance's plan status
and the sidecar's ``/status`` say so, the pod stays ready (released pins still count as covered), and the live
prompts are served from the cache again.

Nothing here depends on timing: the window closes on the cache clock once it has seen enough block hits, and every
wait is for a condition, with a generous deadline, while the traffic that moves it goes on.
"""

from __future__ import annotations

import os
import shutil
import socket
import urllib.request

import numpy as np
import pytest

from tests.conftest import REPO_ROOT
from tests.integration.test_live_plan import make_plan
from tests.integration.test_sidecar import get_json, wait_for
from warmup_tools.common.digests import tokenizer_fingerprint
from warmup_tools.control.plan_control import PlanStatusBoard
from warmup_tools.control.plan_history import write_live_plan
from warmup_tools.planning.live import wait_applied
from warmup_tools.planning.target import PlanTarget
from warmup_tools.server.client import StreamingClient
from warmup_tools.server.process import RepositoryKey, TritonServer
from warmup_tools.sidecar.app import Sidecar
from warmup_tools.sidecar.config import SidecarConfig
from warmup_tools.sim.bench.support.servers import ready_status

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

INSTANCE = "lora_adapter_0_0"
BLOCK = 16
#: The KV budget in blocks: half of it (kv_warm_share) may be warm-up KV.
BUDGET_BLOCKS = 48
#: The plan: two items of ten blocks, pinned for a day (their retention_s), never asked again.
PLAN_ITEMS, PLAN_ITEM_BLOCKS = 2, 10
#: Live traffic: six prompts of six blocks, asked in turn. 36 blocks do not fit in the room the 20 pinned blocks
#: leave (48 - 20, less the running request's KV), and fit the whole budget once the pins are gone.
LIVE_PROMPTS, LIVE_BLOCKS = 6, 6
#: A live prompt counts as a hit when all but its last block came from the cache (the last token is computed).
HIT_TOKENS = (LIVE_BLOCKS - 1) * BLOCK
DEADLINE_S = 300.0


@pytest.fixture()
def pin_server(demo_assets, tmp_path):
    """A server on a copy of the repository whose lora_adapter runs the live check over 1 s windows."""
    repository = tmp_path / "repository"
    shutil.copytree(REPO_ROOT / "model_repository", repository, ignore=shutil.ignore_patterns("__pycache__"))
    config = repository / "lora_adapter" / "config.pbtxt"
    reserve = 'parameters { key: "kv_live_reserve" value: { string_value: "" } }\n'
    text = config.read_text()
    assert text.count(reserve) == 1
    config.write_text(text.replace(reserve, reserve + "".join(
        f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
        for key, value in (("kv_pin_check_s", "1"), ("kv_warm_share", "0.5"), ("kv_pin_retention_s", "86400")))))
    control = tmp_path / "control"
    env = {"WARMUP_ASSETS_DIR": str(demo_assets.root), "WARMUP_CONTROL_DIR": str(control),
           "WARMUP_REDIS_URL": "", "WARMUP_REQUEST_LOG_DIR": ""}
    target = PlanTarget.from_repository(repository, {**os.environ, **env})
    env["WARMUP_KV_CACHE_BYTES"] = str(BUDGET_BLOCKS * BLOCK * target.kv_bytes_per_token)
    server = TritonServer(repository, env=env, work_dir=tmp_path / "triton", explicit_model_control=True,
                          repository_key=RepositoryKey.generate())
    with server:
        server.wait_ready(timeout=600)
        server.control_dir, server.target, server.repository = control, target, repository
        yield server


def _infer_inputs(ids: np.ndarray) -> list:
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, array in (("input_ids", ids.astype(np.int32)), ("max_tokens", np.array([1], np.int32))):
        tensor = grpcclient.InferInput(name, list(array.shape), "INT32")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def test_a_replica_whose_pins_stop_paying_releases_them_and_live_hits_recover(pin_server):
    server, control = pin_server, pin_server.control_dir
    fingerprint = tokenizer_fingerprint(server.target.load_tokenizer())
    rng = np.random.default_rng(42)
    planned = [rng.integers(10, 4000, PLAN_ITEM_BLOCKS * BLOCK).tolist() for _ in range(PLAN_ITEMS)]
    live = [rng.integers(10, 4000, LIVE_BLOCKS * BLOCK) for _ in range(LIVE_PROMPTS)]
    plan = make_plan([{"tenant": "default", "adapter": "", "token_ids": ids, "retention_s": 86400.0}
                      for ids in planned], fingerprint)
    write_live_plan(control, plan, by=("test", ""))
    key = f"{socket.gethostname()}/{INSTANCE}"
    applied = wait_applied(control, plan.plan_id, timeout_s=DEADLINE_S)[key]
    assert applied.adapters["base"].planned == applied.adapters["base"].resident == PLAN_ITEMS * PLAN_ITEM_BLOCKS
    assert applied.pins is not None and applied.pins.plan_id == plan.plan_id, applied.pins
    assert applied.pins.window_s == 1.0

    board = PlanStatusBoard(control)

    def pins():
        status = board.read_all(host=socket.gethostname())[0].get(INSTANCE)
        return status.pins if status is not None and status.plan_id == plan.plan_id else None

    config = SidecarConfig(probe_interval_s=1.0, probe_timeout_s=10.0, port=0)
    with StreamingClient(server.grpc_url, model="lora_adapter", timeout_s=120) as client, \
            Sidecar(config, server.http_url, server.grpc_url, server.repository_key, server.repository,
                    control_dir=control) as sidecar:
        def cycle() -> list[int]:
            """Each live prompt once, in turn: the cached tokens of each."""
            return [client.stream_inputs(_infer_inputs(ids)).cached_tokens for ids in live]

        # The live traffic, until the live check releases the pins (it moves the window: no clock is waited on).
        def released():
            cycle()
            report = pins()
            return report is not None and report.state == "released"

        wait_for(released, "the live check to release the plan's pins", server, deadline_s=DEADLINE_S)
        report = pins()
        # The pinned blocks gave nothing; the blocks evicted for them would have been hit: the reason to release.
        assert report.pin_hits == 0 and report.shadow_hits >= 8, report
        assert report.releases == 1 and report.pinned_blocks == 0, report
        assert report.released_blocks == PLAN_ITEMS * PLAN_ITEM_BLOCKS, report
        assert report.adapters["base"].shadow_hits == report.shadow_hits, report
        assert "the pinned blocks gave 0 block hits" in report.reason, report

        # The sidecar shows it per instance and adapter (no plan id: /status is public), and stays ready: released
        # pins still count as covered.
        def shown():
            entry = (get_json(sidecar.url + "/status").get("coverage") or {}).get("instances", {}).get(INSTANCE)
            return entry if entry and (entry.get("pins") or {}).get("state") == "released" else None

        wait_for(shown, "the sidecar's /status to show the released pins", server, deadline_s=DEADLINE_S)
        entry = shown()
        assert "plan_id" not in entry["pins"] and entry["pins"]["adapters"]["base"]["released_blocks"] == \
            PLAN_ITEMS * PLAN_ITEM_BLOCKS, entry
        assert entry["adapters"]["base"]["coverage"] == 1.0, entry
        wait_for(lambda: ready_status(sidecar.url) == 200, "the pod to stay ready", server, deadline_s=DEADLINE_S)
        with urllib.request.urlopen(sidecar.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        assert f'warmup_sidecar_pin_state{{instance="{INSTANCE}",state="released"}} 1.0' in text
        assert f'warmup_sidecar_pins_released_total{{adapter="base",instance="{INSTANCE}"}} ' \
               f'{float(PLAN_ITEMS * PLAN_ITEM_BLOCKS)}' in text

        # Live traffic's hit rate recovers: with the pins gone its prompts fit, and a whole cycle hits.
        wait_for(lambda: min(cycle()) >= HIT_TOKENS, "a cycle of live prompts all served from the cache", server,
                 deadline_s=DEADLINE_S)
        with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
            metrics = response.read().decode()
        assert f'warmup_kv_pins_released_total{{model="lora_adapter"}} {PLAN_ITEMS * PLAN_ITEM_BLOCKS}' in metrics
