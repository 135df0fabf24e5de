"""Live warm-up plans through the control folder: the plan every instance serves, and each one's coverage.

Beside the adapter files of :mod:`warmup_tools.control.registry` the control folder holds::

    <root>/plan.json                   the plan to serve now: a planner plan file, written only by
                                       :func:`warmup_tools.control.plan_history.write_live_plan` (`apply-plan`,
                                       the sidecar's re-plan, `plan rollback`), which keeps the plans/ history
    <root>/canary.json                 a plan on trial: which instances serve it instead of plan.json (one
                                       instance of a replica, or every instance of one replica), written and
                                       removed only by :mod:`warmup_tools.sidecar.canary.trial`; the plan itself
                                       is in the history (``plans/<id>.json``)
    <root>/plan_status/<host>.<instance>.json
                                       written by each lora_adapter instance: the plan it applied and, per
                                       adapter, how many blocks of its planned hot set are resident (replicas
                                       share the folder, so the file and the report carry the host), and the
                                       cache's live check of the plan's pins (``pins``: :class:`PinReport`)

The operator channel is trusted but still checked: ``plan.json`` is read only up to ``max_bytes``, must be
a plan of :data:`~warmup_tools.common.plan.PLAN_FORMAT` whose content hashes to its ``plan_id``, with
at most ``max_items`` ``kv_prefix`` items of valid tenant and adapter names, integer token ids and, where an
item has one, a ``retention_s`` in the bound lora_adapter holds a sample's ``warmup_retention_s`` to. A file
that fails is refused with one log line (once per version of the file) and the instance keeps its plan.

Why a status file and not only Triton's ``/metrics`` for coverage: the sidecar needs, per instance, the
plan id, the counts and *why* a plan falls short (a budget that cannot hold it), atomically and with
the time it was written (a report from a stub that died is stale). JSON files beside the adapter statuses
give that to the sidecar and the CLI with the conventions the control folder already has; the same counts
also go to ``/metrics`` as gauges (``warmup_kv_plan_blocks``, ``warmup_kv_plan_blocks_resident``) for
dashboards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import re
import time
from pathlib import Path
from typing import Any, Mapping

from warmup_tools.common.control_json import loads_bounded, read_file_capped
from warmup_tools.common.errors import FileFormatError
from warmup_tools.common.files import stat_key, write_atomic
from warmup_tools.common.plan import PLAN_FORMAT, Plan, PlanError
from warmup_tools.common.wire import plan_retention
from warmup_tools.control.state import LifecycleError, validate_name

LOGGER = logging.getLogger(__name__)

PLAN_FILE = "plan.json"
CANARY_FILE = "canary.json"
CANARY_FORMAT = 1
MAX_CANARY_BYTES = 64 * 1024
#: The folder of the plan history (:mod:`warmup_tools.control.plan_history`), where a canary's plan is.
HISTORY_DIR = "plans"
PLAN_STATUS_DIR = "plan_status"
STATUS_FORMAT = 1
#: Bounds on what an instance reads from the control folder.
MAX_PLAN_BYTES = 16 * 1024 * 1024
MAX_PLAN_ITEMS = 4096
#: The most arrays and objects plan.json may hold, counted on its bytes before it is parsed
#: (control_json.json_containers). A planner's item is three (itself, its token_ids, its clusters), and brings at
#: most a tokenizer template, an embedding item, a dropped item in a rolling plan's summary and a cluster (two,
#: with its centroid): 8 per item, the rest is room for clusters no item warms. Parsing is what costs (16 MiB of
#: ``[[],[],...]``, 5.6 million lists, took every instance 6.7 s and 785 MiB before the format check refused it);
#: this many cost milliseconds, and token ids, numbers, are not counted.
MAX_PLAN_CONTAINERS = 16 * MAX_PLAN_ITEMS
MAX_ITEM_TOKENS = 32768
MAX_STATUS_BYTES = 256 * 1024
#: Why a planned block is not resident (shown in a status, and by the sidecar's /ready).
SHORT_BUDGET = "budget"


@dataclasses.dataclass(frozen=True, slots=True)
class PlanItem:
    """One planned KV prefix: its tenant, its adapter ("" for the base model), its token ids, and how long its
    blocks stay pinned once warmed (None: the instance's ``kv_pin_retention_s``)."""

    tenant: str
    adapter: str
    token_ids: tuple[int, ...]
    retention_s: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class LivePlan:
    """What an instance needs of a plan file to warm and pin it."""

    plan_id: str
    block_size: int
    tokenizer_fingerprint: str
    items: tuple[PlanItem, ...]

    @classmethod
    def parse(cls, raw: bytes, *, max_items: int = MAX_PLAN_ITEMS,
              max_containers: int = MAX_PLAN_CONTAINERS) -> LivePlan:
        """Validate a plan file's bytes; :class:`PlanError` says what is wrong."""
        try:
            data = loads_bounded(raw, PLAN_FILE, max_containers=max_containers)
        except FileFormatError as exc:
            raise PlanError(str(exc)) from None
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise PlanError(f"not a plan of format {PLAN_FORMAT}")
        plan_id, block_size, fingerprint, items = (data.get(k) for k in
                                                   ("plan_id", "block_size", "tokenizer_fingerprint", "items"))
        if not isinstance(plan_id, str) or not 1 <= len(plan_id) <= 64 or not isinstance(fingerprint, str):
            raise PlanError("plan_id and tokenizer_fingerprint must be short strings")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise PlanError("block_size must be a positive integer")
        if not isinstance(items, list) or len(items) > max_items:
            raise PlanError(f"items must be a list of at most {max_items} items")
        parsed = [_item(index, item, block_size) for index, item in enumerate(items)]
        if Plan.content_id(items, block_size, fingerprint) != plan_id:
            raise PlanError(f"its content does not hash to plan_id {plan_id} (edited after it was built)")
        return cls(plan_id, block_size, fingerprint, tuple(p for p in parsed if p is not None))


@dataclasses.dataclass(frozen=True, slots=True)
class CanaryAssignment:
    """``canary.json``: the history id of a plan on trial and the instances that serve it: ``instances`` of
    ``host``, or every instance of ``host`` and of each of ``replicas``."""

    #: The plan's history id (its file is ``plans/<plan>.json``).
    plan: str
    #: The plan's ``plan_id`` (what the canary instances report).
    plan_id: str
    #: The replica (``replica_name``, else the host name) whose instances serve it.
    host: str
    #: Those instances (empty: every instance of ``host``).
    instances: tuple[str, ...]
    #: Epoch seconds the trial started.
    started_at: float
    #: What started it (``plan canary``, ``sidecar re-plan``) and who.
    by: str = ""
    user: str = ""
    #: A trial on whole replicas: the replicas beside ``host`` (which judges it) that serve it too.
    replicas: tuple[str, ...] = ()

    @property
    def hosts(self) -> tuple[str, ...]:
        """Every replica that serves the plan on trial (``host`` first)."""
        return (self.host, *self.replicas)

    def targets(self, host: str, instance: str) -> bool:
        """Whether the instance ``instance`` of replica ``host`` serves the plan on trial."""
        return host in self.hosts and (not self.instances or instance in self.instances)

    def to_json(self) -> bytes:
        document = {"format": CANARY_FORMAT, **dataclasses.asdict(self), "instances": list(self.instances),
                    "replicas": list(self.replicas)}
        return (json.dumps(document, sort_keys=True) + "\n").encode("utf-8")

    @classmethod
    def parse(cls, raw: bytes) -> CanaryAssignment:
        """Validate ``canary.json``'s bytes; :class:`PlanError` says what is wrong."""
        try:
            data = loads_bounded(raw, CANARY_FILE)
        except FileFormatError as exc:
            raise PlanError(str(exc)) from None
        fields = {f.name for f in dataclasses.fields(cls)} | {"format"}
        # NOTE: "replicas" may be missing (a file written before trials could span replicas: none beside host).
        if not isinstance(data, dict) or data.get("format") != CANARY_FORMAT or set(data) | {"replicas"} != fields:
            raise PlanError(f"not a canary assignment of format {CANARY_FORMAT}")
        plan, plan_id, host, instances, at = (data[k] for k in ("plan", "plan_id", "host", "instances", "started_at"))
        if not isinstance(plan, str) or not re.fullmatch(r"[0-9a-f]{16}", plan):
            raise PlanError("plan must be a plan history id (16 hex digits)")
        if not isinstance(plan_id, str) or not 1 <= len(plan_id) <= 64:
            raise PlanError("plan_id must be a short string")
        if not isinstance(instances, list) or len(instances) > 64:
            raise PlanError("instances must be a list of at most 64 instance names")
        replicas = data.get("replicas", [])
        if not isinstance(replicas, list) or len(replicas) > 256 or (replicas and instances):
            raise PlanError("replicas must be a list of at most 256 replica names, and only on a trial on whole "
                            "replicas (no instances named)")
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at):
            raise PlanError("started_at must be a number (epoch seconds)")
        try:
            names = tuple(validate_name(i, what="instance name") for i in instances)
            host = _host(host)
            others = tuple(_host(r) for r in replicas)
        except (LifecycleError, ValueError) as exc:
            raise PlanError(str(exc)) from None
        if host in others or "" in others or len(set(others)) != len(others):
            raise PlanError("replicas must name each replica once, and not host")
        by, user = (_TEXT.sub("?", str(data[k]))[:64] for k in ("by", "user"))
        return cls(plan, plan_id, host, names, float(at), by, user, others)


