"""A tenant's requests in flight through one front, bounded at the door: one more than ``tenant_max_in_flight``
is answered 429 ``rate_limit_exceeded`` (with ``Retry-After``) before any call to tritonserver.

lora_adapter bounds a tenant too (:mod:`warmup_tools.lora_adapter.admission`), but a request it refuses has already
gone through the front, the router, tokenizer_cache and embedding_cache on the replica's cores: a tenant that
resends at once after each refusal would take those cores from the others. The front's bound, by default what
lora_adapter holds for one tenant, refuses that excess where it costs least.

A request holds its place from :meth:`TenantLimit.acquire` (before its first call to tritonserver) to its
generation's close (:meth:`warmup_tools.front.generation.Generation.close`: its answer sent, an error, or its
client gone). A tenant has an entry only while it holds a request, so a flood of unique tenants leaves none. The
sidecar's probe tenant, proven by its key in trust mode, is never counted nor refused.
"""

from __future__ import annotations

from warmup_tools.common.records import PROBE_TENANT
from warmup_tools.front.errors import OpenAIError
from warmup_tools.lora_adapter.admission import TenantShares
from warmup_tools.lora_adapter.settings import SchedulerConfig

#: The tenant of a request that names none (lora_adapter's name for it too).
ANONYMOUS = "default"
#: The largest ``tenant_max_in_flight``: in practice no bound (only lora_adapter's share then refuses a tenant).
MAX_TENANT_BOUND = 1 << 20


def tenant_bound(configured: int, scheduler: SchedulerConfig | None = None) -> int:
    """The front's bound per tenant: ``configured``, or for 0 what one lora_adapter instance holds for one tenant
    (its running slots plus its share of the queue: :class:`~warmup_tools.lora_adapter.admission.TenantShares`)
    under ``scheduler`` (default: the package's scheduler settings)."""
    if configured > 0:
        return configured
    # NOTE: one instance: the shipped repository runs one lora_adapter instance per device (its config.pbtxt);
    # a deployment with several sets tenant_max_in_flight to their sum.
    return TenantShares.of(scheduler or SchedulerConfig()).max_held


class TenantLimit:
    """Requests in flight per tenant in this front (one event loop: no lock)."""

    def __init__(self, bound: int) -> None:
        if bound < 1:
            raise ValueError(f"the bound per tenant must be at least 1, not {bound}")
        self.bound = bound
        self._held: dict[str, int] = {}

    def acquire(self, tenant: str | None, proven: bool) -> str | None:
        """Take a place for ``tenant`` (None: anonymous); ``proven``: the caller's key named it (trust mode).
        Returns what :meth:`release` takes back (None: nothing was counted, the probe tenant); raises 429 when the
        tenant holds its bound."""
        name = self.check(tenant, proven)
        if name is not None:
            self._held[name] = self._held.get(name, 0) + 1
        return name

    def check(self, tenant: str | None, proven: bool) -> str | None:
        """What :meth:`acquire` would count, or its 429, without taking a place (a refusal before the request's
        other checks and its rendering, which :meth:`acquire` then confirms)."""
        name = tenant or ANONYMOUS
        if name == PROBE_TENANT and proven:
            return None  # NOTE: the sidecar's probes are never refused here (lora_adapter keeps them a slot)
        held = self._held.get(name, 0)
        if held >= self.bound:
            raise OpenAIError(
                429, f"too many concurrent requests from this tenant: it already has {held} requests in flight on "
                     "this replica, its share; wait for some of them to finish before sending more, or lower your "
                     "concurrency", code="rate_limit_exceeded")
        return name

    def release(self, name: str | None) -> None:
        if name is None:
            return
        left = self._held.get(name, 0) - 1
        if left > 0:
            self._held[name] = left
        else:  # NOTE: no entry outlives a tenant's last request (a flood of unique tenants stays bounded)
            self._held.pop(name, None)

    def held(self, tenant: str | None) -> int:
        return self._held.get(tenant or ANONYMOUS, 0)

    def __len__(self) -> int:
        """Tenants with a request in flight."""
        return len(self._held)
