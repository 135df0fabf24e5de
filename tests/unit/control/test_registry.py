import json
import multiprocessing
import os
import threading
import time

import pytest

from warmup_tools.common.errors import AdapterUnavailableError, ConfigError, UnknownAdapterError
from warmup_tools.control import registry as adapters
from warmup_tools.control.reconcile import Reconciler, plan_reconcile
from warmup_tools.control.registry import ControlRegistry
from warmup_tools.control.state import (
    TRANSITIONS,
    Action,
    AdapterLifecycle,
    AdapterSpec,
    AdapterState,
    AdapterStatus,
    LifecycleError,
)

S = AdapterState


def live(name, revision=1, prompts=()):
    return AdapterSpec(name, "live", tuple(prompts), revision)


def kinds(actions):
    return [(a.kind, a.name) for a in actions]


# ------------------------------------------------------------------------------------ state machine
@pytest.mark.parametrize(("old", "new"), [
    (S.REGISTERED, S.LOADING), (S.LOADING, S.WARMING), (S.LOADING, S.LIVE), (S.LOADING, S.FAILED),
    (S.WARMING, S.LIVE), (S.WARMING, S.FAILED), (S.LIVE, S.RETIRED), (S.LIVE, S.WARMING), (S.LIVE, S.LOADING),
    (S.FAILED, S.LOADING), (S.FAILED, S.RETIRED), (S.RETIRED, S.LOADING),
])
def test_legal_transitions(old, new):
    assert new in TRANSITIONS[old]


@pytest.mark.parametrize(("old", "new"), [
    (S.REGISTERED, S.LIVE), (S.LOADING, S.RETIRED), (S.WARMING, S.LOADING), (S.LIVE, S.FAILED),
    (S.FAILED, S.LIVE), (S.RETIRED, S.LIVE), (S.RETIRED, S.RETIRED), (S.LIVE, S.LIVE),
])
def test_illegal_transitions_are_refused_naming_both_states(old, new):
    assert new not in TRANSITIONS[old]
    lifecycle = AdapterLifecycle()
    lifecycle._states["a"] = AdapterStatus(old, 1)
    with pytest.raises(LifecycleError, match=f"{old.value} -> {new.value}"):
        lifecycle.transition("a", new)
    assert lifecycle.status("a").state is old


def test_every_state_has_transitions_and_lifecycle_error_is_a_config_error():
    assert set(TRANSITIONS) == set(AdapterState)
    assert issubclass(LifecycleError, ConfigError)


@pytest.mark.parametrize("name", ["../x", "a/b", "", ".", "..", ".hidden", "x" * 65, "a b", "a\\b", None])
def test_unsafe_adapter_names_are_refused(tmp_path, name):
    registry = ControlRegistry(tmp_path)
    with pytest.raises(LifecycleError, match="not allowed"):
        registry.add(name)
    with pytest.raises(LifecycleError, match="not allowed"):
        registry.retire(name)
    assert not (tmp_path / "desired.json").exists()


def test_unsafe_path_is_refused(tmp_path):
    with pytest.raises(LifecycleError, match="adapter path"):
        ControlRegistry(tmp_path).add("a", path="../../etc")


# ---------------------------------------------------------------------------------------- registry
def test_add_and_retire_bump_generation_and_revision(tmp_path):
    registry = ControlRegistry(tmp_path / "control")
    assert (tmp_path / "control" / "status").is_dir()
    assert registry.desired() == (0, {})

    spec = registry.add("a", ["hello", "world"])
    assert spec == AdapterSpec("a", "live", ("hello", "world"), 1)
    registry.add("b", live=False, path="b-folder")
    assert registry.add("a", ["hello"]).revision == 2  # re-adding a live adapter reloads it
    assert registry.retire("a").target == "retired"

    generation, specs = ControlRegistry(tmp_path / "control").desired()  # as another process sees it
    assert generation == 4
    assert specs["a"] == AdapterSpec("a", "retired", ("hello",), 3)
    assert specs["b"] == AdapterSpec("b", "registered", (), 1, "b-folder")
    assert specs["b"].folder == "b-folder"


