"""A fleet on this machine: replicas (real tritonservers, sidecars and fronts) behind the real smg router.

A replica that is not warm gets no request; the cache-aware policy brings an unplanned prefix back to the
replica that holds it; a replica stopped under load drains (no failed request) and writes its KV snapshot.
Every wait is on a condition (tests/waiting.py), never on the clock. The requests are completions of the demo
prompts (the adapter's system prompt, then a chat turn)."""

from __future__ import annotations

import shutil
import threading

import openai
import pytest

from tests.waiting import wait_for
from warmup_tools.control.registry import ControlRegistry
from warmup_tools.control.state import AdapterState
from warmup_tools.demo.prompts import SYSTEM_PROMPTS, USER_QUESTIONS, demo_prompt

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

#: lora_adapter's max_tokens_limit: the longest generation a request may ask for.
LONGEST = 512


@pytest.fixture(scope="module")
def fleet(served_assets, tmp_path_factory):
    """One replica joined at the start, a second launched beside it (cold until it warms) and not joined."""
    from warmup_tools.fleet.fleet import Fleet
    from warmup_tools.fleet.settings import FleetSettings

    settings = FleetSettings(replicas=1, policy="cache_aware", port=0, assets_dir=served_assets,
                             work_dir=tmp_path_factory.mktemp("fleet"), membership_interval_s=1.0)
    with Fleet(settings) as running:
        running.cold = running.launch()
        yield running


@pytest.fixture()
def sdk(fleet):
    with openai.OpenAI(base_url=f"{fleet.router.url}/v1", api_key="any key: open mode", max_retries=0) as client:
        yield client


def _joined(fleet, count: int = 2) -> None:
    while len(fleet.worker_ids) < count:
        cold = getattr(fleet, "cold", None)
        if cold is not None and cold.name not in fleet.worker_ids:
            fleet.join(cold)
        else:
            fleet.scale_out()


def _complete(sdk, model: str, prompt: str, max_tokens: int = 4):
    return sdk.completions.create(model=model, prompt=prompt, max_tokens=max_tokens)


def test_a_cold_replica_gets_no_request(fleet, sdk):
    cold = fleet.cold
    # Its front answers, and says it is not warm yet (tritonserver loading, the plan not resident).
    status = wait_for(lambda: cold.health() in (200, 503) and cold.health(), "the cold replica's front answers")
    if status == 200:
        pytest.skip("the second replica was warm before the check could see it cold")
    for question in USER_QUESTIONS["support"][:4]:
        answer = _complete(sdk, "support", demo_prompt("support", question))
        assert answer.choices[0].text is not None
    assert cold.health() == 503 or cold.name not in fleet.worker_ids
    assert cold.requests_taken() == 0
    assert all(w["url"].split("/m/")[0] != cold.url for w in fleet.router.workers())
    fleet.join(cold)  # it joins once warm
    assert {w["url"].split("/m/")[0] for w in fleet.router.workers()} == {r.url for r in fleet.replicas.values()}


def test_planned_prefixes_are_warm_on_every_replica_and_unplanned_ones_come_back(fleet, sdk):
    _joined(fleet)
    # A planned prefix (the model_warmup stanzas' system prompt) is warm wherever the router sends it.
    for adapter in ("support", "sql", "legal"):
        first = _complete(sdk, adapter, demo_prompt(adapter, USER_QUESTIONS[adapter][0]))
        assert first.usage.prompt_tokens_details.cached_tokens > 0, adapter
    # An unplanned prefix: cold on its first request, taken from the cache on the second, because the
    # cache-aware policy sends it back to the replica that computed it.
    system = ("You are the assistant of a small bakery in Lyon. Answer questions about opening hours, "
              "allergens, custom cakes and deliveries in two sentences, politely, in plain English.")
    first = _complete(sdk, "support", f"{system}User: Do you bake gluten-free bread on Saturdays?\nAssistant:")
    second = _complete(sdk, "support", f"{system}User: Can I order a wedding cake for sixty guests?\nAssistant:")
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    # Each replica logs into its own folder of the fleet's shared log folder, where the planner reads them all.
    from warmup_tools.common.jsonl import ReadStats
    from warmup_tools.common.records import log_files, read_request_log

    def logged():
        records = list(read_request_log(log_files(fleet.request_log_dir), ReadStats()))
        return len(records) >= 5 and {p.parent.name for p in log_files(fleet.request_log_dir)}

    folders = wait_for(logged, "the five requests in the fleet's request logs")
    assert folders <= set(fleet.replicas) and not list(fleet.request_log_dir.glob("*.jsonl"))


