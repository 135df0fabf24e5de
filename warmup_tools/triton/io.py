"""Request I/O between Triton's Python backend (``triton_python_backend_utils``) and this package.

The functions take the ``pb_utils`` module as an argument, because it only exists inside a Python
backend stub; that keeps this module importable, and testable, anywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from warmup_tools.common.errors import RequestError
from warmup_tools.triton.params import ModelParameters


def redis_tier_from_params(params: ModelParameters) -> Any:
    """The Redis shared tier a model's ``redis_*`` parameters describe, or None when ``redis_url`` is empty."""
    from warmup_tools.caches.settings import SharedTierSettings

    settings = SharedTierSettings.from_parameters(params)
    if not settings.url:
        return None
    from warmup_tools.caches.redis_tier import SharedTier
    from warmup_tools.triton.trust import TenantTrust

    # Trust mode: values carry a MAC under a key derived from the deployment secret, and keys are salted.
    trust = TenantTrust.from_parameters(params)
    return SharedTier(settings, mac_key=trust.derived_key(b"redis-mac"), salt=trust.cache_salt())


def model_parameters(args: Mapping[str, Any]) -> ModelParameters:
    """The ``parameters`` of the model being initialised; relative paths resolve against its folder."""
    return ModelParameters(json.loads(args["model_config"]), base_dir=Path(args["model_repository"]))


def collect_inputs(pb_utils: Any, request: Any, names: Iterable[str]) -> dict[str, np.ndarray | None]:
    """``{name: numpy array}`` for each named input of ``request``; None for an absent optional input."""
    inputs: dict[str, np.ndarray | None] = {}
    for name in names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        inputs[name] = None if tensor is None else tensor.as_numpy()
    return inputs


def error_for(pb_utils: Any, exc: BaseException) -> Any:
    """A ``pb_utils.TritonError`` for an exception: the request's own code, INTERNAL for anything else."""
    if isinstance(exc, RequestError):
        code = getattr(pb_utils.TritonError, exc.code, pb_utils.TritonError.INVALID_ARG)
        return pb_utils.TritonError(str(exc), code)
    # NOTE: no exception text, type or path reaches the client; log_unexpected puts them in the server log.
    return pb_utils.TritonError("internal error while serving this request; it was not completed (the server "
                                "log has the details): retry, and report it if it persists",
                                pb_utils.TritonError.INTERNAL)


def error_response(pb_utils: Any, exc: BaseException) -> Any:
    return pb_utils.InferenceResponse(error=error_for(pb_utils, exc))


def log_unexpected(pb_utils: Any, model: str, exc: BaseException) -> None:
    """Log an exception that is not a request error (a bug or an infrastructure fault)."""
    if not isinstance(exc, RequestError):
        pb_utils.Logger.log_error(f"{model}: unexpected {type(exc).__name__}: {exc}")
