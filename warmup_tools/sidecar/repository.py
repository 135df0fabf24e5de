"""Triton's model-repository API (HTTP), as the sidecar uses it: reload one model, read the index."""

from __future__ import annotations

import time
from typing import Any

from warmup_tools.common.errors import ServerError
from warmup_tools.server.process import RepositoryKey


class RepositoryClient:
    """``POST /v2/repository/...`` with the per-run key header that ``--http-restricted-api`` demands."""

    def __init__(self, http_url: str, key: RepositoryKey | None, timeout_s: float = 300.0) -> None:
        import requests

        self.base = f"http://{http_url}/v2/repository"
        self.timeout_s = timeout_s
        self._headers = key.http_headers() if key else {}
        self._session = requests.Session()

    def index(self) -> dict[str, str]:
        """``{model: state}`` for every model in the repository (``READY``, ``UNAVAILABLE``, ``LOADING``...)."""
        entries = self._post("index", timeout_s=10.0)
        return {e["name"]: e.get("state", "") for e in entries or [] if "name" in e}

    def reload(self, model: str, timeout_s: float | None = None) -> None:
        """Unload ``model``, wait until it is gone, load it again (its model_warmup samples run again).

        NOTE: in explicit mode a load of a model that is already loaded is a no-op, even when its stub
        is dead (checked on 2.51), so a repair must unload first.
        """
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        self._post(f"models/{model}/unload", timeout_s=_left(deadline))
        # NOTE: unload returns before the model's instances have finalized; a load issued meanwhile
        # could find the old version still there. Wait until the index no longer says READY.
        while self.index().get(model) == "READY":
            if time.monotonic() > deadline:
                raise ServerError(f"{model} still READY after unload")
            time.sleep(0.2)
        self._post(f"models/{model}/load", timeout_s=_left(deadline))

    def unload(self, model: str, timeout_s: float | None = None) -> bool:
        """Unload ``model`` and wait until its instances have finalized (the index no longer says READY or
        UNLOADING): whether that happened within ``timeout_s``."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        self._post(f"models/{model}/unload", timeout_s=_left(deadline))
        while self.index().get(model) in ("READY", "UNLOADING"):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def ensure_loaded(self, model: str, timeout_s: float | None = None) -> bool:
        """Load ``model`` if the index does not say READY (an ensemble unloaded with a composing model).
        Returns whether a load was needed."""
        if self.index().get(model) == "READY":
            return False
        self._post(f"models/{model}/load", timeout_s=timeout_s or self.timeout_s)
        return True

    def close(self) -> None:
        self._session.close()

    # ------------------------------------------------------------------------------------- helpers
    def _post(self, path: str, timeout_s: float) -> Any:
        import requests

        try:
            response = self._session.post(f"{self.base}/{path}", headers=self._headers, json={},
                                          timeout=timeout_s)
        except requests.RequestException as exc:
            raise ServerError(f"repository API {path}: {exc}") from exc
        if response.status_code != 200:
            raise ServerError(f"repository API {path}: HTTP {response.status_code} {response.text[:500]}")
        return response.json() if response.content else None


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise ServerError("repository call ran past its deadline")
    return left
