"""One ``lora_adapter`` instance's KV events served as smg's ``VllmEngine.SubscribeKvEvents`` on a unix socket.

The instance process holds the cache, so it answers the stream itself (:class:`KvEventServer`, a gRPC server on
``unix:<kv_events_dir>/<instance>.sock``; every other method of the service is UNIMPLEMENTED). The replica's gRPC
worker listeners (:mod:`warmup_tools.front.smg_grpc`) relay it to the router, one scope per listener, named in the
call's metadata: ``warmup-kv-owner`` (the adapter, empty for the base model) and ``warmup-kv-tenant`` (the tenant
the listener's requests run as; ``default``).

No network port: the socket lives in a folder only the replica's own user can enter (the sidecar makes it 0700),
and the stream carries token ids of cached prompts.

The contract (:mod:`warmup_tools.smg_worker.kv_wire`): headers at once (smg vetoes a worker whose stream is silent
for 2 s), ``OUT_OF_RANGE`` before them for a number outside the replay window (smg then clears the worker and
resubscribes from 0), a state snapshot from 0, then one batch per event until the subscriber leaves.
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures
from pathlib import Path
from typing import Iterator

import grpc
from smg_grpc_proto.generated import common_pb2

from warmup_tools.common.errors import InvalidInputError
from warmup_tools.kv.events import KvEventJournal
from warmup_tools.smg_worker.kv_wire import KvEventStream, OutOfWindow, StateFn, StreamScope
from warmup_tools.triton.inputs import check_identity

LOGGER = logging.getLogger(__name__)

SERVICE = "vllm.grpc.engine.VllmEngine"
METHOD = "SubscribeKvEvents"
OWNER_KEY = "warmup-kv-owner"
TENANT_KEY = "warmup-kv-tenant"
#: Subscribers one instance serves at once (the replica's listeners: one per model); one more waits for a thread.
MAX_SUBSCRIBERS = 32
#: The longest unix socket path (``sun_path`` is 108 bytes on Linux, with its terminating zero).
MAX_SOCKET_PATH = 107


def socket_path(folder: Path, instance: str) -> Path:
    """Where ``instance`` serves its events in ``folder`` (ValueError when the path is too long for a socket)."""
    path = Path(folder) / f"{instance}.sock"
    if len(str(path).encode()) > MAX_SOCKET_PATH:
        raise ValueError(f"the KV event socket {path} is longer than {MAX_SOCKET_PATH} bytes: give kv_events_dir a "
                         "shorter folder")
    return path


def scope_of(metadata: tuple[tuple[str, str | bytes], ...] | None) -> StreamScope:
    """The stream's scope from the call's metadata; InvalidInputError for a malformed name."""
    values = {k: v for k, v in (metadata or ()) if k in (OWNER_KEY, TENANT_KEY) and isinstance(v, str)}
    owner, tenant = values.get(OWNER_KEY, ""), values.get(TENANT_KEY, "default")
    if owner:
        check_identity(OWNER_KEY, owner)
    check_identity(TENANT_KEY, tenant)
    return StreamScope(owner=owner, tenant=tenant)


class KvEventServer:
    """``SubscribeKvEvents`` over ``journal`` (and ``state``, the cache's full state) on a unix socket."""

    def __init__(self, journal: KvEventJournal, state: StateFn, block_size: int, path: Path, *,
                 poll_s: float = 0.5) -> None:
        self.journal = journal
        self.state = state
        self.block_size = block_size
        self.path = Path(path)
        self.poll_s = poll_s
        self._stopped = threading.Event()
        self._server: grpc.Server | None = None

    def start(self) -> None:
        self.path.unlink(missing_ok=True)  # NOTE: a socket left by a process that died; the folder is ours
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=MAX_SUBSCRIBERS, thread_name_prefix="kv-events"))
        handler = grpc.unary_stream_rpc_method_handler(
            self._subscribe, request_deserializer=common_pb2.SubscribeKvEventsRequest.FromString,
            response_serializer=common_pb2.KvEventBatch.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler}),))
        if not server.add_insecure_port(f"unix:{self.path}"):
            raise OSError(f"cannot serve KV events on {self.path}")
        server.start()
        self._server = server
        LOGGER.info("KV events served on %s", self.path)

    def stop(self) -> None:
        self._stopped.set()
        self.journal.wake()
        if self._server is not None:
            self._server.stop(grace=1.0).wait(5.0)
            self._server = None
        self.path.unlink(missing_ok=True)

    def _subscribe(self, request: common_pb2.SubscribeKvEventsRequest,
                   context: grpc.ServicerContext) -> Iterator[common_pb2.KvEventBatch]:
        try:
            scope = scope_of(context.invocation_metadata())
        except InvalidInputError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        stream = KvEventStream(self.journal, self.state, scope, self.block_size, int(request.start_sequence_number))
        try:
            stream.open()
        except OutOfWindow as exc:
            context.abort(grpc.StatusCode.OUT_OF_RANGE, str(exc))  # NOTE: before headers: smg resubscribes from 0
        context.send_initial_metadata(())
        try:
            yield from stream.batches(lambda: self._stopped.is_set() or not context.is_active(), self.poll_s)
        except OutOfWindow as exc:
            # NOTE: after headers OUT_OF_RANGE would be retried with the same number; DATA_LOSS makes smg start over.
            context.abort(grpc.StatusCode.DATA_LOSS, str(exc))
