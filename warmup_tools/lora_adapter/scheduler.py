"""Continuous batching for one ``lora_adapter`` instance: iteration-level steps (Orca), chunked prefill
(Sarathi-Serve), recompute preemption (vLLM v1).

The scheduler drives one engine through :class:`~warmup_tools.lora_adapter.engine_api.SequenceEngine` and
handles token ids, counts and block hashes only (this module imports no torch): the engine owns each
sequence's KV tensors, the logits of its last forward, its random generator and the sampling, keyed by the
scheduler's ``seq_id``. The scheduler owns every decision: admission, the prefix cache's matching,
reservations and single flight, the tokens each step computes, preemption, and what a sampled token means
for its request (end of sequence, text, the response). A thread calls :meth:`Scheduler.step` in a loop; each
step

1. runs the calls queued for between steps (adapter load / unload: never while a forward runs);
2. drops sequences whose client cancelled (or whose last send failed), freeing their memory;
3. admits waiting sequences, up to ``max_num_seqs`` running, tenant by tenant (the one that runs the fewest
   first, a tenant over its slot share yielding a slot to one that waits; the sidecar's probes in a slot of
   their own: :mod:`~warmup_tools.lora_adapter.admission`), each first matching its longest cached
   KV block prefix (prefix cache, single flight: a sequence whose next uncached block another running
   sequence is computing waits for it); at its first admission the engine opens the sequence (its
   seeded generator), and at each admission it loads the matched blocks as the sequence's KV;
4. plans at most ``max_num_batched_tokens`` new tokens: one for each decoding sequence, then prefill
   chunks in admission order, then a warm-up chunk (adapter warm prompts) in what is left: none beside
   a live prefill or while a live request waits; while live traffic flows at most ``warm_chunk_tokens``,
   followed by a rest that keeps warm-up within ``warm_share`` of the time; the whole step once the
   instance has been quiet for ``live_quiet_s``;
5. reserves the new tokens' KV bytes against the prefix cache's budget; when they do not fit, the most
   recently admitted sequence is preempted (the engine releases its KV, recomputed later, invisible to its
   client; its generator stays, so a sampled stream goes on where it was);
6. runs the batched forward (the engine's ``forward``: it keeps each row's KV and last logits), has the
   engine store newly completed prompt blocks in the prefix cache and sample each finished row's next
   token, and hands that token to the sequence's sink. A sequence that ends, however it ends, is closed
   in the engine (its state there forgotten).

Requests arrive through :meth:`Scheduler.submit` with a :class:`SequenceSink` (a tenant past its share of the
queue is refused at once, as is anyone once the instance holds ``max_num_seqs + max_queue``) (model.py's sends
responses through the request's response sender); errors go to the one sequence they concern. Tests
drive :meth:`step` directly, without the thread.

Faults: whatever raises while one sequence is admitted, stored, sampled or sent ends that sequence with
the error (its own code for a :class:`~warmup_tools.common.errors.RequestError`, INTERNAL for anything
else), frees its slot and its KV memory, and leaves the others running. A batched forward that raises is
retried row by row, so only the rows that fail alone end. A step that raises outside any one sequence
(the scheduler's own fault) ends every sequence it held with that error rather than keep a state it may
have broken. A step that changed nothing (no forward, no sequence admitted, ended or preempted, no
call run) makes the thread wait on its condition until a request or a call arrives: it never spins.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from typing import Callable, TypeVar

from warmup_tools.common.errors import (
    AdapterUnavailableError,
    KVBudgetError,
    RequestCancelledError,
    RequestError,
    ServerBusyError,
    TenantBusyError,
)
from warmup_tools.common.records import PROBE_TENANT
from warmup_tools.common.wire import ErrorKind
from warmup_tools.kv.blocks import BlockSource
from warmup_tools.kv.hashing import BlockHash
from warmup_tools.lora_adapter.admission import (
    PROBE_HELD,
    PROBE_SLOTS,
    TenantQueues,
    TenantShares,
    fair_order,
    is_probe,
    slot_to_yield,
)
from warmup_tools.lora_adapter.detokenize import IncrementalDetokenizer
from warmup_tools.lora_adapter.engine_api import ForwardRow, GenerationStep, SequenceEngine
from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams
from warmup_tools.lora_adapter.sequence import Sequence, SequenceClass, SequenceSink
from warmup_tools.lora_adapter.settings import DEFAULT_BATCHING, SchedulerConfig

LOGGER = logging.getLogger(__name__)

T = TypeVar("T")


#: Sequence ids, unique in the process.
# NOTE: not per scheduler: the engine keys each sequence's state by its id, and bench kv and the tests run
# several schedulers over one engine, one after the other (a test may leave a sequence unfinished).
_SEQ_IDS = itertools.count()


def _note_admitted(sink: object, cached_tokens: int) -> None:
    """Tell a sink that has ``admitted`` (a traced request's: lora_adapter/traced.py) that its sequence was admitted
    for the first time. NOTE: optional, so the other sinks need nothing; a fault there never ends the sequence."""
    note = getattr(sink, "admitted", None)
    if note is not None:
        try:
            note(cached_tokens)
        except Exception:  # NOTE: a sink's fault, never the sequence's
            LOGGER.debug("a sink's admitted() failed", exc_info=True)


@dataclasses.dataclass(frozen=True, slots=True)
class StepReport:
    """What one step did (the thread's idle test, metrics, tests)."""

    batch_size: int = 0
    live_tokens: int = 0
    warm_tokens: int = 0
    #: Sequence ids given a token this step, in batch order, and their adapters.
    seq_ids: tuple[int, ...] = ()
    adapters: tuple[str | None, ...] = ()
    preempted: int = 0
    finished: int = 0
    seconds: float = 0.0
    #: Nothing changed: no forward ran, no sequence was admitted, ended or preempted, no call ran; the
    #: thread then waits for new input instead of stepping again.
    idle: bool = False


@dataclasses.dataclass(slots=True)
class SchedulerStats:
    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    #: Of those, running sequences preempted to give a waiting tenant under its slot share a slot.
    fair_preemptions: int = 0
    #: Requests refused because their tenant held its share (TenantBusyError), and because the instance was full.
    tenant_refusals: int = 0
    busy_refusals: int = 0
    #: Warm prompts whose KV was dropped to make room for live sequences (they start again later).
    warm_restarts: int = 0
    steps: int = 0
    #: Output tokens per adapter ("" for the base model).
    output_tokens: dict[str, int] = dataclasses.field(default_factory=dict)


class Scheduler:
    """Continuous batching over one engine (a :class:`SequenceEngine`); see the module docstring."""

    def __init__(self, engine: SequenceEngine, config: SchedulerConfig = DEFAULT_BATCHING, *,
                 observer: Callable[[StepReport, "Scheduler"], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_wait: Callable[["Scheduler"], None] | None = None) -> None:
        """``on_wait`` is called, holding the scheduler's lock, each time the thread blocks on its condition
        (tests count these to see that the loop waits instead of spinning)."""
        self.engine = engine
        self._on_wait = on_wait
        #: Bumped by every change a step makes besides a forward (admission, an ended or preempted
        #: sequence, calls, new arrivals): a step that leaves it and runs no forward is idle.
        self._changes = 0
        self._clock = clock
        self._last_live = float("-inf")
        self._warm_rest_until = float("-inf")
        self.config = config
        self.observer = observer
        self.stats = SchedulerStats()
        self._cond = threading.Condition()
        self._inbox: list[Sequence] = []
        self._calls: list[tuple[Callable[[], object], concurrent.futures.Future]] = []
        self._waiting = TenantQueues()
        self._shares = TenantShares.of(config)
        #: Live requests each tenant holds (inbox, waiting, running); a tenant has an entry only while it holds one.
        self._held: dict[str, int] = {}
        self._running: list[Sequence] = []  # in admission order
        self._warm_waiting: collections.deque[Sequence] = collections.deque()
        self._warm: Sequence | None = None
        self._inflight: dict[BlockHash, int] = {}
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._observed_counts = (0, 0)

    # ----------------------------------------------------------------------------------- public API
    def submit(self, request: GenerateRequest, sink: SequenceSink) -> int:
        """Queue a live request; its tokens go to ``sink``. Raises its RequestError at once when it cannot
        be served (too long, unknown adapter), when its tenant holds its share (TenantBusyError, ``rate_limited``)
        or the instance is full (ServerBusyError, ``busy``); both with Triton's UNAVAILABLE.

        NOTE: the request's tenant is trusted here: the model proved it (trust mode) or took it from the request
        (open mode), and only the sidecar can prove the probe tenant, whose requests take the reserved probe slot."""
        self.engine.check_request(request)
        tenant = request.tenant
        with self._cond:
            if self._stopped:
                raise AdapterUnavailableError("lora_adapter is shutting down; retry on another instance",
                                              kind=ErrorKind.UNAVAILABLE)
            mine = self._held.get(tenant, 0)
            if is_probe(tenant):
                if mine >= PROBE_HELD:
                    self.stats.busy_refusals += 1
                    raise ServerBusyError(f"server busy: this instance already holds {mine} readiness probes; "
                                          "retry later")
            else:
                # NOTE: the bound is on everything this instance holds (running slots plus the queue), so a
                # request that finds a free slot is never refused, whatever max_queue says; probes not counted.
                bound = self.config.max_num_seqs + self.config.max_queue
                held = len(self._inbox) + len(self._waiting) + len(self._running) - self._held.get(PROBE_TENANT, 0)
                if mine >= self._shares.max_held and self._shares.max_held < bound:
                    self.stats.tenant_refusals += 1
                    raise TenantBusyError(
                        f"too many concurrent requests from this tenant: it already has {mine} requests on this "
                        f"instance, its share ({self.config.max_num_seqs} running, "
                        f"{self._shares.max_held - self.config.max_num_seqs} waiting); wait for some of them to "
                        "finish before sending more, or lower your concurrency")
                if held >= bound:
                    self.stats.busy_refusals += 1
                    raise ServerBusyError(
                        f"server busy: this instance already holds {held} requests ({self.config.max_num_seqs} "
                        f"running at most, max_queue {self.config.max_queue} waiting); retry later")
            seq = self._new_sequence(request, sink, SequenceClass.LIVE)
            seq.counted = True
            self._held[tenant] = mine + 1
            self._inbox.append(seq)
            self._cond.notify_all()
        return seq.seq_id

    def submit_warm(self, adapter: str | None, ids: tuple[int, ...], tenant: str = "default",
                    plan_id: str | None = None, retention_s: float | None = None) -> concurrent.futures.Future:
        """Pre-fill one warm prompt's KV blocks in the budget live sequences leave (pinned under ``plan_id`` for
        ``retention_s``, None: the cache's ``pin_retention_s``); the future's result is the number of steps it
        took."""
        request = GenerateRequest(tuple(ids), adapter, tenant, False, SamplingParams(max_tokens=1),
                                  source=BlockSource.WARMUP, plan_id=plan_id, retention_s=retention_s)
        self.engine.check_request(request)
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            seq = self._new_sequence(request, None, SequenceClass.WARM)
            seq.done = done
            self._inbox.append(seq)
            self._cond.notify_all()
        return done

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future:
        """Run ``fn`` on the scheduler between two steps (no forward runs meanwhile); a future of its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._calls.append((fn, future))
            self._cond.notify_all()
        return future

    def load_adapter(self, name: str, folder: str | None = None) -> concurrent.futures.Future:
        return self.call(lambda: self.engine.load_adapter(name, folder))

    def unload_adapter(self, name: str) -> concurrent.futures.Future:
        """Unload between steps; sequences still using the adapter end with UNAVAILABLE."""
        return self.call(lambda: self._unload(name))

    def step(self) -> StepReport:
        """One iteration: calls, cancellations, admission, one batched forward, outputs."""
        started = time.perf_counter()
        began = self._clock()
        changes = self._changes
        self._run_calls()
        self._take_inbox()
        self._drop_cancelled()
        self._admit()
        plan, preempted = self._plan()
        finished = 0
        if plan:
            finished = self._run(plan)
        if not self._running and self._warm is None:
            self.engine.forget_batches()
        self.stats.steps += 1
        self.stats.running = len(self._running)
        self.stats.waiting = len(self._waiting)
        report = StepReport(
            batch_size=len(plan),
            live_tokens=sum(n for s, n in plan if s.klass is SequenceClass.LIVE),
            warm_tokens=sum(n for s, n in plan if s.klass is SequenceClass.WARM),
            seq_ids=tuple(s.seq_id for s, _ in plan),
            adapters=tuple(s.request.adapter for s, _ in plan),
            preempted=preempted, finished=finished, seconds=time.perf_counter() - started,
            idle=not plan and self._changes == changes)
        if report.warm_tokens and self._live_recent():
            # NOTE: warm_share: after a warm chunk, warm-up rests so that it holds the engine for at most that
            # share of the time, and most live requests find no warm chunk running.
            share = self.config.warm_share
            now = self._clock()
            self._warm_rest_until = now + (now - began) * (1.0 - share) / share
        counts = (self.stats.running, self.stats.waiting)
        # NOTE: also after a step without a forward that changed the counts (the last sequence cancelled or
        # failed), so the running and waiting gauges fall to 0 instead of keeping the last busy value.
        if self.observer is not None and (plan or counts != self._observed_counts):
            self._observed_counts = counts
            try:
                self.observer(report, self)
            except Exception:
                LOGGER.exception("scheduler observer failed")
        return report

    def has_work(self) -> bool:
        with self._cond:
            return bool(self._inbox or self._calls or self._waiting or self._running
                        or self._warm_waiting or self._warm)

    def start(self) -> None:
        """Run :meth:`step` on a thread of its own until :meth:`stop`."""
        self._thread = threading.Thread(target=self._loop, name="lora-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread; requests still queued, waiting (preempted ones too) or running end with UNAVAILABLE,
        each with exactly one final response, and their memory is freed."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        error = AdapterUnavailableError("lora_adapter is shutting down; retry on another instance",
                                        kind=ErrorKind.UNAVAILABLE)
        with self._cond:
            inbox, self._inbox = self._inbox, []
            calls, self._calls = self._calls, []
        for _fn, future in calls:
            future.set_exception(error)
        for seq in inbox:
            self._finish(seq, error)
        # NOTE: freed as well as ended (KV reservations, cache matches, single-flight claims), so that what runs
        # after the stop (model.py's last KV snapshot) finds no block held by a request that is gone.
        self._abort(error)

    @property
    def running(self) -> list[Sequence]:
        return list(self._running)

    @property
    def waiting(self) -> list[Sequence]:
        return list(self._waiting)

    # ------------------------------------------------------------------------------- step, in parts
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and not (self._inbox or self._calls or self._waiting or self._running
                                                 or self._warm_waiting or self._warm):
                    self._wait()
                if self._stopped:
                    return
            try:
                report = self.step()
            except Exception as exc:  # NOTE: the scheduler's own fault; see _abort
                LOGGER.exception("scheduler step failed; ending the sequences it held")
                try:
                    self._abort(exc)
                except Exception:
                    LOGGER.exception("could not end the sequences of a failed step")
                continue
            rest = self._warm_rest_until - self._clock()
            if report.batch_size == 0 and rest > 0:
                with self._cond:  # only resting warm-up is left: sleep until the rest ends or a request comes
                    if not (self._inbox or self._calls or self._stopped):
                        self._wait(rest)
            elif report.idle:
                # NOTE: nothing a step can do changes without new input (a forward would have run, or a
                # sequence moved): wait for a request, a call or stop instead of stepping again at full CPU.
                with self._cond:
                    while not (self._inbox or self._calls or self._stopped):
                        self._wait()

    def _wait(self, timeout: float | None = None) -> None:
        """Block on the condition (the caller holds it)."""
        if self._on_wait is not None:
            self._on_wait(self)
        self._cond.wait(timeout)

    def _abort(self, error: BaseException) -> None:
        """End every sequence the step held with ``error`` and free them (it failed outside any one
        sequence, so its queues may no longer be consistent); requests still in the inbox go on."""
        held = [*self._running, *self._waiting, *self._warm_waiting, *([self._warm] if self._warm else [])]
        for seq in held:
            try:
                self._remove(seq)
            except Exception:  # freeing one must not keep the others from ending
                LOGGER.exception("could not free sequence %d", seq.seq_id)
            self._finish(seq, error)
        self._running.clear()
        self._waiting.clear()
        self._warm_waiting.clear()
        self._warm = None
        self._inflight.clear()
        self.engine.forget_batches()

    def _run_calls(self) -> None:
        with self._cond:
            calls, self._calls = self._calls, []
        self._changes += len(calls)
        for fn, future in calls:
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)

    def _take_inbox(self) -> None:
        with self._cond:
            inbox, self._inbox = self._inbox, []
        self._changes += len(inbox)
        for seq in inbox:
            (self._warm_waiting if seq.klass is SequenceClass.WARM else self._waiting).append(seq)
        if self._waiting or self._running:
            self._last_live = self._clock()

    def _drop_cancelled(self) -> None:
        # NOTE: the Python backend answers is_cancelled() with a round trip to the server: asked of every
        # sequence on every step it cost a single stream about a millisecond per token (docs/benchmarks.md),
        # so each sequence is asked at most every cancel_check_s.
        now, every = self._clock(), self.config.cancel_check_s
        for seq in [*self._running, *self._waiting]:
            if every and now - seq.cancel_checked < every:
                continue
            seq.cancel_checked = now
            try:
                cancelled = seq.sink is not None and seq.sink.is_cancelled()
            except Exception:  # noqa: BLE001 - NOTE: a sender that cannot answer is a client gone
                cancelled = True
            if cancelled:
                LOGGER.info("sequence %d cancelled by its client", seq.seq_id)
                self._remove(seq)
                self._finish(seq, RequestCancelledError("the request was cancelled"))

    def _admit(self) -> None:
        """The probes into their own slot, then the tenants' sequences, fairly (see admission.py)."""
        probes = sum(1 for s in self._running if is_probe(s.request.tenant))
        for seq in self._waiting.of(PROBE_TENANT):
            if probes >= PROBE_SLOTS:
                break
            # NOTE: first in the running list, so that memory preemption (newest first) reaches it last.
            if self._admit_one(seq, front=True) is True:
                probes += 1
        running = collections.Counter(s.request.tenant for s in self._running if not is_probe(s.request.tenant))
        slots = self.config.max_num_seqs - sum(running.values())
        if slots <= 0 and self._waiting:
            holder = slot_to_yield(self._waiting, running, self._shares)
            if holder is not None:
                # NOTE: one slot per step: a newcomer waits one step, and a holder loses one sequence's KV at most.
                victim = next(s for s in reversed(self._running) if s.request.tenant == holder)
                LOGGER.info("tenant over its slot share yields sequence %d to a waiting tenant", victim.seq_id)
                self._preempt(victim)
                self.stats.fair_preemptions += 1
                running[holder] -= 1
                slots = 1
        for seq in fair_order(self._waiting, running) if slots > 0 else ():
            admitted = self._admit_one(seq)
            if admitted is None and self._running:  # memory is full: admit nothing more this step
                break
            if admitted:
                running[seq.request.tenant] += 1
                slots -= 1
                if slots <= 0:
                    break
        self._admit_warm()  # NOTE: also when every slot is taken: warm-up runs in the budget live rows leave

    def _admit_one(self, seq: Sequence, front: bool = False) -> bool | None:
        """Admit one waiting live sequence if it fits: True admitted, False waits (single flight, or it ended),
        None when its memory does not fit (ended when nothing runs that could free memory)."""
        try:
            admitted = self._try_admit(seq)
        except Exception as exc:  # noqa: BLE001 - NOTE: one sequence's fault ends that sequence only
            self._fail(seq, exc, "admitting")
            return False
        if admitted is None and not self._running:
            # Nothing runs that could free memory: this request can never fit within the budget.
            self._waiting.remove(seq)
            self._finish(seq, KVBudgetError(
                f"the KV memory budget of this instance (kv_cache_bytes) is too small for a request of "
                f"{len(seq.tokens)} tokens"))
            return None
        if admitted:
            self._waiting.remove(seq)
            if front:
                self._running.insert(0, seq)
            else:
                self._running.append(seq)
            self._changes += 1
        return admitted

    def _admit_warm(self) -> None:
        if self._warm is None and self._warm_waiting:
            seq = self._warm_waiting[0]
            try:
                admitted = self._try_admit(seq)
            except Exception as exc:  # noqa: BLE001 - as above
                self._fail(seq, exc, "admitting")
                admitted = False
            if admitted:
                self._warm = self._warm_waiting.popleft()
                self._changes += 1
            elif admitted is None and not self._running:
                self._warm_waiting.popleft()
                self._finish(seq, KVBudgetError("the KV memory budget is too small for this warm prompt"))

    def _try_admit(self, seq: Sequence) -> bool | None:
        """Match the cached prefix and take its memory: True if admitted, False to wait (single
        flight), None when its memory does not fit."""
        if seq.request.adapter is not None and not self.engine.has_adapter(seq.request.adapter):
            self._remove(seq)
            self._finish(seq, AdapterUnavailableError(
                f"adapter '{seq.request.adapter}' was unloaded before the request could run"))
            return False
        cache = self.engine.prefix_cache
        match = None
        if cache is not None and seq.usable_blocks:
            usable = seq.hashes[:seq.usable_blocks]
            match = cache.match(usable, seq.request.tenant)
            if len(match) < len(usable):
                key = usable[len(match)]
                owner = self._inflight.get(key)
                # NOTE: a live request never waits for a warm prompt's block: warm-up stays out of steps
                # while a live request waits, so the two would wait for each other; it computes the block.
                warm_owner = self._warm is not None and owner == self._warm.seq_id
                if owner is not None and owner != seq.seq_id and not (warm_owner and seq.klass is SequenceClass.LIVE):
                    cache.release(match)
                    return False
        cached = match.num_tokens if match else 0
        nbytes = cached * self.engine.kv_bytes_per_token
        if cache is not None and not cache.reserve(nbytes, end_pins=seq.klass is SequenceClass.LIVE):
            if match:
                cache.release(match)
            return None
        seq.match = match
        seq.reserved_bytes = nbytes
        seq.num_computed = cached
        if seq.cached_tokens < 0:  # its first admission
            self.engine.open(seq.seq_id, seq.request, sampled=seq.klass is SequenceClass.LIVE)
        self.engine.load_prefix(seq.seq_id, match if cached else None)
        seq.stored_blocks = 0 if seq.request.is_warmup else len(match or ())
        if seq.cached_tokens < 0:
            seq.cached_tokens = cached
            seq.planned_tokens = match.planned_tokens if match else 0
            _note_admitted(seq.sink, cached)
        if match is not None and len(match) < seq.usable_blocks:
            seq.flight_key = seq.hashes[len(match)]
            self._inflight[seq.flight_key] = seq.seq_id
        return True

    def _plan(self) -> tuple[list[tuple[Sequence, int]], int]:
        """The rows of this step, ``(sequence, new tokens)``, with their memory reserved; and how many
        sequences were preempted to make room."""
        budget = self.config.max_num_batched_tokens
        planned: dict[int, tuple[Sequence, int]] = {}
        preempted = 0
        for seq in [s for s in self._running if s.remaining < 1]:
            # NOTE: cannot happen (a sequence is sampled, or ended, when its last token is computed); if it
            # ever did, the sequence could never be planned again and would hold its slot for good.
            self._fail(seq, RuntimeError(f"sequence {seq.seq_id} has no token left to compute"), "planning")
        # NOTE: the probes first: a probe row is a few tokens, and a readiness probe never waits behind tenants.
        probes = [s for s in self._running if is_probe(s.request.tenant)]
        decoding = [s for s in self._running if s.remaining == 1 and s not in probes]
        prefilling = [s for s in self._running if s.remaining > 1 and s not in probes]
        last_victim: Sequence | None = None
        for seq in [*probes, *decoding, *prefilling]:
            if seq not in self._running:  # preempted for an earlier row
                continue
            used = sum(n for _, n in planned.values())
            count = min(seq.remaining, budget - used)
            if count <= 0:
                continue
            while not self._reserve(seq, count):
                if self._warm is not None:  # warm-up gives way first: its KV is dropped, it starts again
                    warm, self._warm = self._warm, None
                    self._release(warm)
                    self._warm_waiting.appendleft(warm)
                    self.stats.warm_restarts += 1
                    continue
                victim = self._running[-1]
                self._preempt(victim)
                last_victim = victim
                preempted += 1
                planned.pop(victim.seq_id, None)
                if victim is seq:
                    break
            else:
                planned[seq.seq_id] = (seq, count)
        if self._running == [] and last_victim is not None and last_victim in self._waiting:
            # Alone it still does not fit: this request can never run within the budget.
            seq = last_victim
            self._waiting.remove(seq)
            self._finish(seq, KVBudgetError(
                f"the KV memory budget of this instance (kv_cache_bytes) is too small for a request of "
                f"{len(seq.tokens)} tokens"))
        used = sum(n for _, n in planned.values())
        warm = self._warm
        if (warm is not None and used < budget and not self._live_prefill(planned)
                and (self._clock() >= self._warm_rest_until or not self._live_recent())):
            count = min(warm.remaining, budget - used, self._warm_step_tokens())
            if self._reserve(warm, count):
                planned[warm.seq_id] = (warm, count)
            elif not self._running:
                self._warm = None
                self._release(warm)
                self._finish(warm, KVBudgetError("the KV memory budget is too small for this warm prompt"))
        return list(planned.values()), preempted

    def _live_prefill(self, planned: dict[int, tuple[Sequence, int]]) -> bool:
        """True when a live request is prefilling this step or waiting to: warm-up then stays out.

        NOTE: a warm chunk beside a live prefill would delay that request's first token by the chunk's
        cost; beside decode rows it costs each stream one chunk's time, which the cap bounds.
        """
        return bool(self._waiting or any(n > 1 for _, n in planned.values()))

    def _warm_step_tokens(self) -> int:
        """Warm tokens a step may take: ``warm_chunk_tokens`` while live traffic flows, the whole step
        budget once none has arrived for ``live_quiet_s`` (the step that is running when a live request
        arrives is what it waits for)."""
        return self.config.warm_chunk_tokens if self._live_recent() else self.config.max_num_batched_tokens

    def _live_recent(self) -> bool:
        return self._clock() - self._last_live < self.config.live_quiet_s

    def _run(self, plan: list[tuple[Sequence, int]]) -> int:
        """Run the planned rows and hand out their tokens; returns how many sequences finished."""
        # NOTE: on an engine that pads a batch (the Hugging Face forward) decode rows and prefill chunks run as
        # two forwards, not one: padding 1-token decode rows to a 256-token chunk would multiply the work. An
        # engine with ``mixed_rows`` (the packed forward) runs them in one forward, reading the weights once.
        # Decode rows go first (Sarathi-Serve's decode priority). Prefill first was measured (bench
        # concurrency, back-to-back runs at 8 streams): TTFT p50 lower, but TTFT p95, ITL p95 and
        # tokens/s worse.
        decode, prefill = [r for r in plan if r[1] == 1], [r for r in plan if r[1] > 1]
        groups = [decode + prefill] if self.engine.mixed_rows else [decode, prefill]
        finished = 0
        for group in groups:
            if not group:
                continue
            for seq, count in self._forward(group):
                if self._guarded(seq, lambda s=seq, c=count: self._advance(s, c), "serving"):
                    finished += 1
        return finished

    def _forward(self, group: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """Run one batched forward; when it raises, each row again alone, so that only the rows that fail
        by themselves end (with their error) and the others go on. Returns the rows that were computed."""
        rows = [ForwardRow(s.seq_id, s.tokens[s.num_computed:s.num_computed + n], s.num_computed, s.request.adapter)
                for s, n in group]
        try:
            self.engine.forward(rows)
            return group
        except Exception as exc:
            if len(group) == 1:
                self._fail(group[0][0], exc, "forward")
                return []
            LOGGER.warning("batched forward of %d sequences failed; running each alone", len(group), exc_info=True)
        # NOTE: a failed forward leaves each row's KV as it was (the engine commits a forward's KV only when it
        # returned, and the batch cache grows by new tensors, never by writing into a row's view), so each row
        # can be run again from it.
        computed = []
        for item, row in zip(group, rows):
            try:
                self.engine.forward([row])
            except Exception as exc:  # noqa: BLE001 - NOTE: one sequence's fault ends that sequence only
                self._fail(item[0], exc, "forward")
            else:
                computed.append(item)
        return computed

    def _advance(self, seq: Sequence, count: int) -> bool:
        """Take one computed row: its completed blocks, and its next token once its tokens are all computed;
        True when the sequence finished."""
        seq.num_computed += count
        seq.steps += 1
        self._store_blocks(seq)
        return seq.remaining == 0 and self._emit(seq)

    def _guarded(self, seq: Sequence, fn: Callable[[], T], doing: str) -> T | None:
        """``fn()`` for one sequence; when it raises, that sequence ends with the error and None is returned."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - NOTE: one sequence's fault ends that sequence only
            self._fail(seq, exc, doing)
            return None

    def _fail(self, seq: Sequence, error: BaseException, doing: str) -> None:
        """End one sequence with ``error``: out of every queue, its memory freed, the error to its client."""
        if isinstance(error, RequestError):
            LOGGER.info("sequence %d ended while %s: %s", seq.seq_id, doing, error)
        else:
            LOGGER.error("sequence %d failed while %s", seq.seq_id, doing, exc_info=error)
        try:
            self._remove(seq)
        finally:
            self._finish(seq, error)

    # ------------------------------------------------------------------------------------- helpers
    def _new_sequence(self, request: GenerateRequest, sink: SequenceSink | None,
                      klass: SequenceClass) -> Sequence:
        cache = self.engine.prefix_cache
        hashes: list[BlockHash] = []
        usable = public = 0
        if cache is not None:
            hashes, public = self.engine.block_hashes(request)
            # NOTE: at most ``len(prompt) - 1`` tokens come from the cache (as in vLLM): the last prompt
            # token is always computed, because its logits pick the first output token.
            usable = min(len(hashes), (len(request.prompt_ids) - 1) // cache.block_size)
        live = klass is SequenceClass.LIVE
        return Sequence(
            seq_id=next(_SEQ_IDS), request=request, sink=sink, klass=klass, tokens=list(request.prompt_ids),
            hashes=hashes, usable_blocks=usable, public_blocks=public, start=time.perf_counter(),
            detok=IncrementalDetokenizer(self.engine.tokenizer) if live else None)

    def _reserve(self, seq: Sequence, count: int) -> bool:
        cache = self.engine.prefix_cache
        nbytes = count * self.engine.kv_bytes_per_token
        if cache is not None and not cache.reserve(nbytes, end_pins=seq.klass is SequenceClass.LIVE):
            return False
        seq.reserved_bytes += nbytes
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Drop a running sequence's KV and put it first in line; it is recomputed when readmitted
        (prompt and the tokens it already produced: greedy output is unchanged, its client sees nothing)."""
        LOGGER.info("preempting sequence %d (%d tokens) to make room", seq.seq_id, seq.num_computed)
        self._running.remove(seq)
        self._release(seq)
        self._waiting.appendleft(seq)
        self.stats.preemptions += 1
        self._changes += 1

    def _release(self, seq: Sequence) -> None:
        """Free what a sequence holds: its KV (in the engine) and its memory, its cache match, its single-flight
        claim."""
        self.engine.release(seq.seq_id)
        cache = self.engine.prefix_cache
        if cache is not None:
            cache.unreserve(seq.reserved_bytes)
            if seq.match:
                cache.release(seq.match)
        seq.reserved_bytes = 0
        seq.match = None
        seq.num_computed = 0
        if seq.flight_key is not None and self._inflight.get(seq.flight_key) == seq.seq_id:
            del self._inflight[seq.flight_key]
        seq.flight_key = None

    def _remove(self, seq: Sequence) -> None:
        """Take a sequence out of every queue and free it, for good (the engine forgets it)."""
        for queue in (self._running, self._waiting, self._warm_waiting):
            if seq in queue:
                queue.remove(seq)
        if self._warm is seq:
            self._warm = None
        self._release(seq)
        self._uncount(seq)
        self.engine.close(seq.seq_id)

    def _uncount(self, seq: Sequence) -> None:
        """Take an ended live sequence out of its tenant's held requests (once, however it ended)."""
        if not seq.counted:
            return
        seq.counted = False
        tenant = seq.request.tenant
        with self._cond:
            left = self._held.get(tenant, 0) - 1
            if left > 0:
                self._held[tenant] = left
            else:
                self._held.pop(tenant, None)

    def _finish(self, seq: Sequence, error: BaseException | None = None) -> None:
        """Report the end of a sequence: an error to its sink or future, or a warm result. The engine forgets
        the sequence (every way out passes here or through :meth:`_remove`)."""
        self._changes += 1
        self._uncount(seq)
        self.engine.close(seq.seq_id)
        if seq.done is not None:
            if error is None:
                seq.done.set_result(seq.steps)
            elif not seq.done.done():
                seq.done.set_exception(error)
            return
        if error is not None and seq.sink is not None:
            try:
                seq.sink.fail(error)
            except Exception:
                LOGGER.debug("could not deliver the error of sequence %d", seq.seq_id, exc_info=True)

    def _store_blocks(self, seq: Sequence) -> None:
        """Store the prompt blocks this sequence completed, so later requests (and this one, if preempted) reuse
        them, and move its single-flight claim to the next block it computes."""
        cache = self.engine.prefix_cache
        if cache is None or not seq.hashes:
            return
        full = min(seq.num_computed, seq.prompt_len) // cache.block_size
        if full > seq.stored_blocks:
            request = seq.request
            self.engine.store_prefix(
                seq.seq_id, seq.hashes[:full], start_block=seq.stored_blocks, source=request.source,
                plan_id=request.plan_id, owner=request.adapter or "", tenant=request.tenant,
                public_blocks=seq.public_blocks, tokens=request.prompt_ids, retention_s=request.retention_s)
            seq.stored_blocks = full
        if seq.flight_key is not None:
            # NOTE: the claim moves with the frontier, so a follower admitted between two chunks waits
            # for the block being computed now, not only the first one.
            if self._inflight.get(seq.flight_key) == seq.seq_id:
                del self._inflight[seq.flight_key]
            seq.flight_key = None
            if full < seq.usable_blocks:
                seq.flight_key = seq.hashes[full]
                self._inflight.setdefault(seq.flight_key, seq.seq_id)

    def _emit(self, seq: Sequence) -> bool:
        """Sample the next token of a sequence whose tokens are all computed; True when it finished."""
        if seq.klass is SequenceClass.WARM:
            self._warm = None
            self._release(seq)
            self._finish(seq)
            return True
        params = seq.request.sampling
        token = self.engine.sample(seq.seq_id, params, seq.tokens)
        seq.output_tokens += 1
        is_eos = not params.ignore_eos and token in self.engine.eos_token_ids
        finished = is_eos or seq.output_tokens >= params.max_tokens
        text = "" if is_eos else seq.detok.push(token)
        if finished:
            text += seq.detok.flush()
        step = GenerationStep(
            text=text, token_id=token, prompt_tokens=seq.prompt_len, cached_tokens=seq.cached_tokens,
            planned_tokens=seq.planned_tokens, output_tokens=seq.output_tokens, finished=finished,
            finish_reason=("stop" if is_eos else "length") if finished else "",
            elapsed=time.perf_counter() - seq.start)
        adapter = seq.request.adapter or ""
        self.stats.output_tokens[adapter] = self.stats.output_tokens.get(adapter, 0) + 1
        try:
            seq.sink.send(step)
        except Exception as exc:  # the client is gone, or its response could not be built
            LOGGER.warning("sequence %d: sending a response failed; dropping it", seq.seq_id, exc_info=True)
            self._remove(seq)
            self._finish(seq, exc)  # best effort: a sender that still works closes the request with it
            return True
        if finished:
            self._remove(seq)
        else:
            seq.tokens.append(token)
        return finished

    def _unload(self, name: str) -> None:
        for seq in [*self._running, *self._waiting, *self._warm_waiting, *([self._warm] if self._warm else [])]:
            if seq.request.adapter == name:
                self._remove(seq)
                self._finish(seq, AdapterUnavailableError(f"adapter '{name}' was retired while the request ran",
                                                          kind=ErrorKind.UNAVAILABLE))
        self.engine.unload_adapter(name)
