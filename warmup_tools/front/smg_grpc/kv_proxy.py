"""``SubscribeKvEvents`` relayed from the lora_adapter instance's own event server.

Each lora_adapter instance serves ``VllmEngine.SubscribeKvEvents`` on a unix socket ``<kv_events_dir>/<instance>.sock``
(a private folder the sidecar makes); the scope of a subscription (which model's blocks, whose tenant) travels as
request metadata (:data:`OWNER_KEY`, :data:`TENANT_KEY`). The instance implements smg's whole contract (headers at
once, OUT_OF_RANGE before headers outside its replay window, a state snapshot from 0); the relay keeps it: it sends
its own headers to smg only once the instance sent its own, so a refusal before headers reaches smg before headers
(smg then clears its index and resubscribes from 0), relays every batch as it is, and ends with the instance's status.

NOTE: one instance per replica: events carry no instance, and a router keeps one index per worker URL, so the
blocks of several instances behind one URL would read as one cache. With several sockets the relay answers
UNIMPLEMENTED (smg then routes that worker on its approximate tree) and logs why.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc

LOGGER = logging.getLogger(__name__)

#: Request metadata naming a subscription's scope: the adapter ("" for the base model) and the tenant.
OWNER_KEY = "warmup-kv-owner"
TENANT_KEY = "warmup-kv-tenant"
#: smg gives up on a subscription without headers after 2 s: the instance's headers are awaited this long.
HEADERS_TIMEOUT_S = 1.5
#: Subscriptions relayed at once (a router subscribes once per model and worker URL).
MAX_SUBSCRIPTIONS = 64
_TERMINAL = (grpc.StatusCode.OK,)


class KvEventsProxy:
    """Relays subscriptions to the one event socket in ``folder`` (None: no events, UNIMPLEMENTED)."""

    def __init__(self, folder: Path | None, tenant: str = "default") -> None:
        self.folder = folder
        self.tenant = tenant
        self.active = 0
        self._logged_many = False

    def socket(self) -> tuple[Path | None, grpc.StatusCode, str]:
        """The instance's socket, or the status and message a subscriber gets instead."""
        if self.folder is None:
            return None, grpc.StatusCode.UNIMPLEMENTED, "this replica publishes no KV events"
        try:
            sockets = sorted(path for path in self.folder.glob("*.sock") if path.is_socket())
        except OSError:
            sockets = []
        if not sockets:
            return None, grpc.StatusCode.UNAVAILABLE, "the replica's KV event stream is not up yet; retry"
        if len(sockets) > 1:
            if not self._logged_many:
                self._logged_many = True
                LOGGER.warning("%d lora_adapter instances publish KV events in %s: event routing needs one instance "
                               "per replica (instance_group count 1); SubscribeKvEvents answers UNIMPLEMENTED",
                               len(sockets), self.folder)
            return None, grpc.StatusCode.UNIMPLEMENTED, "KV events need one lora_adapter instance per replica"
        return sockets[0], grpc.StatusCode.OK, ""

    async def relay(self, request: common_pb2.SubscribeKvEventsRequest, context: Any, owner: str) -> None:
        """Serve one subscription of ``owner``'s blocks (an adapter, "" for the base model) from the instance."""
        path, code, message = self.socket()
        if path is None:
            await context.abort(code, message)
            return
        if self.active >= MAX_SUBSCRIPTIONS:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this replica relays at most {MAX_SUBSCRIPTIONS} KV event subscriptions")
            return
        self.active += 1
        channel = grpc.aio.insecure_channel(f"unix://{path}")
        call = None
        try:
            call = vllm_engine_pb2_grpc.VllmEngineStub(channel).SubscribeKvEvents(
                request, metadata=((OWNER_KEY, owner), (TENANT_KEY, self.tenant)))
            try:
                await asyncio.wait_for(call.initial_metadata(), HEADERS_TIMEOUT_S)
            except asyncio.TimeoutError:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the replica's KV event stream did not answer")
                return
            if call.done():  # NOTE: it ended before its headers (OUT_OF_RANGE outside the window): the same to smg
                status = await call.code()
                if status not in _TERMINAL:
                    await context.abort(status, await call.details() or "")
                    return
            await context.send_initial_metadata(())
            try:
                async for batch in call:
                    await context.write(batch)
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "")
                return
            status = await call.code()
            if status not in _TERMINAL:
                await context.abort(status, await call.details() or "")
        finally:
            self.active -= 1
            if call is not None and not call.done():
                call.cancel()
            await channel.close()
