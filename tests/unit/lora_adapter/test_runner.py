"""The scheduler sees its engine through a torch-free interface (engine_api.SequenceEngine); the engine's
SequenceRunner holds each sequence's KV, logits and generator, and forgets every sequence once it ended,
however it ended (model-free: tests/unit/lora_adapter/fake_engine.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.lora_adapter.fake_engine import FakeEngine
from tests.unit.lora_adapter.test_scheduler import RecordingSink, drain
from tests.unit.lora_adapter.test_scheduler_fake import alone, prompts, request
from warmup_tools.common.errors import InvalidInputError, RequestCancelledError
from warmup_tools.lora_adapter.engine_api import ForwardRow
from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams
from warmup_tools.lora_adapter.scheduler import Scheduler
from warmup_tools.lora_adapter.settings import SchedulerConfig

#: A temperature that makes the fake engine's scores (+-10) almost uniform, so each draw depends on the generator.
HOT = 50.0
PACKAGE = Path(__file__).resolve().parents[3] / "warmup_tools"
LORA = "warmup_tools.lora_adapter"


def module_level_imports(path: Path) -> set[str]:
    """The modules a file imports when it is imported: module-level statements, inside ``if``/``try`` too, but
    not under ``if TYPE_CHECKING:``."""
    found: set[str] = set()

    def visit(body):
        for node in body:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
            elif isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(ast.parse(path.read_text()).body)
    return found


def is_torch(name: str) -> bool:
    return name == "torch" or name.startswith("torch.")


def test_scheduler_py_imports_no_torch_anywhere_in_it():
    tree = ast.parse((PACKAGE / "lora_adapter" / "scheduler.py").read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not any(is_torch(name) for name in names)


def test_no_lora_adapter_module_the_scheduler_imports_imports_torch_at_module_level():
    seen, todo = set(), [f"{LORA}.scheduler"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = PACKAGE.parent / (name.replace(".", "/") + ".py")
        imports = module_level_imports(path)
        assert not any(is_torch(i) for i in imports), f"{name} imports torch at module level"
        todo.extend(i for i in imports if i.startswith(LORA + "."))
    assert f"{LORA}.engine_api" in seen
    assert not seen & {f"{LORA}.{name}" for name in ("hf", "packed", "loaded", "runner", "sampling", "simulated")}


def test_importing_the_scheduler_loads_no_torch():
    code = "import sys, warmup_tools.lora_adapter.scheduler; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE.parent, check=True)
    assert out.stdout.strip() == "False", out.stderr


# ----------------------------------------------------------------------------------- the runner alone
def test_a_forward_that_raises_commits_nothing_and_a_success_keeps_kv_and_logits():
    engine = FakeEngine(budget_bytes=0)
    req = request([5, 6, 7], max_tokens=2)
    engine.open(1, req, sampled=True)
    engine.load_prefix(1, None)
    engine.forward([ForwardRow(1, [5, 6], 0, None)])
    kv = engine._kv[1]
    forward = engine.forward_batch

    def broken(rows):
        forward(rows)  # computed, then the forward fails: nothing of it may be kept
        raise RuntimeError("a fault after the forward ran")

    engine.forward_batch = broken
    with pytest.raises(RuntimeError):
        engine.forward([ForwardRow(1, [7], 2, None)])
    assert engine._kv[1] is kv and kv[0][0].shape[2] == 2
    del engine.forward_batch
    engine.forward([ForwardRow(1, [7], 2, None)])
    assert engine._kv[1][0][0].shape[2] == 3 and 1 in engine._logits


def test_release_keeps_the_generator_and_close_forgets_everything_even_twice_or_never_opened():
    engine = FakeEngine(budget_bytes=0)
    engine.open(3, request([5, 6], temperature=1.0, seed=7), sampled=True)
    engine.forward([ForwardRow(3, [5, 6], 0, None)])
    generator = engine._generators[3]
    assert generator is not None
    engine.release(3)
    assert 3 not in engine._kv and 3 not in engine._logits and engine._generators[3] is generator
    engine.close(3)
    engine.close(3)
    engine.close(99)
    assert engine.held_sequences() == 0


def test_a_warm_prompt_and_a_greedy_request_get_no_generator():
    engine = FakeEngine(budget_bytes=0)
    engine.open(1, request([5], temperature=1.0, seed=7), sampled=False)
    engine.open(2, request([5]), sampled=True)
    assert engine._generators == {1: None, 2: None}


# ------------------------------------------------------------------------------ through the scheduler
def test_after_many_requests_finished_cancelled_failed_preempted_and_stopped_the_engine_holds_nothing():
    # 100 tokens of KV for 4 slots (a request takes up to 64): sequences are preempted and recomputed.
    engine = FakeEngine(budget_bytes=100 * 2 * 2 * 1 * 3 * 4, block_size=4)
    forward = engine.forward_batch

    def faulty(rows):
        if any(row.adapter == "legal" and 0 < row.position for row in rows):
            raise RuntimeError("a fault in the legal rows' forward")
        return forward(rows)

    engine.forward_batch = faulty
    scheduler = Scheduler(engine, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_queue=64,
                                                  cancel_check_s=0))
    cases = []
    for i, ids in enumerate(prompts(24, seed=5)):
        kind = ("served", "sampled", "cancelled", "failed", "bad_temperature")[i % 5]
        if kind == "sampled":
            req = request(ids, "support", max_tokens=10, temperature=HOT, seed=i)
        elif kind == "failed":
            req = request(ids, "legal", max_tokens=10)
        elif kind == "bad_temperature":  # the real sampler refuses it: InvalidInputError while sampling
            req = GenerateRequest(tuple(ids), None, "acme", True,
                                  SamplingParams(max_tokens=4, temperature=1e-40, seed=1))
        else:
            req = request(ids, ("sql", None)[i % 2], max_tokens=12)
        sink = RecordingSink()
        scheduler.submit(req, sink)
        cases.append((kind, req, sink))
    warm = scheduler.submit_warm("sql", tuple(prompts(1, seed=9, shared=20)[0]))
    while scheduler.has_work():
        for kind, _req, sink in cases:
            if kind == "cancelled" and len(sink.steps) >= 2:
                sink.cancelled = True
        scheduler.step()
        assert scheduler.stats.steps < 5000, "no progress"
    assert scheduler.stats.preemptions > 0
    assert warm.done()
    for kind, req, sink in cases:
        if kind == "served":
            assert not sink.errors and sink.tokens == alone(req)
        elif kind == "sampled":
            assert not sink.errors and sink.tokens == alone(req)
        elif kind == "cancelled":
            assert [type(e) for e in sink.errors] == [RequestCancelledError]
        elif kind == "failed":
            assert len(sink.errors) == 1 and isinstance(sink.errors[0], RuntimeError)
        else:
            assert len(sink.errors) == 1 and isinstance(sink.errors[0], InvalidInputError)
    assert engine.held_sequences() == 0
    assert engine._kv == {} and engine._logits == {} and engine._generators == {}

    # stop(): sequences running, waiting and still in the inbox end, and the engine forgets them too.
    for ids in prompts(6, seed=6):
        scheduler.submit(request(ids, max_tokens=20, temperature=1.0, seed=3), RecordingSink())
    scheduler.step()
    scheduler.step()
    assert engine.held_sequences() > 0
    scheduler.submit(request([5, 6, 7]), RecordingSink())  # in the inbox when stop() comes
    scheduler.stop()
    assert engine.held_sequences() == 0


def test_a_preempted_sampled_sequence_keeps_its_random_stream():
    """Preemption drops the KV but not the generator: the sampled tokens equal those of the request alone."""
    reqs = [request(ids, adapter, max_tokens=12, temperature=HOT, seed=11 + i)
            for i, (ids, adapter) in enumerate(zip(prompts(6, seed=3), (None, "support", "legal", "sql") * 2))]

    def serve(engine, config):
        scheduler = Scheduler(engine, config)
        sinks = [RecordingSink() for _ in reqs]
        for req, sink in zip(reqs, sinks):
            scheduler.submit(req, sink)
        drain(scheduler)
        assert all(not sink.errors for sink in sinks) and engine.held_sequences() == 0
        return [sink.tokens for sink in sinks], scheduler.stats.preemptions

    expected, _ = serve(FakeEngine(budget_bytes=0), SchedulerConfig(max_num_seqs=1))
    tokens, preemptions = serve(FakeEngine(budget_bytes=60 * 2 * 2 * 1 * 3 * 4, block_size=4),
                                SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32))
    assert preemptions > 0 and tokens == expected
    # The check has teeth: with these scores another seed draws other tokens.
    other = [request(ids, adapter, max_tokens=12, temperature=HOT, seed=1000 + i)
             for i, (ids, adapter) in enumerate(zip(prompts(6, seed=3), (None, "support", "legal", "sql") * 2))]
    assert [alone(req) for req in other] != expected