class CanaryError(PlanError):
    """A trial cannot start or end as asked (one is running already, or another one is)."""


def read_canary(root: Path, *, max_bytes: int = MAX_CANARY_BYTES) -> CanaryAssignment | None:
    """The plan on trial in ``root`` (None: no ``canary.json``); :class:`PlanError` for a file that is not one."""
    path = Path(root) / CANARY_FILE
    try:
        raw = read_file_capped(path, max_bytes, CANARY_FILE)
    except FileNotFoundError:
        return None
    except (OSError, FileFormatError) as exc:
        raise PlanError(f"{path}: {exc}") from None
    return CanaryAssignment.parse(raw)


class PlanFileWatcher:
    """Re-reads the plan this instance serves only when its file changed; a bad file is logged once and ignored.

    The plan is ``plan.json``, or, while ``canary.json`` names this instance (``host``, ``who``), the plan on
    trial from the history. A canary that ends (promoted: ``plan.json`` now holds its plan; rolled back:
    ``plan.json`` still holds the plan it was tried against) sends the instance back to ``plan.json``."""

    def __init__(self, root: Path, *, max_bytes: int = MAX_PLAN_BYTES, max_items: int = MAX_PLAN_ITEMS,
                 who: str = "", host: str = "") -> None:
        self.root = Path(root)
        self.path = self.root / PLAN_FILE
        self.max_bytes = max_bytes
        self.max_items = max_items
        self.who = who
        self.host = host
        self._key: tuple[Path, tuple[int, int, int]] | None = None
        self._canary_key: tuple[int, int, int] | None = None
        self._canary: CanaryAssignment | None = None
        #: The last refused file's error (shown in the instance's status until a good file comes).
        self.error = ""

    @property
    def canary(self) -> CanaryAssignment | None:
        """The trial this instance serves now, if any."""
        return self._canary

    def poll(self) -> LivePlan | None:
        """The plan to serve if its file changed since the last poll and is valid, else None."""
        self._poll_canary()
        path = self.root / HISTORY_DIR / f"{self._canary.plan}.json" if self._canary is not None else self.path
        key = stat_key(path)
        if key is None or (path, key) == self._key:
            return None
        self._key = (path, key)
        try:
            raw = read_file_capped(path, self.max_bytes, PLAN_FILE)
            plan = LivePlan.parse(raw, max_items=self.max_items)
            if self._canary is not None and plan.plan_id != self._canary.plan_id:
                raise PlanError(f"the plan on trial is {self._canary.plan_id}, the file holds {plan.plan_id}")
        except (OSError, FileFormatError, PlanError) as exc:
            self.error = f"{path} refused: {exc}"
            LOGGER.error("%s%s; keeping the plan served now", f"instance {self.who}: " if self.who else "",
                         self.error)
            return None
        self.error = ""
        return plan

    def _poll_canary(self) -> None:
        path = self.root / CANARY_FILE
        key = stat_key(path)
        if key == self._canary_key:
            return
        self._canary_key = key
        try:
            canary = read_canary(self.root)
        except PlanError as exc:
            LOGGER.error("%s%s refused: %s; serving plan.json", f"instance {self.who}: " if self.who else "",
                         path, exc)
            canary = None
        self._canary = canary if canary is not None and canary.targets(self.host, self.who) else None


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterCoverage:
    """An adapter's planned hot set on one instance: planned blocks, those resident, and why any are not."""

    planned: int
    resident: int
    live: bool = True
    #: Why blocks are missing once warm-up finished ("" while warming or when complete).
    shortfall: str = ""

    @property
    def coverage(self) -> float:
        return self.resident / self.planned if self.planned else 1.0


