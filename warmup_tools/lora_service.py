"""What one ``lora_adapter`` instance serves: the engine, its adapters' lifecycle, and operator control.

Operators change the adapter set through a control folder shared by every instance (see
:mod:`warmup_tools.adapters`): ``python -m warmup_tools adapters add NAME --warm-file prompts.txt``
writes the desired state, each instance loads the adapter, pre-fills its warm prompts, and reports it
live; no Triton restart, no base model reload, and nothing of it is reachable through the ensemble.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Iterator

from .adapters import AdapterLifecycle, AdapterSpec, AdapterState, ControlRegistry, Reconciler
from .generation import GenerationStep, LoraEngine
from .requests import GenerateRequest

LOGGER = logging.getLogger(__name__)


class LoraService:
    """Serves generate requests on one engine, keeping its adapters in step with the control folder."""

    def __init__(self, engine: LoraEngine, *, instance: str, control_dir: Path | None = None,
                 serve_cold: bool = False, poll_s: float = 0.5) -> None:
        self.engine = engine
        self.instance = instance
        self.serve_cold = serve_cold
        self.lifecycle = AdapterLifecycle()
        for name in engine.adapters:  # statically configured adapters are live from the start
            self.lifecycle.register(name)
            self.lifecycle.transition(name, AdapterState.LOADING)
            self.lifecycle.transition(name, AdapterState.LIVE, detail="loaded at start")
        self.reconciler: Reconciler | None = None
        self._last_states: dict[str, tuple[AdapterState, int]] = {}
        # NOTE: one lock around every use of the engine (a request, an adapter load, one warm prompt),
        # not around a whole reconcile: live requests interleave with a long warm-up, and a warming
        # adapter can be served cold when the operator allows it.
        self._engine_lock = threading.RLock()
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

    def generate(self, request: GenerateRequest) -> Iterator[GenerationStep]:
        """Refuse adapters that are not live (or serve warming ones cold when configured), then generate."""
        with self._engine_lock:
            self.lifecycle.check_servable(request.adapter, serve_cold=self.serve_cold)
            yield from self.engine.generate(request)

    def adapters_changed(self) -> bool:
        """True once after each change of any adapter's state (cheap: compares a snapshot)."""
        snapshot = {name: (st.state, st.revision) for name, st in self.lifecycle.snapshot().items()}
        changed = snapshot != self._last_states
        self._last_states = snapshot
        return changed

    def close(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=5)

    def _load(self, name: str, spec: AdapterSpec) -> None:
        with self._engine_lock:
            self.engine.load_adapter(name, spec.path)

    def _unload(self, name: str) -> None:
        with self._engine_lock:
            self.engine.unload_adapter(name)

    def _warm(self, name: str, spec: AdapterSpec) -> str:
        tokens = 0
        for prompt in spec.warm_prompts:
            with self._engine_lock:
                self.engine.warm(name, [prompt])
            tokens += len(self.engine.tokenizer.encode(prompt, add_special_tokens=True))
        return f"warmed {len(spec.warm_prompts)} prompts ({tokens} tokens)"

    def _poll(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            try:
                self.reconciler.maybe_reconcile()
            except Exception:  # noqa: BLE001 - NOTE: a bad control file must not kill the poller
                LOGGER.exception("instance %s: adapter reconcile failed", self.instance)