def test_repeated_retire_and_register_are_no_ops(tmp_path):
    registry = ControlRegistry(tmp_path)
    registry.add("a", live=False)
    assert registry.add("a", live=False).revision == 1
    registry.retire("a")
    assert registry.retire("a").revision == 2
    assert registry.desired()[0] == 2
    assert registry.add("a", live=False).revision == 3  # re-added as registered


def test_a_live_adapter_cannot_be_demoted_to_registered(tmp_path):
    registry = ControlRegistry(tmp_path)
    registry.add("a")
    with pytest.raises(LifecycleError, match="retire it"):
        registry.add("a", live=False)


def test_desired_is_read_only_when_the_file_changes(tmp_path, monkeypatch):
    writer, reader = ControlRegistry(tmp_path), ControlRegistry(tmp_path)
    writer.add("a")
    reads = []
    original = ControlRegistry._read_desired
    monkeypatch.setattr(ControlRegistry, "_read_desired", lambda self: reads.append(self) or original(self))

    assert reader.changed_since(0)
    generation, specs = reader.desired()
    assert generation == 1 and list(specs) == ["a"]
    for _ in range(5):
        assert reader.desired() == (1, {"a": specs["a"]})
    assert not reader.changed_since(1)
    assert reads.count(reader) == 1

    writer.add("b")
    assert reader.changed_since(1)
    assert reader.desired()[0] == 2
    assert not reader.changed_since(2)
    assert reads.count(reader) == 2


def test_back_to_back_writes_of_equal_size_are_seen(tmp_path):
    writer, reader = ControlRegistry(tmp_path), ControlRegistry(tmp_path)
    for i in range(20):  # generations 11..19 serialize to the same size; mtime must still move on
        writer.add(f"n{i % 10}")
        assert reader.desired()[0] == i + 1


def test_a_corrupt_control_file_is_an_actionable_error(tmp_path):
    (tmp_path / "desired.json").write_text('{"generation": 1, "adapters": {"a": {"target": "liv')
    registry = ControlRegistry(tmp_path)
    with pytest.raises(LifecycleError, match="not a valid control file"):
        registry.desired()
    assert not registry.changed_since(0)  # nothing new to act on until the file changes
    with pytest.raises(LifecycleError, match="not a valid control file"):
        registry.add("a")


def _add_many(root, prefix, count):
    registry = ControlRegistry(root)
    for i in range(count):
        registry.add(f"{prefix}-{i}", [f"prompt {i}"])


def test_concurrent_writers_lose_no_update_and_readers_never_see_half_a_file(tmp_path):
    errors, reads = [], []
    stop = threading.Event()

    def read_loop():
        reader = ControlRegistry(tmp_path)
        while not stop.is_set():
            try:
                reads.append(reader.desired()[0])
            except Exception as exc:  # noqa: BLE001 - any error is a failure of the test
                errors.append(exc)

    thread = threading.Thread(target=read_loop)
    thread.start()
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_add_many, args=(tmp_path, f"w{w}", 25)) for w in range(4)]
    try:
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=60)
    finally:
        stop.set()
        thread.join()
    assert [w.exitcode for w in workers] == [0, 0, 0, 0]
    assert errors == []
    assert reads == sorted(reads) and len(reads) > 0  # a reader never goes back in time
    generation, specs = ControlRegistry(tmp_path).desired()
    assert generation == 100
    assert sorted(specs) == sorted(f"w{w}-{i}" for w in range(4) for i in range(25))
    assert all(spec.revision == 1 for spec in specs.values())
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_report_and_statuses_round_trip_and_skip_partial_files(tmp_path):
    registry = ControlRegistry(tmp_path)
    statuses = {"a": AdapterStatus(S.LIVE, 2, "warmed 3 prompts (512 tokens)", 12.5),
                "b": AdapterStatus(S.FAILED, 1, "boom", 13.0)}
    registry.report("lora_adapter_0_0", statuses)
    registry.report("lora_adapter_0_1", {})
    (tmp_path / "status" / "broken.json").write_text('{"adapters": {"a": {"sta')
    assert registry.statuses() == {"lora_adapter_0_0": statuses, "lora_adapter_0_1": {}}
    assert registry.forget("lora_adapter_0_1") and not registry.forget("lora_adapter_0_1")
    with pytest.raises(LifecycleError):
        registry.report("../evil", statuses)