#: The live check's states (:meth:`~warmup_tools.kv.prefix_cache.PrefixCache.pin_report`): the plan pins no
#: block (``none``), its pins hold (``pinned``), every pin ended at its retention (``expired``), or the live check
#: released them because they cost live traffic more hits than they gave (``released``).
PIN_STATES = ("none", "pinned", "expired", "released")
#: The most adapters one pin report lists (an instance's own adapters and the base model).
MAX_PIN_ADAPTERS = 256


@dataclasses.dataclass(frozen=True, slots=True)
class AdapterPins:
    """One adapter's pins under the plan on one instance: pinned now, hits on them against the hits the blocks
    evicted for them would have had (since the plan became active), and pins that ended."""

    pinned_blocks: int = 0
    pin_hits: int = 0
    shadow_hits: int = 0
    expired_blocks: int = 0
    released_blocks: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class PinReport:
    """The cache's live check of the plan's pins on one instance, as its status carries it (the JSON of
    :meth:`~warmup_tools.kv.prefix_cache.PrefixCache.pin_report`, checked: the sidecar reads it)."""

    plan_id: str | None = None
    #: One of :data:`PIN_STATES`.
    state: str = "none"
    #: The live check's window (0: the check is off).
    window_s: float = 0.0
    pinned_blocks: int = 0
    pin_hits: int = 0
    shadow_hits: int = 0
    expired_blocks: int = 0
    released_blocks: int = 0
    #: Times the live check released the plan's pins.
    releases: int = 0
    #: The current window's hits on pinned blocks and shadow hits.
    window_pin_hits: int = 0
    window_shadow_hits: int = 0
    #: Why the pins were released ("" when they were not).
    reason: str = ""
    adapters: Mapping[str, AdapterPins] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        document = dataclasses.asdict(self)
        document["adapters"] = {name: dataclasses.asdict(pins) for name, pins in sorted(self.adapters.items())}
        return document

    @classmethod
    def from_dict(cls, raw: Any) -> PinReport:
        """A report from its JSON; ``ValueError`` says what is wrong. Keys it does not know are left out."""
        if not isinstance(raw, dict):
            raise ValueError("pins must be an object")
        state = raw.get("state", "none")
        if state not in PIN_STATES:
            raise ValueError(f"pins.state must be one of {', '.join(PIN_STATES)}")
        window = raw.get("window_s", 0.0)
        if isinstance(window, bool) or not isinstance(window, (int, float)) or not 0 <= window < math.inf:
            raise ValueError("pins.window_s must be a non-negative number of seconds")
        adapters = raw.get("adapters", {})
        if not isinstance(adapters, dict) or len(adapters) > MAX_PIN_ADAPTERS:
            raise ValueError(f"pins.adapters must be an object of at most {MAX_PIN_ADAPTERS} adapters")
        counts = {f.name: _count(raw, f.name) for f in dataclasses.fields(cls) if f.type in ("int", int)}
        return cls(plan_id=_optional_str(raw.get("plan_id")), state=state, window_s=float(window),
                   reason=_TEXT.sub("?", str(raw.get("reason", "")))[:500],
                   adapters={validate_name(name, what="adapter"): _adapter_pins(pins)
                             for name, pins in sorted(adapters.items())}, **counts)


