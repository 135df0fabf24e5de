"""What one ``lora_adapter`` instance serves: the engine, its adapters' lifecycle, and operator control.

Operators change the adapter set through a control folder shared by every instance (see
:mod:`warmup_tools.control.registry`): ``python -m warmup_tools adapters add NAME --warm-file prompts.txt``
writes the desired state, each instance loads the adapter, pre-fills its warm prompts, and reports it
live; no Triton restart, no base model reload, and nothing of it is reachable through the ensemble.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, TypeVar

from warmup_tools.control.reconcile import Reconciler
from warmup_tools.control.registry import ControlRegistry
from warmup_tools.control.state import AdapterLifecycle, AdapterSpec, AdapterState
from warmup_tools.lora_adapter.engine_api import ServiceEngine
from warmup_tools.lora_adapter.live_plan import PlanKeeper
from warmup_tools.lora_adapter.requests import GenerateRequest
from warmup_tools.lora_adapter.scheduler import Scheduler
from warmup_tools.lora_adapter.sequence import SequenceSink
from warmup_tools.lora_adapter.settings import ServiceConfig
from warmup_tools.smg_worker.event_server import KvEventServer, socket_path

LOGGER = logging.getLogger(__name__)
T = TypeVar("T")


class LoraService:
    """Serves generate requests on one engine through its :class:`Scheduler`, keeping its adapters in step
    with the control folder.

    Requests are batched continuously; adapter loads, unloads and warm prompts run inside the scheduler,
    between or within its steps (warm chunks in the token budget live sequences leave). The caller starts
    the scheduler; :meth:`close` stops it.

    Threads: besides the scheduler's, one thread polls the control folder when there is one (the adapter
    set and the plan, one after the other), and a plan being applied warms on a thread of its own while it
    lasts, so that the poll keeps reporting.
    """

    def __init__(self, engine: ServiceEngine, config: ServiceConfig, *, instance: str, scheduler: Scheduler) -> None:
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
        control_dir, poll_s = config.control_dir, config.control_poll_s
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        if control_dir is not None:
            self.reconciler = Reconciler(
                ControlRegistry(control_dir), self.lifecycle, instance,
                load=self._load, warm=self._warm, unload=self._unload)
            self.reconciler.maybe_reconcile()
        # The warm-up plan of this instance: its hot set, and plan.json in the control folder.
        self.plan = PlanKeeper(engine, self.lifecycle, instance=instance, warm=self._warm_item,
                               run=self.run_on_engine, control_dir=control_dir, host=config.replica_name or None)
        self.kv_events: KvEventServer | None = None
        cache = engine.prefix_cache
        if config.kv_events_dir is not None and cache is not None and cache.events is not None:
            self.kv_events = KvEventServer(cache.events, cache.event_state, cache.block_size,
                                           socket_path(config.kv_events_dir, instance))
            self.kv_events.start()
        if control_dir is not None:
            # NOTE: an idle instance must converge too, so one thread polls the control folder (a stat per
            # file and poll) for the adapter set and the plan; reconciles and requests are serialized by the
            # reconciler's lock.
            self._poller = threading.Thread(target=self._poll, args=(poll_s,), name="lora-control", daemon=True)
            self._poller.start()

    def serve(self, request: GenerateRequest, sink: SequenceSink) -> None:
        """Queue one request on the scheduler (returns at once; its tokens go to ``sink``). A request that
        cannot be served raises its RequestError at once."""
        if request.plan_id is not None:
            request = self.plan.note_warmup(request)  # a model_warmup sample of a plan
        self.lifecycle.check_servable(request.adapter, serve_cold=self.serve_cold)
        self.scheduler.submit(request, sink)

    def adapters_changed(self) -> bool:
        """True once after each change of any adapter's state (cheap: compares a snapshot)."""
        snapshot = {name: (st.state, st.revision) for name, st in self.lifecycle.snapshot().items()}
        changed = snapshot != self._last_states
        self._last_states = snapshot
        return changed

    def run_on_engine(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` with the engine to itself (between two scheduler steps)."""
        return self.scheduler.call(fn).result()

    def close(self) -> None:
        self._stop.set()
        if self.kv_events is not None:
            self.kv_events.stop()
        if self._poller is not None:
            self._poller.join(timeout=5)
        self.plan.close()
        self.scheduler.stop()

    def _load(self, name: str, spec: AdapterSpec) -> None:
        self.scheduler.load_adapter(name, spec.path).result()

    def _unload(self, name: str) -> None:
        self.scheduler.unload_adapter(name).result()

    def _warm(self, name: str, spec: AdapterSpec) -> str:
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

    def _warm_item(self, adapter: str | None, tenant: str, ids: tuple[int, ...], retention_s: float | None) -> None:
        """Warm one planned prefix under the active plan, pinned for ``retention_s`` (None: the cache's
        ``pin_retention_s``), in the scheduler's warm class."""
        self.scheduler.submit_warm(adapter, ids, tenant, plan_id=self.engine.prefix_cache.active_plan,
                                   retention_s=retention_s).result()

    def _poll(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            try:
                self.reconciler.maybe_reconcile()
            except Exception:
                LOGGER.exception("instance %s: adapter reconcile failed", self.instance)
            try:
                self.plan.poll_once()
            except Exception:
                LOGGER.exception("instance %s: plan control failed", self.instance)
