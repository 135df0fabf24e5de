"""The files of a deployment's trust mode, as ``python -m warmup_tools deploy-secrets`` lays them out in one folder.

One definition for every consumer: the replicas (through :meth:`DeploymentSecrets.replica_environment`), the
router (its control-plane key), the ``join`` processes (the router's key, and the probe tenant's key to read a
replica's ``/v1/models``), ``warmup_tools fleet`` in trust mode, and tests/unit/test_deploy.py, which checks that
compose and the Kubernetes manifests mount and name the same files.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from warmup_tools.common.errors import ConfigError

#: Where compose and the Kubernetes manifests mount the folder.
MOUNT = Path("/run/warmup")


@dataclasses.dataclass(frozen=True, slots=True)
class DeploymentSecrets:
    """Where the files are (their names are what compose and the k8s Secret mount)."""

    folder: Path

    @property
    def deployment_secret(self) -> Path:
        return self.folder / "deployment.secret"

    @property
    def tenant_keys(self) -> Path:
        return self.folder / "tenant_keys.json"

    @property
    def probe_key(self) -> Path:
        return self.folder / "probe_tenant.key"

    @property
    def load_key(self) -> Path:
        """The key of tenant ``default``, for the load generator."""
        return self.folder / "load_tenant.key"

    @property
    def router_key(self) -> Path:
        """The router's control-plane key: smg's worker API (``/workers``) takes it as a bearer key."""
        return self.folder / "router_control.key"

    @property
    def redis_password(self) -> Path:
        return self.folder / "redis.password"

    @property
    def redis_url(self) -> Path:
        return self.folder / "redis.url"

    def replica_environment(self, *, redis: bool = True) -> dict[str, str]:
        """The variables that put a replica (its models, its sidecar, its front) in trust mode with these files;
        ``redis``: also the shared tier's URL file."""
        env = {"WARMUP_DEPLOYMENT_SECRET_FILE": str(self.deployment_secret),
               "WARMUP_TENANT_KEYS_FILE": str(self.tenant_keys),
               "WARMUP_PROBE_TENANT_KEY_FILE": str(self.probe_key)}
        if redis:
            env["WARMUP_REDIS_URL_FILE"] = str(self.redis_url)
        return env

    def read_key(self, path: Path) -> str:
        """One of the key files here (the probe tenant's, the router's), as text; ConfigError naming it when it
        is missing or unreadable."""
        try:
            key = Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"{path} is not readable ({exc.strerror or type(exc).__name__}): make it with "
                              "`python -m warmup_tools deploy-secrets --dir " + str(self.folder) + "`") from None
        if not key:
            raise ConfigError(f"{path} is empty")
        return key
