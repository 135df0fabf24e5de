"""``python -m warmup_tools deploy-secrets``: a deployment's trust-mode files, made once, owner only.

What compose's one-shot ``secrets`` service runs before the stack starts (Kubernetes takes the same files
from a Secret): the deployment secret and the tenant keys file the models read, the probe tenant's key
the sidecar sends, a random Redis password with the URL that carries it, and Redis's own config with that
password. Run again, it keeps every file it finds, so a restart never changes a key.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from warmup_tools.common.files import read_or_create_secret, write_atomic
from warmup_tools.common.records import PROBE_TENANT
from warmup_tools.triton.trust import add_tenant_key


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
    def redis_password(self) -> Path:
        return self.folder / "redis.password"

    @property
    def redis_url(self) -> Path:
        return self.folder / "redis.url"


def make_deployment_secrets(folder: Path, *, redis_host: str = "redis", redis_port: int = 6379,
                            redis_conf_dir: Path | None = None, redis_uid: int | None = None) -> DeploymentSecrets:
    """Create what is missing of a deployment's secrets in ``folder`` (0700, every file 0600)."""
    files = DeploymentSecrets(Path(folder))
    files.folder.mkdir(parents=True, exist_ok=True)
    os.chmod(files.folder, 0o700)
    for tenant, key_file in ((PROBE_TENANT, files.probe_key), ("default", files.load_key)):
        if not key_file.exists():
            # NOTE: the key is shown once and only its hash is kept in the keys file; the sidecar and the load
            # generator need the key itself, so it goes in its own owner-only file.
            write_atomic(key_file, add_tenant_key(files.tenant_keys, files.deployment_secret, tenant) + "\n")
    password = read_or_create_secret(files.redis_password).decode()
    write_atomic(files.redis_url, f"redis://:{password}@{redis_host}:{redis_port}/0\n")
    if redis_conf_dir is not None:
        conf = Path(redis_conf_dir) / "redis.conf"
        write_atomic(conf, f'requirepass {password}\nmaxmemory 1gb\nmaxmemory-policy allkeys-lfu\nsave ""\n'
                           "protected-mode yes\n")
        if redis_uid is not None:  # Redis runs as its own user, which must read its config
            os.chown(conf, redis_uid, redis_uid)
    return files