# -------------------------------------------------------------------------------------- wait_until
class FakeTime:
    """The registry module's clock: each poll's sleep advances it and runs the next scripted event."""

    def __init__(self, *events) -> None:
        self.now = 0.0
        self.slept = 0
        self._events = list(events)

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return time.time()  # wall-clock stamps in status files and messages stay real

    def sleep(self, seconds: float) -> None:
        self.slept += 1
        self.now += seconds
        if self._events:
            self._events.pop(0)()


@pytest.fixture()
def fake_time(monkeypatch):
    def install(*events):
        clock = FakeTime(*events)
        monkeypatch.setattr(adapters, "time", clock)
        return clock
    return install


def test_wait_until_returns_once_every_instance_reports_the_state(tmp_path, fake_time):
    registry = ControlRegistry(tmp_path)
    registry.add("a")
    for inst in ("i0", "i1"):
        registry.report(inst, {"a": AdapterStatus(S.REGISTERED, 0)})
    # Between polls: i0 goes live, then i1 at an older revision (which does not count), then i1 at this one.
    clock = fake_time(lambda: registry.report("i0", {"a": AdapterStatus(S.LIVE, 1)}),
                      lambda: registry.report("i1", {"a": AdapterStatus(S.LIVE, 0)}),
                      lambda: registry.report("i1", {"a": AdapterStatus(S.LIVE, 1)}))
    ready = registry.wait_until("a", S.LIVE, timeout_s=10, poll_s=0.02)
    assert set(ready) == {"i0", "i1"} and all(st.revision == 1 for st in ready.values())
    assert clock.slept == 3  # returned at the first poll that saw both live at revision 1


def test_wait_until_a_number_of_instances(tmp_path):
    registry = ControlRegistry(tmp_path)
    registry.add("a")
    registry.report("i0", {"a": AdapterStatus(S.LIVE, 1)})
    registry.report("i1", {"a": AdapterStatus(S.LOADING, 1)})
    assert list(registry.wait_until("a", S.LIVE, instances=1, timeout_s=1)) == ["i0"]


def test_wait_until_raises_at_once_when_an_instance_failed(tmp_path, fake_time):
    registry = ControlRegistry(tmp_path)
    registry.add("a")
    registry.report("i0", {"a": AdapterStatus(S.LIVE, 1)})
    registry.report("i1", {"a": AdapterStatus(S.FAILED, 1, "load failed: no adapter_config.json")})
    clock = fake_time()
    with pytest.raises(LifecycleError, match="i1: load failed: no adapter_config.json"):
        registry.wait_until("a", S.LIVE, timeout_s=30)
    assert clock.slept == 0  # at the first look, not after a poll or the timeout


def test_wait_until_timeout_lists_each_instance_state(tmp_path, fake_time):
    registry = ControlRegistry(tmp_path)
    registry.add("a")
    registry.report("i0", {"a": AdapterStatus(S.LIVE, 1, updated_at=time.time())})
    registry.report("i1", {"a": AdapterStatus(S.WARMING, 1, "warming 3 prompts", time.time())})
    registry.report("i2", {})
    clock = fake_time()
    with pytest.raises(LifecycleError) as info:
        registry.wait_until("a", S.LIVE, timeout_s=0.2, poll_s=0.05)
    message = str(info.value)
    assert "timed out" in message and "i0: live at revision 1" in message
    assert "i1: warming at revision 1" in message and "i2: not reported" in message
    assert clock.now >= 0.2


def test_wait_until_with_no_instance_and_unknown_adapter(tmp_path, fake_time):
    registry = ControlRegistry(tmp_path)
    fake_time()
    with pytest.raises(LifecycleError, match="add it first"):
        registry.wait_until("a", S.LIVE, timeout_s=0.1)
    registry.add("a")
    with pytest.raises(LifecycleError, match="no instance has reported yet"):
        registry.wait_until("a", S.LIVE, timeout_s=0.1, poll_s=0.05)


# ---------------------------------------------------------------------------------- plan_reconcile
def test_plan_new_live_adapter_with_and_without_warm_prompts():
    assert kinds(plan_reconcile({"a": live("a")}, {})) == [("register", "a"), ("load", "a"), ("go_live", "a")]
    actions = plan_reconcile({"a": live("a", prompts=["p"])}, {})
    assert kinds(actions) == [("register", "a"), ("load", "a"), ("warm", "a"), ("go_live", "a")]
    assert all(a == Action(a.kind, "a", live("a", prompts=["p"])) for a in actions)


