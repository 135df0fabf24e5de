"""``python -m warmup_tools deploy-secrets``: a deployment's trust-mode files, made once, owner only.

What compose's one-shot ``secrets`` service runs before the stack starts (Kubernetes takes the same files
from a Secret): the deployment secret and the tenant keys file the models read, the probe tenant's key
the sidecar sends (the ``join`` processes also read the replicas' ``/v1/models`` with it), the router's
control-plane key (smg's worker API answers 401 without it; only the router and ``join`` read it), a random
Redis password with the URL that carries it, and Redis's own config with that password. Run again, it keeps
every file it finds, so a restart never changes a key.

The files' names, and the variables that point a replica at them, are in
:class:`~warmup_tools.common.deployment.DeploymentSecrets`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from warmup_tools.common.deployment import DeploymentSecrets
from warmup_tools.common.files import read_or_create_secret, write_atomic
from warmup_tools.common.records import PROBE_TENANT
from warmup_tools.common.settings import arg
from warmup_tools.triton.trust import add_tenant_key


def make_deployment_secrets(
        folder: Path, *, redis_host: Annotated[str, arg("the host name in the Redis URL the models read")] = "redis",
        redis_port: Annotated[int, arg("the port in that URL")] = 6379,
        redis_conf_dir: Annotated[Path | None, arg("also write Redis's redis.conf (requirepass) here")] = None,
        redis_uid: Annotated[int | None, arg("owner of redis.conf (the Redis image's user)")] = None,
) -> DeploymentSecrets:
    """Create what is missing of a deployment's secrets in ``folder`` (0700, every file 0600)."""
    files = DeploymentSecrets(Path(folder))
    files.folder.mkdir(parents=True, exist_ok=True)
    os.chmod(files.folder, 0o700)
    for tenant, key_file in ((PROBE_TENANT, files.probe_key), ("default", files.load_key)):
        if not key_file.exists():
            # NOTE: the key is shown once and only its hash is kept in the keys file; the sidecar and the load
            # generator need the key itself, so it goes in its own owner-only file.
            write_atomic(key_file, add_tenant_key(files.tenant_keys, files.deployment_secret, tenant) + "\n")
    read_or_create_secret(files.router_key)
    password = read_or_create_secret(files.redis_password).decode()
    write_atomic(files.redis_url, f"redis://:{password}@{redis_host}:{redis_port}/0\n")
    if redis_conf_dir is not None:
        conf = Path(redis_conf_dir) / "redis.conf"
        write_atomic(conf, f'requirepass {password}\nmaxmemory 1gb\nmaxmemory-policy allkeys-lfu\nsave ""\n'
                           "protected-mode yes\n")
        if redis_uid is not None:  # Redis runs as its own user, which must read its config
            os.chown(conf, redis_uid, redis_uid)
    return files
