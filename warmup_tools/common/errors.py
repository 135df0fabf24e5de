"""Exception hierarchy of warmup_tools.

Every error the package raises on purpose derives from :class:`WarmupToolsError`, so the CLI can catch
one type and exit non-zero with one clear line.

:class:`RequestError` and its subclasses describe a bad *request*: model.py files turn them into a
per-request ``pb_utils.TritonError`` with the matching code (see :attr:`RequestError.code`), answer that
one request and keep serving the rest.
"""

from __future__ import annotations

from warmup_tools.common.wire import ErrorKind


class WarmupToolsError(Exception):
    """Base class of every error raised on purpose by warmup_tools."""


class ConfigError(WarmupToolsError):
    """A configuration value is missing, unknown or out of range."""


class AssetError(WarmupToolsError):
    """A model, tokenizer or adapter folder is missing or unusable."""


class FileFormatError(WarmupToolsError, ValueError):
    """A file that crosses a process (request log, plan, control file) is unreadable or malformed;
    the message names the file and, where there is one, the line."""


class ServerError(WarmupToolsError):
    """tritonserver could not be started, became unhealthy, or could not be stopped."""


class RequestError(WarmupToolsError):
    """A single request cannot be served; the server keeps serving others.

    ``code`` names the ``pb_utils.TritonError`` code the request is answered with; ``kind`` what it means to a
    client (its message carries it to the front, which maps it to an HTTP status: common/wire.py), the class's
    unless the raise names another.
    """

    code = "INVALID_ARG"
    kind = ErrorKind.INVALID

    def __init__(self, message: str = "", *, kind: ErrorKind | None = None) -> None:
        super().__init__(message)
        if kind is not None:
            self.kind = kind



class KVBudgetError(RequestError):
    """A request (or warm prompt) whose KV can never fit the instance's memory budget (``kv_cache_bytes``)."""

class InvalidInputError(RequestError):
    """An input tensor is missing, empty, of the wrong shape, or holds a value out of range."""

    code = "INVALID_ARG"


#: What a client that named an unknown adapter is told. NOTE: the adapter inventory is not listed: a
#: client learns nothing about other tenants' adapters from an error (the server log has the names).
UNKNOWN_ADAPTER_HINT = ("send the name of an adapter this deployment serves (your operator has the list), or no "
                        "adapter_id for the base model")


class UnknownAdapterError(RequestError):
    """The requested LoRA adapter is not known to this model."""

    code = "NOT_FOUND"
    kind = ErrorKind.NOT_FOUND


class AdapterUnavailableError(RequestError):
    """The adapter is known but is not live (loading, warming, failed or retired); ``UNAVAILABLE`` when the
    instance itself cannot serve it (shutting down)."""

    code = "UNAVAILABLE"
    kind = ErrorKind.NOT_FOUND


class ServerBusyError(RequestError):
    """The instance already holds as many requests as it may queue; the client should retry later."""

    code = "UNAVAILABLE"
    kind = ErrorKind.BUSY


class TenantBusyError(RequestError):
    """The request's tenant already holds its share of the instance (its running slots and its share of the
    queue: ``tenant_queue_share``); the instance still takes other tenants' requests. Triton code UNAVAILABLE
    (its Python backend has no RESOURCE_EXHAUSTED); the kind tells a client it is its own rate limit."""

    code = "UNAVAILABLE"
    kind = ErrorKind.RATE_LIMITED


class RequestCancelledError(RequestError):
    """The client cancelled the request (or went away) before it finished."""

    code = "CANCELLED"
    kind = ErrorKind.CANCELLED