def test_plan_live_adapter_at_its_revision_needs_nothing_and_a_new_revision_reloads():
    spec = live("a", revision=2, prompts=["p"])
    assert plan_reconcile({"a": spec}, {"a": AdapterStatus(S.LIVE, 2)}) == []
    assert kinds(plan_reconcile({"a": spec}, {"a": AdapterStatus(S.LIVE, 1)})) == [
        ("load", "a"), ("warm", "a"), ("go_live", "a")]


@pytest.mark.parametrize("state", [S.REGISTERED, S.RETIRED])
def test_plan_loads_a_registered_or_retired_adapter(state):
    assert kinds(plan_reconcile({"a": live("a", 3)}, {"a": AdapterStatus(state, 3)})) == [
        ("load", "a"), ("go_live", "a")]


def test_plan_failed_adapter_is_retried_only_for_a_new_revision():
    assert plan_reconcile({"a": live("a", 2)}, {"a": AdapterStatus(S.FAILED, 2, "boom")}) == []
    assert kinds(plan_reconcile({"a": live("a", 3)}, {"a": AdapterStatus(S.FAILED, 2, "boom")})) == [
        ("load", "a"), ("go_live", "a")]


def test_plan_retire_comes_first_and_static_adapters_are_left_alone():
    desired = {"new": live("new"), "old": AdapterSpec("old", "retired", revision=2)}
    current = {"old": AdapterStatus(S.LIVE, 1), "static": AdapterStatus(S.LIVE, 0)}
    assert kinds(plan_reconcile(desired, current)) == [
        ("retire", "old"), ("register", "new"), ("load", "new"), ("go_live", "new")]
    retired = {"old": AdapterSpec("old", "retired", revision=2)}
    assert plan_reconcile(retired, {"old": AdapterStatus(S.RETIRED, 2)}) == []
    # an instance that never knew the adapter still reports it as retired
    assert kinds(plan_reconcile({"old": AdapterSpec("old", "retired", revision=2)}, {})) == [
        ("register", "old"), ("retire", "old")]


def test_plan_registered_target():
    spec = AdapterSpec("a", "registered", revision=4)
    assert kinds(plan_reconcile({"a": spec}, {})) == [("register", "a")]
    assert kinds(plan_reconcile({"a": spec}, {"a": AdapterStatus(S.RETIRED, 3)})) == [("register", "a")]
    assert plan_reconcile({"a": spec}, {"a": AdapterStatus(S.REGISTERED, 4)}) == []


@pytest.mark.parametrize("state", [S.LOADING, S.WARMING])
def test_plan_leaves_an_adapter_in_flight_alone(state):
    assert plan_reconcile({"a": live("a", 2)}, {"a": AdapterStatus(state, 1)}) == []


# -------------------------------------------------------------------------------------- lifecycle
def _lifecycle_with_every_state():
    lifecycle = AdapterLifecycle()
    for name in ("reg", "loading", "warming", "live", "failed", "retired"):
        lifecycle.register(name, 1)
    for name, path in {"loading": [S.LOADING], "warming": [S.LOADING, S.WARMING], "live": [S.LOADING, S.LIVE],
                       "failed": [S.LOADING, S.FAILED], "retired": [S.LOADING, S.LIVE, S.RETIRED]}.items():
        for state in path:
            lifecycle.transition(name, state, detail="adapter_model.safetensors missing" if name == "failed" else "")
    return lifecycle


def test_check_servable_for_each_state():
    lifecycle = _lifecycle_with_every_state()
    assert lifecycle.check_servable(None) is True
    assert lifecycle.check_servable("live") is True
    with pytest.raises(UnknownAdapterError, match="unknown adapter 'nope': send the name of an adapter") as info:
        lifecycle.check_servable("nope")
    assert "live" not in str(info.value)  # the inventory is not listed
    expected = {
        "warming": "adapter 'warming' is warming, not live yet; retry shortly",
        "loading": "adapter 'loading' is loading, not live yet; retry shortly",
        "retired": "adapter 'retired' is retired",
        "failed": "adapter 'failed' failed to load: adapter_model.safetensors missing",
        "reg": "adapter 'reg' is registered but not loaded",
    }
    for name, message in expected.items():
        with pytest.raises(AdapterUnavailableError, match=message):
            lifecycle.check_servable(name)


