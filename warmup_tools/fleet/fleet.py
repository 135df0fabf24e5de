"""The fleet: replicas and the router, started, scaled out and in, and stopped as one context manager::

    with Fleet(FleetSettings(replicas=2, policy="cache_aware")) as fleet:
        ...  # fleet.router.url + "/v1/chat/completions"
        fleet.scale_out()        # a new replica joins once warm (restored from the snapshot folder)
        fleet.scale_in("r1")     # out of the router, drained, snapshot written, stopped
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import tempfile
from pathlib import Path
from types import TracebackType

from warmup_tools.common.errors import ServerError
from warmup_tools.common.files import read_or_create_secret
from warmup_tools.fleet.membership import Membership, routed_urls
from warmup_tools.fleet.replica import Replica
from warmup_tools.fleet.router import Router, ServedModel
from warmup_tools.fleet.settings import FleetSettings

LOGGER = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Departure:
    """What one scale-in came to."""

    name: str
    #: Whether the replica drained and exited by itself (else it was killed at ``stop_timeout_s``).
    clean: bool
    #: The replica's snapshot manifests written during its stop (file names).
    snapshots_written: tuple[str, ...]


class Fleet:
    """See the module docstring. Nothing started here outlives :meth:`stop` (or the process)."""

    def __init__(self, settings: FleetSettings, served: ServedModel | None = None) -> None:
        """``served``: the model the replicas serve, which the router tokenizes for with ``worker_protocol`` grpc
        (``warmup_tools.ops.cli.fleet.served_model``)."""
        if settings.grpc and served is None:
            raise ValueError("worker_protocol grpc: a Fleet needs the served model (ServedModel)")
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if settings.work_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="warmup-fleet-")
        self.work_dir = Path(settings.work_dir or self._tmp.name)  # type: ignore[union-attr]
        if settings.grpc and settings.router_key_file is None:
            settings = dataclasses.replace(settings, control_key_file=self._new_control_key())
        self.settings = settings
        self.control_dir = Path(settings.control_dir or self.work_dir / "control")
        self.snapshot_dir = Path(settings.snapshot_dir or self.work_dir / "snapshots")
        #: Every replica's request logs, in a subfolder named after it.
        self.request_log_dir = Path(settings.request_log_dir or self.work_dir / "requests")
        self.router = Router(settings, self.work_dir, served)
        #: The replicas' KV block size (a gRPC worker is registered with it), None over HTTP.
        self._kv_block_size = served.block_size if served is not None and settings.grpc else None
        #: Replicas that run, by name, in the order they started; ``memberships``: of each replica that joined,
        #: its workers in the router, kept in step with the models it serves by a thread of its own.
        self.replicas: dict[str, Replica] = {}
        self.memberships: dict[str, Membership] = {}
        self._started = 0

    @property
    def worker_ids(self) -> dict[str, list[str]]:
        """The router's workers of each replica that joined (one per model it serves now)."""
        return {name: list(m.workers.values()) for name, m in self.memberships.items()}

    def workers_listed(self) -> bool:
        """Whether the router lists a worker for every model of every replica that joined (after
        :meth:`restart_router`: once each membership added them all again)."""
        routed = routed_urls(self.router)  # one read of the router for every replica
        return all(m.listed(routed) for m in list(self.memberships.values()))

    def start(self) -> None:
        """The router, then ``replicas`` replicas started together, each added to the router once warm."""
        for folder in (self.work_dir, self.control_dir, self.snapshot_dir, self.request_log_dir):
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            self.router.start()
            starting = [self._launch() for _ in range(self.settings.replicas)]
            for replica in starting:
                self._join(replica)
        except BaseException:
            self.stop()
            raise

    def scale_out(self) -> Replica:
        """One more replica: it restores from the snapshot folder while it starts, and joins once warm."""
        replica = self._launch()
        self._join(replica)
        return replica

    def launch(self, *, restore: bool = True, warm_gate: bool = True,
               model_repository: Path | None = None) -> Replica:
        """One more replica, started but not added to the router (:meth:`join` adds it). ``restore=False``: no
        snapshot folder (it starts from its model_warmup stanzas alone); ``warm_gate=False``: its /health says
        200 as soon as tritonserver is READY (the sidecar does not wait for the planned hot set);
        ``model_repository``: this replica's instead of the fleet's (a repository without stanzas: a cold one)."""
        return self._launch(restore=restore, warm_gate=warm_gate, model_repository=model_repository)

    def join(self, replica: Replica) -> None:
        """Add ``replica`` to the router once its /health says 200; from then on its membership follows the
        models it serves (an adapter made live is added, one retired removed)."""
        self._join(replica)

    def scale_in(self, name: str) -> Departure:
        """Take ``name`` out of the router (no new request goes to it), then SIGTERM: it drains, its
        tritonserver writes its KV snapshot, it exits."""
        return self._leave([name])[0]

    def scale_in_many(self, names: list[str]) -> list[Departure]:
        """:meth:`scale_in` of every one of ``names`` at once (all out of the router, then all SIGTERMed)."""
        return self._leave(list(names))

    def restart_router(self) -> None:
        """Stop the router and start it again on its port, without workers: each replica's membership adds its
        workers again at its next look (``membership_interval_s``)."""
        self.router.stop()
        self.router.start()

    def stop(self) -> None:
        """Every replica (drained as in :meth:`scale_in`, all at once), then the router; nothing is left running."""
        try:
            self._leave(list(self.replicas))
        except ServerError as exc:  # the router already gone: stop the replicas anyway
            LOGGER.warning("fleet stop: %s", exc)
        finally:
            for membership in self.memberships.values():
                membership.stop()
            self.memberships.clear()
            for replica in list(self.replicas.values()):
                replica.stop()
            self.replicas.clear()
            self.router.stop()
            if self._tmp is not None:
                self._tmp.cleanup()
                self._tmp = None

    def _leave(self, names: list[str]) -> list[Departure]:
        """Out of the router, then SIGTERM to every one of ``names`` together, then wait for each."""
        before = {name: self.replicas[name].snapshots() for name in names}
        for name in names:
            membership = self.memberships.pop(name, None)
            if membership is not None:
                membership.stop()  # its workers draining or gone
        for name in names:
            self.replicas[name].process.send(signal.SIGTERM)
        departures = []
        for name in names:
            replica = self.replicas.pop(name)
            clean = replica.stop()
            written = tuple(sorted(f for f, mtime in replica.snapshots().items() if before[name].get(f) != mtime))
            departures.append(Departure(name, clean, written))
        return departures

    # ---------------------------------------------------------------------------------- helpers
    def _new_control_key(self) -> Path:
        """A new control-plane key for this run's router, owner only in the work folder.

        NOTE: over gRPC the replicas run open mode (smg passes no tenant identity to a gRPC worker), but the
        router's worker API must not: whoever reaches its port could add a worker of their own, which would receive
        clients' requests. The fleet's memberships send the key; nothing else has it."""
        self.work_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.work_dir / "router_control.key"
        path.unlink(missing_ok=True)  # one key per run, even in a work folder used before
        read_or_create_secret(path)
        return path

    def _launch(self, restore: bool = True, warm_gate: bool = True, model_repository: Path | None = None) -> Replica:
        self._started += 1
        settings = self.settings
        if model_repository is not None:
            settings = dataclasses.replace(settings, model_repository=model_repository)
        replica = Replica(f"r{self._started}", settings, self.work_dir, self.control_dir,
                          self.snapshot_dir if restore else None, warm_gate=warm_gate,
                          request_log_dir=self.request_log_dir)
        self.replicas[replica.name] = replica
        replica.start()
        return replica

    def _join(self, replica: Replica) -> None:
        replica.wait_warm()
        membership = self.memberships[replica.name] = Membership(
            replica.url, self.router, self.settings.membership_interval_s, replica_key=replica.key,
            protocol=self.settings.worker_protocol, kv_block_size=self._kv_block_size)
        membership.sync()  # NOTE: its workers registered before this returns, as callers expect
        if not membership.workers:
            raise ServerError(f"replica {replica.name} did not join the router (its /health no longer says 200)")
        membership.start()
        LOGGER.info("replica %s joined the router at %s", replica.name, replica.url)

    def __enter__(self) -> "Fleet":
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