@dataclasses.dataclass(frozen=True, slots=True)
class PlanStatus:
    """What one instance reports about its plan (``plan_status/<instance>.json``)."""

    instance: str
    #: The plan whose hot set the counts are of (None: no plan).
    plan_id: str | None
    #: ``samples`` (its model_warmup samples) or ``control`` (plan.json).
    source: str
    #: ``none``, ``warming`` or ``applied``.
    state: str
    adapters: Mapping[str, AdapterCoverage]
    detail: str = ""
    #: The last plan file this instance refused, if any.
    error: str = ""
    reported_at: float = 0.0
    #: The host (pod) the instance runs on: replicas share the control folder and their instances have the
    #: same names, so each sidecar reads only its own host's reports.
    host: str = ""
    #: The cache's live check of the plan's pins (None: no KV cache, or a report from before the check).
    pins: PinReport | None = None

    @property
    def key(self) -> str:
        """``host/instance`` (the instance alone without a host): unique across replicas."""
        return f"{self.host}/{self.instance}" if self.host else self.instance

    def to_json(self) -> bytes:
        document = {"format": STATUS_FORMAT, "instance": self.instance, "plan_id": self.plan_id,
                    "source": self.source, "state": self.state, "detail": self.detail, "error": self.error,
                    "reported_at": self.reported_at, "host": self.host,
                    "adapters": {n: dataclasses.asdict(c) for n, c in sorted(self.adapters.items())},
                    "pins": self.pins.to_dict() if self.pins is not None else None}
        return (json.dumps(document, sort_keys=True) + "\n").encode("utf-8")

    @classmethod
    def from_json(cls, raw: bytes) -> PlanStatus:
        try:
            data = loads_bounded(raw, "plan status")
            if not isinstance(data, dict) or data.get("format") != STATUS_FORMAT:
                raise ValueError(f"not a plan status of format {STATUS_FORMAT}")
            adapters = data["adapters"]
            if not isinstance(adapters, dict):
                raise ValueError("adapters must be an object")
            return cls(
                instance=validate_name(data["instance"], what="instance name"),
                plan_id=_optional_str(data["plan_id"]), source=str(data["source"]), state=str(data["state"]),
                adapters={validate_name(n, what="adapter"): _coverage(c) for n, c in adapters.items()},
                detail=str(data.get("detail", ""))[:1000], error=str(data.get("error", ""))[:1000],
                reported_at=float(data["reported_at"]), host=_host(data.get("host", "")),
                pins=PinReport.from_dict(data["pins"]) if data.get("pins") is not None else None)
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, LifecycleError) as exc:
            raise ValueError(f"not a valid plan status: {exc}") from None