def test_serve_cold_serves_a_warming_adapter_only():
    lifecycle = _lifecycle_with_every_state()
    assert lifecycle.check_servable("warming", serve_cold=True) is True
    for name in ("loading", "reg", "failed", "retired"):
        with pytest.raises(AdapterUnavailableError):
            lifecycle.check_servable(name, serve_cold=True)


def test_lifecycle_register_and_transition():
    lifecycle = AdapterLifecycle(clock=lambda: 42.0)
    with pytest.raises(LifecycleError, match="not registered"):
        lifecycle.transition("a", S.LOADING)
    lifecycle.register("a", revision=1)
    assert lifecycle.transition("a", S.LOADING, revision=2) == AdapterStatus(S.LOADING, 2, "", 42.0)
    assert lifecycle.transition("a", S.LIVE, detail="ok").revision == 2
    with pytest.raises(LifecycleError, match="live -> registered"):
        lifecycle.register("a", 3)
    assert lifecycle.snapshot() == {"a": AdapterStatus(S.LIVE, 2, "ok", 42.0)}


# ------------------------------------------------------------------------------------- reconciler
class FakeEngine:
    def __init__(self, fail=()):
        self.fail = set(fail)
        self.calls = []

    def load(self, name, spec):
        self.calls.append(("load", name, spec.revision))
        if name in self.fail:
            raise OSError(f"{spec.folder}/adapter_config.json not found")

    def warm(self, name, spec):
        self.calls.append(("warm", name, spec.revision))
        return f"warmed {len(spec.warm_prompts)} prompts"

    def unload(self, name):
        self.calls.append(("unload", name))


def test_reconciler_brings_instances_to_the_desired_state(tmp_path):
    registry = ControlRegistry(tmp_path)
    engines = {inst: FakeEngine(fail={"bad"} if inst == "i1" else ()) for inst in ("i0", "i1")}
    reconcilers = [Reconciler(ControlRegistry(tmp_path), AdapterLifecycle(), inst, load=e.load, warm=e.warm,
                              unload=e.unload) for inst, e in engines.items()]
    assert all(r.maybe_reconcile() for r in reconcilers)  # the first call reports, even with nothing desired
    assert registry.statuses() == {"i0": {}, "i1": {}}

    registry.add("a", ["p1", "p2"])
    assert [r.maybe_reconcile() for r in reconcilers] == [True, True]
    assert [r.maybe_reconcile() for r in reconcilers] == [False, False]  # nothing changed: a stat only
    ready = registry.wait_until("a", S.LIVE, timeout_s=1)
    assert {st.detail for st in ready.values()} == {"warmed 2 prompts"}
    assert reconcilers[0].lifecycle.check_servable("a")

    registry.add("bad")
    for r in reconcilers:
        r.maybe_reconcile()
    with pytest.raises(LifecycleError, match="failed on instance i1: load failed: OSError: bad/adapter_config.json"):
        registry.wait_until("bad", S.LIVE, timeout_s=1)
    assert reconcilers[0].lifecycle.check_servable("a")  # one bad adapter leaves the others alone

    registry.retire("a")
    for r in reconcilers:
        r.maybe_reconcile()
    registry.wait_until("a", S.RETIRED, timeout_s=1)
    assert ("unload", "a") in engines["i0"].calls
    with pytest.raises(AdapterUnavailableError, match="retired"):
        reconcilers[1].lifecycle.check_servable("a")


def test_reconciler_keeps_serving_when_the_control_file_is_corrupt(tmp_path, caplog):
    engine = FakeEngine()
    reconciler = Reconciler(ControlRegistry(tmp_path), AdapterLifecycle(), "i0", load=engine.load, warm=engine.warm)
    (tmp_path / "desired.json").write_text("{not json")
    assert reconciler.maybe_reconcile() is False
    assert reconciler.maybe_reconcile() is False
    assert sum("not a valid control file" in r.getMessage() for r in caplog.records) == 1
    (tmp_path / "desired.json").unlink()
    assert reconciler.maybe_reconcile() is True


