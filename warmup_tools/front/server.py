"""The front as a server: uvicorn on its own thread and event loop, started and stopped by its owner
(``python -m warmup_tools front``, the ``sidecar`` and ``serve`` commands, the tests and benchmarks)."""

from __future__ import annotations

import dataclasses
import logging
import resource
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Mapping

import uvicorn
import uvloop

from warmup_tools.common.errors import ConfigError, ServerError
from warmup_tools.common.settings import read_settings
from warmup_tools.common.tracing import Tracer
from warmup_tools.front.admission import tenant_bound
from warmup_tools.front.app import build_app
from warmup_tools.front.chat_template import ChatRenderer, ChatTemplateError
from warmup_tools.front.drain import Drain
from warmup_tools.front.engine.triton_engine import TritonEngine
from warmup_tools.front.http import bounded_httptools
from warmup_tools.front.settings import FrontSettings
from warmup_tools.front.smg_grpc.listeners import GrpcWorkers, replica_facts
from warmup_tools.kv.config import KVCacheConfig
from warmup_tools.lora_adapter.settings import SchedulerConfig
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.tokenizer_cache.settings import TokenizerConfig
from warmup_tools.triton.params import repository_parameters
from warmup_tools.triton.trust import TrustSettings

LOGGER = logging.getLogger(__name__)


def with_repository(settings: FrontSettings, environ: Mapping[str, str] | None = None) -> tuple[FrontSettings, int]:
    """``settings`` completed from the model repository tritonserver serves (``${VAR}`` from ``environ``): the
    tokenizer (``tokenizer_path``, else tokenizer_cache's), the tenant keys file (else tokenizer_cache's: trust
    mode on the models is trust mode on the front), the bound per tenant (else lora_adapter's share of one tenant);
    and lora_adapter's KV budget per instance."""
    repository = settings.model_repository or REPO_ROOT / "model_repository"
    first = repository_parameters(repository, "tokenizer_cache", environ)
    tokenizer = settings.tokenizer_path or read_settings(TokenizerConfig, first).path
    keys = settings.tenant_keys_file or read_settings(TrustSettings, first).tenant_keys_file
    kv = read_settings(KVCacheConfig, repository_parameters(repository, "lora_adapter", environ))
    scheduler = read_settings(SchedulerConfig, repository_parameters(repository, "lora_adapter", environ))
    bound = tenant_bound(settings.tenant_max_in_flight, scheduler)
    return dataclasses.replace(settings, tokenizer_path=Path(tokenizer), tenant_keys_file=keys,
                               tenant_max_in_flight=bound), kv.budget_bytes


def build_engine(settings: FrontSettings, kv_capacity_bytes: int | None) -> TritonEngine:
    return TritonEngine(settings.triton_grpc_url, settings.triton_metrics_url, sidecar_url=settings.sidecar_url,
                        pipeline=settings.pipeline, kv_capacity_bytes=kv_capacity_bytes,
                        timeout_s=settings.request_timeout_s, poll_interval_s=settings.poll_interval_s,
                        tracer=Tracer.from_environment("front"))


def load_renderer(tokenizer: Path) -> ChatRenderer | None:
    try:
        return ChatRenderer.from_path(tokenizer)
    except ChatTemplateError as exc:
        LOGGER.warning("%s; /v1/chat/completions answers 400", exc)
        return None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"the LM tokenizer {tokenizer} does not load: {exc}") from None


#: Open files the process needs beside the front's connections (gRPC, HTTP clients, logs, the models' files).
FILES_BESIDE_CONNECTIONS = 256


def fit_open_files(max_connections: int) -> int:
    """Raise this process's soft limit on open files (up to its hard limit) to hold ``max_connections`` and
    :data:`FILES_BESIDE_CONNECTIONS`: below it, accepting a connection fails before the bound is reached, and
    such a connection waits in the listen backlog with no answer. Returns the soft limit; a warning when the
    hard limit is too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + FILES_BESIDE_CONNECTIONS
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return soft
    raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if raised > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    if raised < wanted:
        LOGGER.warning("the limit on open files (%d) is below max_connections (%d) and the %d files the process "
                       "needs beside them: lower max_connections or raise the limit (ulimit -n)", raised,
                       max_connections, FILES_BESIDE_CONNECTIONS)
    return raised


class FrontServer:
    """uvicorn serving the front on a thread of its own::

        with FrontServer(FrontSettings(port=0, triton_grpc_url=server.grpc_url, ...)) as front:
            ...  # front.url + "/v1/chat/completions"
    """

    def __init__(self, settings: FrontSettings, engine: object | None = None,
                 renderer: ChatRenderer | None = None, environ: Mapping[str, str] | None = None) -> None:
        """Without ``engine``: the Triton engine, the chat template and the trust mode of the repository
        (``${VAR}`` in its configs from ``environ``, default this process's environment)."""
        self.settings = settings
        if engine is None:
            settings, kv_bytes = with_repository(settings, environ)
            assert settings.tokenizer_path is not None
            engine = build_engine(settings, kv_bytes)
            renderer = load_renderer(settings.tokenizer_path)
        self.settings = settings
        self._drain = Drain()
        workers = GrpcWorkers(settings, replica_facts(settings, environ)) if settings.grpc_worker_port else None
        app = build_app(settings, engine, renderer, self._drain, workers)  # type: ignore[arg-type]
        #: The application (its ``state.front``: what the front holds now).
        self.app = app
        # NOTE: uvloop and httptools, uvicorn's fast event loop and HTTP parser: each saves the front CPU on every
        # request (docs/benchmarks.md, "The OpenAI front"); grpc.aio runs on uvloop.
        # NOTE: no limit_concurrency: uvicorn checks it only once a head is whole, so a connection beyond it would
        # hold its descriptor until its head arrived; the protocol refuses such connections as they are made.
        config = uvicorn.Config(app, host=settings.host, port=settings.port, http=bounded_httptools(settings),
                                loop="uvloop", lifespan="on", log_level="warning", access_log=False,
                                timeout_keep_alive=settings.keep_alive_s, timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def port(self) -> int:
        servers = getattr(self._server, "servers", None) or []
        for server in servers:
            for sock in server.sockets:
                return int(sock.getsockname()[1])
        return self.settings.port

    @property
    def url(self) -> str:
        host = self.settings.host if self.settings.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        fit_open_files(self.settings.max_connections)
        self._thread = threading.Thread(target=self._run, name="openai-front", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._error is not None or not self._thread.is_alive():
                raise ServerError(f"the OpenAI front did not start on {self.settings.host}:{self.settings.port}: "
                                  f"{self._error or 'uvicorn exited'}")
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(f"the OpenAI front did not start within {timeout_s:g} s")
            time.sleep(0.02)

    def _run(self) -> None:
        try:
            uvloop.run(self._server.serve())
        except BaseException as exc:  # noqa: BLE001 (reported by start(), or logged once running)
            self._error = exc
            LOGGER.error("the OpenAI front stopped: %s", exc)

    def drain(self, stop: threading.Event | None = None) -> int:
        """Leave without losing a request (SIGTERM): /health fails, new requests are refused after
        ``drain_grace_s`` (``stop`` cuts the grace short), those in flight get up to ``drain_timeout_s``. Returns
        how many were still in flight at the end (0: none lost)."""
        return self._drain.run(self.settings.drain_grace_s, self.settings.drain_timeout_s, stop)

    @property
    def in_flight_at_drain(self) -> int | None:
        """Requests in flight when :meth:`drain` began (None before)."""
        return self._drain.in_flight_at_start

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout_s)
        self._thread = None

    def __enter__(self) -> "FrontServer":
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
