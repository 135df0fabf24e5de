"""Per-tenant admission of one instance's live requests: what a tenant may hold, the order tenants are admitted in,
and the sidecar's reserved probe slot. No I/O, no threads: the scheduler (:mod:`~warmup_tools.lora_adapter.scheduler`)
holds the state and calls these.

- **Queue share**: a tenant may hold its running sequences plus ``tenant_queue_share`` of ``max_queue`` waiting
  (:meth:`TenantShares.max_held`); one more is refused with :class:`~warmup_tools.common.errors.TenantBusyError`
  (``rate_limited``: HTTP 429 at the front), while the instance still queues the other tenants' requests up to its
  own bound (``max_num_seqs + max_queue``, :class:`~warmup_tools.common.errors.ServerBusyError` past it).
- **Fair admission**: a free running slot goes to the waiting tenant that runs the fewest sequences (ties: the
  oldest request first), so a tenant that arrives behind a flood waits for the next free slot, not for the flood.
- **Slot share**: while another tenant's request waits and every slot is taken, a tenant running more than
  ``tenant_slot_share`` of ``max_num_seqs`` yields one slot per step (its most recently admitted sequence is
  preempted: recomputed later, invisible to its client), so the newcomer waits one step, not one generation.
- **The probe's slot**: the sidecar's readiness probes (:data:`~warmup_tools.common.records.PROBE_TENANT`, which
  only the sidecar can prove: :mod:`warmup_tools.triton.trust`) never wait behind tenants: up to
  :data:`PROBE_SLOTS` probe sequences run beside ``max_num_seqs``, first in each step's budget, and up to
  :data:`PROBE_HELD` are taken whatever the tenants hold.

Memory stays bounded under a flood of unique tenants: a tenant has an entry only while it holds a request, and
the instance holds at most ``max_num_seqs + max_queue`` (plus :data:`PROBE_HELD`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import TYPE_CHECKING, Iterator

from warmup_tools.common.records import PROBE_TENANT

if TYPE_CHECKING:
    from warmup_tools.lora_adapter.sequence import Sequence
    from warmup_tools.lora_adapter.settings import SchedulerConfig

#: Running slots beyond ``max_num_seqs`` kept for the sidecar's probes (the sidecar probes one model at a time).
PROBE_SLOTS = 1
#: Probe requests one instance holds at most (running and waiting); one more is answered busy, which the sidecar
#: reads as alive. NOTE: a few, not one: a probe that timed out may still be held until its cancellation is seen.
PROBE_HELD = 4


def is_probe(tenant: str) -> bool:
    """Whether ``tenant`` is the sidecar's probe tenant (proven before a request reaches the scheduler)."""
    return tenant == PROBE_TENANT


@dataclasses.dataclass(frozen=True, slots=True)
class TenantShares:
    """The bounds :class:`~warmup_tools.lora_adapter.settings.SchedulerConfig` puts on one tenant, in requests."""

    #: Requests one tenant may hold (running and waiting).
    max_held: int
    #: Running slots a tenant keeps while another tenant's request waits for one.
    slot_cap: int

    @classmethod
    def of(cls, config: "SchedulerConfig") -> "TenantShares":
        queue = min(config.max_queue, max(1, int(config.tenant_queue_share * config.max_queue)))
        return cls(max_held=config.max_num_seqs + queue,
                   slot_cap=max(1, int(config.tenant_slot_share * config.max_num_seqs)))


class TenantQueues:
    """The waiting live sequences: one FIFO per tenant. Iteration runs tenant by tenant in the order they
    arrived (one tenant's requests in its own order)."""

    def __init__(self) -> None:
        self._queues: dict[str, collections.deque[Sequence]] = {}
        self._len = 0

    def append(self, seq: "Sequence") -> None:
        self._queues.setdefault(seq.request.tenant, collections.deque()).append(seq)
        self._len += 1

    def appendleft(self, seq: "Sequence") -> None:
        """First in its tenant's line (a preempted sequence)."""
        self._queues.setdefault(seq.request.tenant, collections.deque()).appendleft(seq)
        self._len += 1

    def remove(self, seq: "Sequence") -> None:
        queue = self._queues[seq.request.tenant]
        queue.remove(seq)
        self._len -= 1
        if not queue:  # NOTE: no entry outlives a tenant's last request (a flood of unique tenants stays bounded)
            del self._queues[seq.request.tenant]

    def clear(self) -> None:
        self._queues.clear()
        self._len = 0

    def of(self, tenant: str) -> tuple["Sequence", ...]:
        """One tenant's waiting sequences, in its order."""
        return tuple(self._queues.get(tenant, ()))

    def tenants(self) -> list[str]:
        return list(self._queues)

    def __contains__(self, seq: object) -> bool:
        queue = self._queues.get(getattr(getattr(seq, "request", None), "tenant", None))
        return queue is not None and seq in queue

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator["Sequence"]:
        for queue in list(self._queues.values()):
            yield from list(queue)


def fair_order(waiting: TenantQueues, running: collections.Counter[str]) -> Iterator["Sequence"]:
    """The order waiting tenants' sequences are offered a slot: the tenant that runs the fewest first (ties: the
    oldest head request), one sequence at a time, counting the ones admitted meanwhile. The caller adds 1 to
    ``running[tenant]`` for each one it admits; the probe tenant is left out (it has its own slot)."""
    pending = {t: collections.deque(waiting.of(t)) for t in waiting.tenants() if not is_probe(t)}
    while pending:
        tenant = min(pending, key=lambda t: (running[t], pending[t][0].seq_id))
        queue = pending[tenant]
        seq = queue.popleft()
        if not queue:
            del pending[tenant]
        yield seq


def slot_to_yield(waiting: TenantQueues, running: collections.Counter[str], shares: TenantShares) -> str | None:
    """The tenant that must yield a running slot now, or None: when every slot is taken, the waiting tenant next in
    line (:func:`fair_order`) runs fewer than its share, and the tenant that runs the most runs more."""
    candidates = [t for t in waiting.tenants() if not is_probe(t)]
    if not candidates or not running:
        return None
    first = min(candidates, key=lambda t: (running[t], waiting.of(t)[0].seq_id))
    holder, held = running.most_common(1)[0]
    if running[first] < shares.slot_cap < held and holder != first:
        return holder
    return None