class PlanStatusBoard:
    """``plan_status/``: one writer per instance, any number of readers."""

    def __init__(self, root: Path, *, max_bytes: int = MAX_STATUS_BYTES) -> None:
        self.folder = Path(root) / PLAN_STATUS_DIR
        self.max_bytes = max_bytes

    def report(self, status: PlanStatus) -> None:
        validate_name(status.instance, what="instance name")
        host = f"{hashlib.sha256(status.host.encode()).hexdigest()[:12]}." if status.host else ""
        write_atomic(self.folder / f"{host}{status.instance}.json", status.to_json())

    def read_all(self, host: str | None = None) -> tuple[dict[str, PlanStatus], list[str]]:
        """Every readable status by :attr:`PlanStatus.key` (with ``host``: only that host's, by instance), and
        one line per file that was skipped (too big, malformed)."""
        found: dict[str, PlanStatus] = {}
        skipped: list[str] = []
        if not self.folder.is_dir():
            return found, skipped
        for path in sorted(self.folder.glob("*.json"))[:1024]:
            if path.name.startswith("."):
                continue
            try:
                raw = read_file_capped(path, self.max_bytes, "status file")  # a FIFO is refused, not waited on
                status = PlanStatus.from_json(raw)
            except (OSError, ValueError) as exc:
                skipped.append(f"{path.name}: {exc}")
                continue
            if host is None:
                found[status.key] = status
            elif status.host == host:
                found[status.instance] = status
        return found, skipped

    def hosts(self, since: float) -> list[str]:
        """The replicas (hosts) with an instance that reported at or after ``since``, by name (an unnamed host's
        reports are left out)."""
        statuses, _ = self.read_all()
        return sorted({s.host for s in statuses.values() if s.host and s.reported_at >= since})

    def wait_for(self, plan_id: str, *, instances: int | None = None, timeout_s: float = 600.0,
                 poll_s: float = 0.5, since: float = 0.0) -> dict[str, PlanStatus]:
        """Wait until instances report ``plan_id`` applied (at least ``instances``, or every instance that
        reported since ``since``); PlanError on timeout, naming each instance's state."""
        deadline = time.monotonic() + timeout_s
        while True:
            statuses, _ = self.read_all()
            current = {i: s for i, s in statuses.items() if s.reported_at >= since}
            done = {i: s for i, s in current.items() if s.plan_id == plan_id and s.state == "applied"}
            if (len(done) >= instances) if instances is not None else (current and len(done) == len(current)):
                return done
            if time.monotonic() >= deadline:
                states = "; ".join(f"{i}: {s.state} plan {s.plan_id} {s.error or s.detail}".strip()
                                   for i, s in sorted(current.items())) or "no instance reported"
                raise PlanError(f"timed out after {timeout_s:g} s waiting for plan {plan_id} on "
                                f"{instances if instances is not None else 'every'} instance(s): {states}")
            time.sleep(poll_s)


