"""A replica's membership in the smg router, kept up to date: one worker per model the replica serves while its
``/health`` says warm, none once it leaves.

One loop serves the local fleet (a thread per replica), compose (``python -m warmup_tools join``, a service
per replica) and Kubernetes (a ``join`` container in each replica pod)::

    router = RouterClient("http://router:30000", 5, control_key=router_key)   # trust mode: the router's key
    membership = Membership("http://127.0.0.1:9000", router, interval_s=5, replica_key=probe_key)
    membership.start()   # or run() in this thread until stop() (SIGTERM)
    ...
    membership.stop()    # every worker deregistered (draining or gone), then the loop returns

Every ``interval_s`` it reads the replica's ``/v1/models`` (the base model and each live adapter; in trust mode
with ``replica_key``, a tenant key: the deployment's probe tenant's) and the router's ``GET /workers``, then:

- adds a worker ``<replica>/m/<model>`` for a model served and not registered (an adapter made live later; a
  router that restarted and lost every worker), only while the replica's ``/health`` says 200;
- removes the worker of a model no longer served (a retired adapter), whatever ``/health`` says.

It never removes a worker because ``/health`` fails: smg's own health checks take a replica that stops being
warm out of rotation, and put it back once it is warm again.

With ``protocol="grpc"`` (``worker_protocol`` grpc) the models and their workers come from the front's
``GET /grpc-workers`` instead: one smg engine listener per live model, each registered as the worker
``grpc://<worker_host>:<port>`` with the replicas' ``kv_block_size``; smg reads the listener's model from it.

``worker_host`` (either protocol): where the router reaches the replica when that is not ``replica_url``'s host
(a Kubernetes pod's ``join`` reads its front on localhost; the router dials the pod's IP).
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.parse
import urllib.request

from warmup_tools.common.errors import ServerError
from warmup_tools.fleet.replica import http_status, served_models
from warmup_tools.fleet.router import GRPC_SCHEME, RouterClient
from warmup_tools.fleet.settings import WORKER_PROTOCOLS

LOGGER = logging.getLogger(__name__)

#: The longest wait between two looks while the replica has not joined yet (it joins soon after it is warm), and after a
#: look the router did not answer.
_JOINING_POLL_S = 1.0


class Membership:
    """The router's workers of one replica (``replica_url``: its OpenAI front), kept in step with what it serves."""

    def __init__(self, replica_url: str, router: RouterClient, interval_s: float, *,
                 replica_key: str | None = None, protocol: str = "http", worker_host: str | None = None,
                 kv_block_size: int | None = None) -> None:
        """``protocol`` grpc: the front's gRPC listeners are the workers, at ``worker_host`` (default: the host of
        ``replica_url``), registered with ``kv_block_size`` (the replicas' KV block size)."""
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if protocol not in WORKER_PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(WORKER_PROTOCOLS)}, got {protocol!r}")
        if protocol == "grpc" and (kv_block_size is None or kv_block_size < 1):
            raise ValueError("a gRPC membership needs the replicas' kv_block_size (>= 1)")
        self.replica_url = replica_url.rstrip("/")
        self.router = router
        self.replica_key = replica_key
        self.interval_s = interval_s
        self.protocol = protocol
        split = urllib.parse.urlsplit(self.replica_url)
        self.worker_host = worker_host or split.hostname or "127.0.0.1"
        #: The front as the router reaches it: ``replica_url`` at ``worker_host`` when one is given (a ``join``
        #: beside the front reads it on localhost; the router, in another pod, dials the pod's address).
        self._front_url = self.replica_url if worker_host is None else urllib.parse.urlunsplit(
            split._replace(netloc=f"{_bracketed(worker_host)}:{split.port}" if split.port else _bracketed(worker_host)))
        self.kv_block_size = kv_block_size
        #: gRPC: each model's listener port, as the front listed it last.
        self._ports: dict[str, int] = {}
        self._workers: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._running = False

    @property
    def workers(self) -> dict[str, str]:
        """Its workers now: model -> the router's worker id."""
        with self._lock:
            return dict(self._workers)

    def worker_url(self, model: str) -> str:
        """The router's worker of ``model`` on this replica: its front's ``/m/<model>``, or (gRPC) its listener."""
        if self.protocol == "grpc":
            return f"{GRPC_SCHEME}{_bracketed(self.worker_host)}:{self._ports[model]}"
        return f"{self._front_url}/m/{model}"

    def served(self) -> list[str]:
        """The models the replica serves now: its ``/v1/models``, or (gRPC) the models with a listener on its
        ``/grpc-workers`` (their ports remembered for :meth:`worker_url`). Raises what the call raises."""
        if self.protocol == "grpc":
            ports = grpc_workers(self.replica_url, self.replica_key)
            with self._lock:
                self._ports.update(ports)
            return list(ports)
        return served_models(self.replica_url, self.replica_key)

    def sync(self) -> None:
        """One look: workers added for the models served (when warm), removed for the models no longer served.

        ServerError when the router does not answer or does not take a change (the next look tries again)."""
        warm = http_status(f"{self.replica_url}/health") == 200
        try:
            models = self.served()
        except urllib.error.HTTPError as exc:
            if exc.code == 401:  # NOTE: a front in trust mode lists its models to a tenant key only
                raise ServerError(f"{self.replica_url}/v1/models answers 401: the replica runs trust mode and takes "
                                  "the probe tenant's key from the deployment's secrets (join --secrets-dir)") from None
            if warm:
                raise ServerError(f"{self.replica_url}{self._listing}: {exc}") from None
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:  # the front does not answer (yet)
            if warm:
                raise ServerError(f"{self.replica_url}{self._listing}: {exc}") from None
            return
        listed = {str(w.get("id")): w for w in self.router.workers()}
        by_url = {str(w.get("url")): worker_id for worker_id, w in listed.items() if w.get("status") != "draining"}
        with self._lock:
            mine = dict(self._workers)
        for model, worker_id in mine.items():
            if model not in models:
                if worker_id in listed:
                    self.router.remove(worker_id)
                LOGGER.info("%s: model %s no longer served; its worker removed", self.replica_url, model)
                self._forget(model)
            elif worker_id not in listed:  # the router restarted (or someone removed it): added again below
                LOGGER.warning("%s: the router no longer lists the worker of %s", self.replica_url, model)
                self._forget(model)
            elif self.protocol == "grpc" and str(listed[worker_id].get("url")) != self.worker_url(model):
                # NOTE: a front that restarted may list the model on another port: the old worker is gone
                self.router.remove(worker_id)
                LOGGER.info("%s: the listener of model %s moved; its worker replaced", self.replica_url, model)
                self._forget(model)
        for model in models:
            if self._stopping.is_set():
                return
            if model in self.workers:
                continue
            url = self.worker_url(model)
            if url in by_url:  # NOTE: registered by an earlier run of this loop (a join container that restarted)
                self._remember(model, by_url[url])
            elif warm:
                self._remember(model, self.router.add(url, model, kv_block_size=self.kv_block_size))
                LOGGER.info("%s: worker added for model %s", self.replica_url, model)

    def listed(self, routed: set[str] | None = None) -> bool:
        """Whether the router lists a worker (not draining) for every model the replica serves now (a router that
        restarted: once this loop added them all again). ``routed``: the URLs of the router's workers that are not
        draining, when the caller read them already (:func:`routed_urls`). ServerError when the router does not
        answer."""
        try:
            models = self.served()
        except (OSError, ValueError, KeyError, TypeError):
            return False
        urls = routed_urls(self.router) if routed is None else routed
        return bool(models) and all(self.worker_url(model) in urls for model in models)

    def run(self) -> None:
        """Look every ``interval_s`` until :meth:`stop`, then leave the router (:meth:`leave`)."""
        self._running = True
        try:
            while not self._stopping.is_set():
                failed = False
                try:
                    self.sync()
                except ServerError as exc:
                    LOGGER.warning("%s: %s", self.replica_url, exc)
                    failed = True
                # NOTE: a router that does not answer (restarting) is looked at again soon, so that the workers are
                # back within a second of it answering, not at the next interval.
                wait = self.interval_s if self.workers and not failed else min(self.interval_s, _JOINING_POLL_S)
                self._stopping.wait(wait)
        finally:
            self.leave()
            self._running = False

    def start(self) -> None:
        """:meth:`run` in a thread of its own."""
        self._thread = threading.Thread(target=self.run, name=f"membership {self.replica_url}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop and leave the router. From another thread than :meth:`run`'s, returns once it left; from
        its own (a signal handler), :meth:`run` leaves and returns soon after."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        elif not self._running:  # no loop (never started, or :meth:`sync` called alone): leave here
            self.leave()

    def leave(self) -> None:
        """Deregister every worker of the replica and wait until the router lists each draining or gone: no new
        request is routed to the replica after this returns (unless the router does not answer: logged)."""
        mine = self.workers
        if not mine:
            return
        try:
            listed = {str(w.get("id")) for w in self.router.workers()}
        except ServerError as exc:
            LOGGER.warning("%s: cannot leave the router: %s", self.replica_url, exc)
            return
        for model, worker_id in mine.items():
            try:
                if worker_id in listed:
                    self.router.remove(worker_id)
                self._forget(model)
            except ServerError as exc:
                LOGGER.warning("%s: worker of %s not removed: %s", self.replica_url, model, exc)
        LOGGER.info("%s left the router", self.replica_url)

    # ---------------------------------------------------------------------------------- helpers
    @property
    def _listing(self) -> str:
        return "/grpc-workers" if self.protocol == "grpc" else "/v1/models"

    def _remember(self, model: str, worker_id: str) -> None:
        with self._lock:
            self._workers[model] = worker_id

    def _forget(self, model: str) -> None:
        with self._lock:
            self._workers.pop(model, None)

    def __repr__(self) -> str:
        return f"Membership({self.replica_url!r}, workers={self.workers!r})"


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def grpc_workers(front_url: str, key: str | None = None) -> dict[str, int]:
    """The front's smg engine listeners now (``GET /grpc-workers``): model -> port, for each live model with a
    listener. ValueError on an answer that is not that list."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(f"{front_url}/grpc-workers", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as response:
        workers = json.load(response)["workers"]
    ports: dict[str, int] = {}
    for worker in workers:
        model, port = worker["model"], worker["port"]
        if not isinstance(model, str) or not model or isinstance(port, bool) or not isinstance(port, int) \
                or not 0 < port < 65536:
            raise ValueError(f"/grpc-workers lists a worker that is not a model and a port: {worker!r:.200}")
        ports[model] = port
    return ports


def routed_urls(router: RouterClient) -> set[str]:
    """The URLs of the router's workers that take new requests (not draining)."""
    return {str(w.get("url")) for w in router.workers() if w.get("status") != "draining"}

