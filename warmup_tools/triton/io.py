"""Request I/O between Triton's Python backend (``triton_python_backend_utils``) and this package.

The functions take the ``pb_utils`` module as an argument, because it only exists inside a Python
backend stub; that keeps this module importable, and testable, anywhere.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from warmup_tools.caches.settings import SharedTierSettings
from warmup_tools.common.errors import ConfigError, InvalidInputError, RequestError
from warmup_tools.common.records import RecordError, parse_role_spans
from warmup_tools.common.wire import ErrorKind, tag
from warmup_tools.triton.params import ModelParameters
from warmup_tools.triton.trust import TenantTrust


def shared_tier(settings: SharedTierSettings, trust: TenantTrust, *, model: str) -> Any:
    """The Redis shared tier ``settings`` describe (the URL from ``redis_url`` or the file ``redis_url_file``
    names), or None when there is none."""
    url = settings.url or _read_url(settings.url_file, model)
    if not url:
        return None
    from warmup_tools.caches.redis_tier import SharedTier

    # Values carry a MAC and keys are salted, under keys derived from the deployment secret (trust mode) or,
    # in open mode, from a random value made once per deployment in the control folder.
    if not trust.trusted:
        if settings.control_dir is None:
            raise ConfigError(f"model '{model}': a shared tier (redis_url) in open mode needs control_dir, where "
                              "the deployment's random Redis key salt is kept; set it, or use trust mode "
                              "(deployment_secret_file)")
        trust = TenantTrust(open_mode_seed(settings.control_dir))
    return SharedTier(dataclasses.replace(settings, url=url), mac_key=trust.derived_key(b"redis-mac"),
                      salt=trust.cache_salt())


def _read_url(path: Path | None, model: str) -> str:
    """The URL in the file ``redis_url_file`` names (a mounted secret: the password stays out of the
    environment and the config); empty when unset."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as file:
            return file.read(4096).decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"model '{model}': redis_url_file {path} is not readable ({exc})") from None


#: In the control folder: the random value open mode derives its Redis MAC key and key salt from.
OPEN_MODE_SEED_FILE = "deployment.salt"


def open_mode_seed(control_dir: Path) -> bytes:
    """The deployment's random seed (``<control_dir>/deployment.salt``, 0600), made by the first instance.

    NOTE: every instance and replica reads the same folder, so they agree on Redis keys; another deployment
    has another folder, so its keys and MACs differ, and a reader of Redis without the folder can neither
    test which prompts are cached nor write a value an instance accepts. It is not tenant isolation: open
    mode's tenants are whatever clients say.
    """
    from warmup_tools.common.files import read_or_create_secret

    try:
        return read_or_create_secret(Path(control_dir) / OPEN_MODE_SEED_FILE)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"the open-mode Redis key salt in {control_dir} is not usable ({exc})") from None


def model_parameters(args: Mapping[str, Any]) -> ModelParameters:
    """The ``parameters`` of the model being initialised; relative paths resolve against its folder."""
    return ModelParameters(json.loads(args["model_config"]), base_dir=Path(args["model_repository"]))


def collect_inputs(pb_utils: Any, request: Any, names: Iterable[str]) -> dict[str, np.ndarray | None]:
    """``{name: numpy array}`` for each named input of ``request``; None for an absent optional input.

    NOTE: ``request.inputs()`` is read once (``pb_utils.get_input_tensor_by_name`` builds that list again
    for every name it is asked for); ``pb_utils`` stays a parameter so every model calls it the same way.
    """
    present = {tensor.name(): tensor for tensor in request.inputs()}
    return {name: present[name].as_numpy() if name in present else None for name in names}


def chat_roles(request: Any) -> tuple[tuple[str, int, int], ...] | None:
    """The ``chat_roles`` request parameter (a rendered conversation's role spans, from the OpenAI front);
    None when absent. A malformed one is the request's error (InvalidInputError)."""
    try:
        parameters = json.loads(request.parameters() or "{}")
    except ValueError:
        return None
    value = parameters.get("chat_roles") if isinstance(parameters, dict) else None
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidInputError("request parameter 'chat_roles' must be a JSON string")
    try:
        return parse_role_spans(value)
    except RecordError as exc:
        raise InvalidInputError(f"request parameter {exc}") from None


def error_for(pb_utils: Any, exc: BaseException) -> Any:
    """A ``pb_utils.TritonError`` for an exception: the request's own code, INTERNAL for anything else; the
    message starts with the error's kind (``[not_found] unknown adapter ...``: common/wire.py), which the
    front maps to an HTTP status."""
    if isinstance(exc, RequestError):
        code = getattr(pb_utils.TritonError, exc.code, pb_utils.TritonError.INVALID_ARG)
        return pb_utils.TritonError(tag(exc.kind, str(exc)), code)
    # NOTE: no exception text, type or path reaches the client; log_unexpected puts them in the server log.
    return pb_utils.TritonError(tag(ErrorKind.INTERNAL, INTERNAL_ERROR), pb_utils.TritonError.INTERNAL)


#: What a client is told of a fault that is not the request's.
INTERNAL_ERROR = ("internal error while serving this request; it was not completed (the server log has the "
                  "details): retry, and report it if it persists")


def error_response(pb_utils: Any, exc: BaseException) -> Any:
    return pb_utils.InferenceResponse(error=error_for(pb_utils, exc))


def log_unexpected(pb_utils: Any, model: str, exc: BaseException) -> None:
    """Log an exception that is not a request error (a bug or an infrastructure fault)."""
    if not isinstance(exc, RequestError):
        pb_utils.Logger.log_error(f"{model}: unexpected {type(exc).__name__}: {exc}")