# ------------------------------------------------------------------------------------- helpers
def _item(index: int, item: Any, block_size: int) -> PlanItem | None:
    if not isinstance(item, dict):
        raise PlanError(f"item {index} is not an object")
    if item.get("kind") != "kv_prefix":
        return None
    ids = item.get("token_ids")
    if (not isinstance(ids, list) or not ids or len(ids) % block_size or len(ids) > MAX_ITEM_TOKENS
            or not all(type(i) is int and 0 <= i < 2**31 for i in ids)):
        raise PlanError(f"item {index}: token_ids must be a non-empty list of at most {MAX_ITEM_TOKENS} "
                        f"non-negative integers, a multiple of block_size {block_size} long")
    try:
        tenant = validate_name(item.get("tenant") or "default", what="tenant")
        adapter = item.get("adapter") or ""
        if adapter:
            validate_name(adapter)
    except LifecycleError as exc:
        raise PlanError(f"item {index}: {exc}") from None
    try:
        retention = plan_retention(item.get("retention_s"))  # NOTE: the bound a sample's warmup_retention_s has
    except ValueError as exc:
        raise PlanError(f"item {index}: {exc}") from None
    return PlanItem(tenant, adapter, tuple(ids), retention)


def _coverage(raw: Any) -> AdapterCoverage:
    if not isinstance(raw, dict):
        raise ValueError("coverage must be an object")
    planned, resident = raw["planned"], raw["resident"]
    if type(planned) is not int or type(resident) is not int or not 0 <= resident <= planned:
        raise ValueError("planned and resident must be integers with 0 <= resident <= planned")
    return AdapterCoverage(planned, resident, bool(raw.get("live", True)), str(raw.get("shortfall", ""))[:500])


def _count(raw: Mapping[str, Any], key: str) -> int:
    value = raw.get(key, 0)
    if type(value) is not int or not 0 <= value < 2**63:
        raise ValueError(f"pins.{key} must be a non-negative integer")
    return value


def _adapter_pins(raw: Any) -> AdapterPins:
    if not isinstance(raw, dict):
        raise ValueError("pins.adapters entries must be objects")
    return AdapterPins(**{f.name: _count(raw, f.name) for f in dataclasses.fields(AdapterPins)})


def _host(value: Any) -> str:
    if not isinstance(value, str) or not _HOST.fullmatch(value):
        raise ValueError("host must be a host name")
    return value


_HOST = re.compile(r"[A-Za-z0-9._-]{0,253}")
_TEXT = re.compile(r"[^\x20-\x7e]")


def _optional_str(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > 64:
        raise ValueError("plan_id must be a short string or null")
    return value