def test_status_files_are_plain_json(tmp_path):
    ControlRegistry(tmp_path).report("i0", {"a": AdapterStatus(S.LIVE, 1, "ok", 1.0)})
    document = json.loads((tmp_path / "status" / "i0.json").read_text())
    assert document["adapters"] == {"a": {"state": "live", "revision": 1, "detail": "ok", "updated_at": 1.0}}
    assert adapters.FORMAT_VERSION == document["format"]


def test_a_deeply_nested_control_file_is_a_bad_file_and_the_instance_keeps_polling(tmp_path, caplog):
    engine = FakeEngine()
    registry = ControlRegistry(tmp_path)
    reconciler = Reconciler(registry, AdapterLifecycle(), "i0", load=engine.load, warm=engine.warm)
    # 50,000 levels: past the parser's recursion limit, under the values bound (MAX_DESIRED_VALUES, checked first).
    (tmp_path / "desired.json").write_bytes(b'{"adapters": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")
    assert reconciler.maybe_reconcile() is False  # every poll: no RecursionError, one log line in all
    assert reconciler.maybe_reconcile() is False
    assert sum("not a valid control file" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(LifecycleError, match=r"desired\.json is not a valid control file .*nested deeper than"):
        registry.desired()
    (tmp_path / "desired.json").unlink()
    registry.add("a", ["warm me"])
    assert reconciler.maybe_reconcile() is True and reconciler.lifecycle.check_servable("a")


def test_a_desired_file_of_millions_of_empty_lists_is_refused_before_parsing_and_the_instance_keeps_its_adapters(
        tmp_path, caplog, monkeypatch):
    # 16 MiB of [[],[],...] passed the size cap and cost every reader 5.7 s and 774 MiB to parse.
    engine = FakeEngine()
    registry = ControlRegistry(tmp_path)
    reconciler = Reconciler(registry, AdapterLifecycle(), "i0", load=engine.load, warm=engine.warm)
    registry.add("a", ["warm me"])
    assert reconciler.maybe_reconcile() is True and reconciler.lifecycle.check_servable("a")
    flood = b"[" + b"[]," * ((16 << 20) // 3 - 1) + b"[]]"
    assert len(flood) <= adapters.MAX_DESIRED_BYTES
    (tmp_path / "desired.json").write_bytes(flood)
    parsed = []
    real_loads = json.loads
    monkeypatch.setattr(json, "loads", lambda *args, **kwargs: parsed.append(1) or real_loads(*args, **kwargs))
    assert reconciler.maybe_reconcile() is False and reconciler.maybe_reconcile() is False
    assert parsed == []
    lines = [r.getMessage() for r in caplog.records if "not a valid control file" in r.getMessage()]
    assert len(lines) == 1 and "desired.json" in lines[0] and "JSON values" in lines[0], lines
    assert "[[]" not in lines[0] and "more than the 65536 allowed (refused before parsing)" in lines[0]
    reconciler.lifecycle.check_servable("a")  # still served as before


def test_a_desired_file_that_is_a_fifo_is_refused_once_and_never_blocks_a_reader(tmp_path, caplog):
    engine = FakeEngine()
    registry = ControlRegistry(tmp_path)
    reconciler = Reconciler(registry, AdapterLifecycle(), "i0", load=engine.load, warm=engine.warm)
    os.mkfifo(tmp_path / "desired.json")  # a plain open() waits for a writer forever
    assert reconciler.maybe_reconcile() is False and reconciler.maybe_reconcile() is False
    lines = [r.getMessage() for r in caplog.records if "not a valid control file" in r.getMessage()]
    assert len(lines) == 1 and "desired.json: not a regular file (a FIFO)" in lines[0], lines
    with pytest.raises(LifecycleError, match=r"desired\.json: not a regular file \(a FIFO\)"):
        registry.desired()


def test_an_oversized_desired_file_is_refused_before_it_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr(adapters, "MAX_DESIRED_BYTES", 64)
    (tmp_path / "desired.json").write_text(json.dumps({"format": 1, "generation": 1, "adapters": {}, "x": "y" * 64}))
    with pytest.raises(LifecycleError, match="larger than 64 bytes"):
        ControlRegistry(tmp_path).desired()