@pytest.fixture()
def late_adapter(fleet):
    """A copy of ``legal`` under a new name in the served assets, removed afterwards (the assets are shared
    with the other test modules, whose servers list every adapter folder)."""
    folder = fleet.settings.assets_dir / "adapters" / "legal-late"
    shutil.copytree(folder.with_name("legal"), folder)  # the same weights under a new name
    yield folder.name
    shutil.rmtree(folder, ignore_errors=True)


def test_an_adapter_made_live_after_the_fleet_started_is_routed_and_a_retired_one_is_not(fleet, sdk, late_adapter):
    _joined(fleet)
    registry = ControlRegistry(fleet.control_dir)
    registry.add("legal-late", [SYSTEM_PROMPTS["legal"]])
    registry.wait_until("legal-late", AdapterState.LIVE, timeout_s=300)
    # Each replica's membership sees the adapter in its /v1/models and adds a worker for it.
    late = {f"{replica.url}/m/legal-late" for replica in fleet.replicas.values()}

    def routed() -> set[str]:
        return {w["url"] for w in fleet.router.workers() if w.get("status") == "ready"}

    wait_for(lambda: late <= routed(), "a worker for the new adapter on every replica",
             detail=lambda: f"; the router lists {sorted(routed())}")
    prompt = demo_prompt("legal", USER_QUESTIONS["legal"][0])
    answer = sdk.completions.create(model="legal-late", prompt=prompt, max_tokens=8, temperature=0)
    same_weights = sdk.completions.create(model="legal", prompt=prompt, max_tokens=8, temperature=0)
    assert answer.model == "legal-late" and answer.choices[0].text == same_weights.choices[0].text
    registry.retire("legal-late")
    registry.wait_until("legal-late", AdapterState.RETIRED, timeout_s=120)
    # Removed: draining (no new request goes to them) or gone.
    wait_for(lambda: not late & {w["url"] for w in fleet.router.workers() if w.get("status") != "draining"},
             "the retired adapter's workers removed")


def test_a_replica_stopped_under_load_drains_without_a_failed_request(fleet, sdk):
    _joined(fleet)
    taken = {name: replica.requests_taken() for name, replica in fleet.replicas.items()}
    streams, errors, finished = 6, [], []
    started = threading.Semaphore(0)

    def stream(index: int) -> None:
        try:
            chunks = sdk.completions.create(
                model="sql", max_tokens=LONGEST, stream=True, stream_options={"include_usage": True},
                prompt=demo_prompt("sql", f"{USER_QUESTIONS['sql'][0]} (stream {index})"))
            reasons = []
            for number, chunk in enumerate(chunks):
                if number == 0:
                    started.release()
                reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
            finished.append(reasons)
        except Exception as exc:  # noqa: BLE001 - every failure is the test's finding
            errors.append(f"stream {index}: {type(exc).__name__}: {exc}")
            started.release()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    for _ in threads:  # every stream has its first chunk: they are all in flight
        started.acquire()
    # The replica that took streams leaves (the cache-aware policy may have sent them all to one). NOTE: told by
    # the count of requests it took, which only grows, not by its in-flight gauge, which the streams may have left
    # before a scrape: nothing holds them open but their length, the longest a request may ask for (each one's
    # first chunk came with 511 steps still to run).
    took = {name: replica.requests_taken() - taken[name] for name, replica in fleet.replicas.items()}
    leaving = fleet.replicas[max(took, key=took.__getitem__)]
    assert sum(took.values()) == streams and took[leaving.name] > 0, (took, errors)
    departure = fleet.scale_in(leaving.name)
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(finished) == streams and all(r == ["length"] for r in finished)
    assert departure.clean, leaving.process.log_tail()
    assert "request(s) were in flight at SIGTERM; all finished" in leaving.process.log_path.read_text()
    # The fleet serves on with the other replica.
    assert _complete(sdk, "sql", demo_prompt("sql", USER_QUESTIONS["sql"][0])).choices
    # lora_adapter unloaded before tritonserver stopped, and its instance wrote its KV snapshot at the exit.
    assert departure.snapshots_written, f"no KV snapshot written by {leaving.name} at its exit"
