"""What one ``lora_adapter`` instance serves: the engine, its adapters' lifecycle, and operator control.

Operators change the adapter set through a control folder shared by every instance (see
:mod:`warmup_tools.adapters.registry`): ``python -m warmup_tools adapters add NAME --warm-file prompts.txt``
writes the desired state, each instance loads the adapter, pre-fills its warm prompts, and reports it
live; no Triton restart, no base model reload, and nothing of it is reachable through the ensemble.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Iterator, TypeVar

from warmup_tools.adapters.reconcile import Reconciler
from warmup_tools.adapters.registry import ControlRegistry
from warmup_tools.adapters.state import AdapterLifecycle, AdapterSpec, AdapterState
from warmup_tools.common.errors import ConfigError
from warmup_tools.lora_adapter.engine import GenerationStep, LoraEngine
from warmup_tools.lora_adapter.live_plan import PlanKeeper
from warmup_tools.lora_adapter.requests import GenerateRequest
from warmup_tools.lora_adapter.scheduler import Scheduler, SequenceSink
from warmup_tools.lora_adapter.settings import WARM_PRIORITIES, SchedulerConfig, ServiceConfig

LOGGER = logging.getLogger(__name__)
T = TypeVar("T")


class EngineGate:
    """Who may use the engine next: live requests first, background work (warm-up) in the gaps.

    With ``priority="live_first"`` a live request waits at most for the one background step (an adapter
    load, or one chunk of a warm prompt) already running: background work takes the engine only when no live
    request is waiting.
    With ``warm_share < 1`` each background step is followed by a rest, so that background work
    holds the engine for at most that share of the time and requests that arrive meanwhile find it free.
    ``priority="fifo"`` with share 1 is a plain mutex (whoever the scheduler wakes first), kept to measure
    the difference (``python -m warmup_tools bench preload``).

    Not reentrant: the engine never calls back into the service.
    """

    def __init__(self, priority: str, warm_share: float) -> None:
        if priority not in WARM_PRIORITIES:
            raise ConfigError(f"warm_priority must be one of {', '.join(WARM_PRIORITIES)}, not {priority!r}")
        if not 0.0 < warm_share <= 1.0:
            raise ConfigError(f"warm_share must be a share of time in (0, 1], not {warm_share}")
        self.priority = priority
        self.warm_share = warm_share
        self._cond = threading.Condition()
        self._busy = False
        self._live_waiting = 0

    @property
    def live_waiting(self) -> int:
        return self._live_waiting

    @contextlib.contextmanager
    def live(self) -> Iterator[None]:
        with self._cond:
            self._live_waiting += 1
            try:
                while self._busy:
                    self._cond.wait()
            finally:
                self._live_waiting -= 1
            self._busy = True
        try:
            yield
        finally:
            self._release()

    @contextlib.contextmanager
    def background(self) -> Iterator[None]:
        with self._cond:
            while self._busy or (self.priority == "live_first" and self._live_waiting):
                self._cond.wait()
            self._busy = True
        start = time.perf_counter()
        try:
            yield
        finally:
            held = time.perf_counter() - start
            self._release()
            if self.warm_share < 1.0:
                time.sleep(held * (1.0 - self.warm_share) / self.warm_share)

    def _release(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()


def warm_chunk_ends(num_tokens: int, chunk_tokens: int, block_size: int) -> list[int]:
    """Prefix lengths to warm one prompt in steps of about ``chunk_tokens`` new tokens each.

    Each step pre-fills a longer prefix of the same prompt; the blocks the step before stored are
    reused from the KV cache, so a step computes only its chunk and a live request waits for one chunk,
    not a whole prompt. Chunks are whole KV blocks (a partial block is never cached); 0, or no cache
    (``block_size`` 0), warms the prompt in one step.
    """
    if chunk_tokens <= 0 or block_size <= 0 or num_tokens <= chunk_tokens:
        return [num_tokens] if num_tokens else []
    step = max(block_size, chunk_tokens // block_size * block_size)
    return [*range(step, num_tokens, step), num_tokens]


class LoraService:
    """Serves generate requests on one engine, keeping its adapters in step with the control folder.

    With a :class:`Scheduler` (``scheduler=continuous``, started by the caller) requests are batched
    continuously and adapter loads, unloads and warm prompts run inside the scheduler, between or within
    its steps (warm chunks in the token budget live sequences leave); without one (``serial``) requests
    run one at a time and the :class:`EngineGate` orders them against warm-up.
    """

    def __init__(self, engine: LoraEngine, config: ServiceConfig, *, instance: str, batching: SchedulerConfig,
                 scheduler: Scheduler | None = None) -> None:
        self.engine = engine
        self.config = config
        self.scheduler = scheduler
        self.instance = instance
        self.serve_cold = config.serve_cold
        self.lifecycle = AdapterLifecycle()
        for name in engine.adapters:  # statically configured adapters are live from the start
            self.lifecycle.register(name)
            self.lifecycle.transition(name, AdapterState.LOADING)
            self.lifecycle.transition(name, AdapterState.LIVE, detail="loaded at start")
        self.reconciler: Reconciler | None = None
        self._last_states: dict[str, tuple[AdapterState, int]] = {}
        # NOTE: one gate around every use of the engine (a request, an adapter load, one warm prompt),
        # not around a whole reconcile: live requests go before a long warm-up's next prompt, and a
        # warming adapter can be served cold when the operator allows it.
        self.gate = EngineGate(config.warm_priority, batching.warm_share)
        self.warm_chunk_tokens = batching.warm_chunk_tokens
        control_dir, poll_s = config.control_dir, config.control_poll_s
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        if control_dir is not None:
            self.reconciler = Reconciler(
                ControlRegistry(control_dir), self.lifecycle, instance,
                load=self._load, warm=self._warm, unload=self._unload)
            self.reconciler.maybe_reconcile()
            # NOTE: an idle instance must converge too, so a thread polls the control folder (one stat
            # per poll); reconciles and requests are serialized by the reconciler's lock.
            self._poller = threading.Thread(target=self._poll, args=(poll_s,), name="adapter-control",
                                            daemon=True)
            self._poller.start()
        # The warm-up plan of this instance: its hot set, and plan.json in the control folder.
        self.plan = PlanKeeper(engine, self.lifecycle, instance=instance, warm=self._warm_item,
                               run=self.run_on_engine, control_dir=control_dir, poll_s=poll_s)

    def generate(self, request: GenerateRequest) -> Iterator[GenerationStep]:
        """Refuse adapters that are not live (or serve warming ones cold when configured), then generate."""
        with self.gate.live():
            self.lifecycle.check_servable(request.adapter, serve_cold=self.serve_cold)
            yield from self.engine.generate(request)

    def serve(self, request: GenerateRequest, sink: SequenceSink) -> None:
        """Serve one request into ``sink``: queued on the scheduler (returns at once), or run to its last
        token here (serial). A request that cannot be served raises its RequestError at once."""
        if request.plan_id is not None:
            request = self.plan.note_warmup(request)  # a model_warmup sample of a plan
        if self.scheduler is None:
            for step in self.generate(request):
                sink.send(step)
            return
        self.lifecycle.check_servable(request.adapter, serve_cold=self.serve_cold)
        self.scheduler.submit(request, sink)

    def adapters_changed(self) -> bool:
        """True once after each change of any adapter's state (cheap: compares a snapshot)."""
        snapshot = {name: (st.state, st.revision) for name, st in self.lifecycle.snapshot().items()}
        changed = snapshot != self._last_states
        self._last_states = snapshot
        return changed

    def run_on_engine(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` with the engine to itself (between two scheduler steps, or holding the gate)."""
        if self.scheduler is not None:
            return self.scheduler.call(fn).result()
        with self.gate.background():
            return fn()

    def close(self) -> None:
        self._stop.set()
        self.plan.close()
        if self._poller is not None:
            self._poller.join(timeout=5)
        if self.scheduler is not None:
            self.scheduler.stop()

    def _load(self, name: str, spec: AdapterSpec) -> None:
        if self.scheduler is not None:
            self.scheduler.load_adapter(name, spec.path).result()
            return
        with self.gate.background():
            self.engine.load_adapter(name, spec.path)

    def _unload(self, name: str) -> None:
        if self.scheduler is not None:
            self.scheduler.unload_adapter(name).result()
            return
        with self.gate.background():
            self.engine.unload_adapter(name)

    def _warm(self, name: str, spec: AdapterSpec) -> str:
        cache = self.engine.prefix_cache
        if self.scheduler is not None:
            return self._warm_scheduled(name, spec)
        block_size = cache.block_size if cache is not None else 0
        tokens = steps = 0
        for prompt in spec.warm_prompts:
            ids = self.engine.encode(prompt)
            for end in warm_chunk_ends(len(ids), self.warm_chunk_tokens, block_size):
                with self.gate.background():
                    self.engine.warm_ids(name, ids[:end])
                steps += 1
            tokens += len(ids)
        return f"warmed {len(spec.warm_prompts)} prompts ({tokens} tokens, {steps} steps)"

    def _warm_scheduled(self, name: str, spec: AdapterSpec) -> str:
        """Warm prompts as the scheduler's lowest class: it chunks them into the budget live traffic leaves."""
        cache = self.engine.prefix_cache
        if cache is None:
            return f"warmed {len(spec.warm_prompts)} prompts (0 tokens, 0 steps: no KV cache)"
        tokens = steps = 0
        for prompt in spec.warm_prompts:
            # NOTE: tokenised on the scheduler's thread: the fast tokenizer is not safe to share across
            # threads, and the scheduler decodes with it.
            ids = self.scheduler.call(lambda text=prompt: self.engine.encode(text)).result()
            steps += self.scheduler.submit_warm(name, ids, plan_id=cache.active_plan).result()
            tokens += len(ids)
        return f"warmed {len(spec.warm_prompts)} prompts ({tokens} tokens, {steps} steps)"

    def _warm_item(self, adapter: str | None, tenant: str, ids: tuple[int, ...]) -> None:
        """Warm one planned prefix under the active plan: the scheduler's warm class, or the gate (serial)."""
        if self.scheduler is not None:
            self.scheduler.submit_warm(adapter, ids, tenant, plan_id=self.engine.prefix_cache.active_plan).result()
            return
        for end in warm_chunk_ends(len(ids), self.warm_chunk_tokens, self.engine.prefix_cache.block_size):
            with self.gate.background():
                self.engine.warm_ids(adapter, ids[:end], tenant)

    def _poll(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            try:
                self.reconciler.maybe_reconcile()
            except Exception:
                LOGGER.exception("instance %s: adapter reconcile failed", self.instance)
