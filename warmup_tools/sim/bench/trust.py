"""``python -m warmup_tools bench trust``: what one tenant can learn about another's prompts in trust mode.

One run against the real server in trust mode (a deployment secret and tenant keys in a temporary
folder): tenant ``acme`` sends ``prompts`` distinct prompts; then tenant ``globex``, with its own key,
sends the same prompts (probes) and as many prompts nobody sent (never seen), interleaved in a seeded
order, ``max_tokens=1``. Printed: ``cached_tokens`` of the probes (0 when the KV cache is keyed by
tenant) and the time to first token of probes and never-seen prompts (median, spread). Alike figures
mean the cache gives the prober nothing to tell them apart; the integration test
``tests/integration/test_trust.py`` checks the ``cached_tokens``.
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Annotated, TextIO

from warmup_tools.common.errors import ConfigError
from warmup_tools.common.settings import arg
from warmup_tools.server.client import GenerateParams, GenerateResult, StreamingClient
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.server.process import TritonServer
from warmup_tools.sim.bench.support.params import Seed
from warmup_tools.triton.trust import add_tenant_key

_WORDS = ("invoice refund outage dashboard login password billing region revenue order customer product clause "
          "contract supplier warranty renewal quarterly report export table index latency timeout error").split()


def memo(rng: random.Random) -> str:
    """A prompt of about 100 words (several KV blocks), distinct for each draw."""
    return "Internal memo. " + " ".join(rng.choice(_WORDS) for _ in range(90)) + "\nSummarise it."


def run(assets_dir: Path, *, prompts: Annotated[int, arg("prompts of each kind (at least 2)")] = 50,
        seed: Seed = 7, out: TextIO = sys.stdout) -> None:
    if prompts < 2:
        raise ConfigError(f"--prompts must be at least 2 (a spread needs two figures), got {prompts}")
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="bench-trust-") as folder:
        keys, secret = Path(folder) / "tenant_keys.json", Path(folder) / "deployment.secret"
        acme_key, globex_key = (add_tenant_key(keys, secret, tenant) for tenant in ("acme", "globex"))
        env = {"WARMUP_ASSETS_DIR": str(assets_dir), "WARMUP_CONTROL_DIR": "",
               "WARMUP_DEPLOYMENT_SECRET_FILE": str(secret), "WARMUP_TENANT_KEYS_FILE": str(keys)}
        acme = GenerateParams(max_tokens=1, tenant_id="acme", tenant_key=acme_key)
        globex = GenerateParams(max_tokens=1, tenant_id="globex", tenant_key=globex_key)
        with TritonServer(REPO_ROOT / "model_repository", env=env, work_dir=Path(folder) / "triton") as server:
            server.wait_ready(timeout=1800)
            with StreamingClient(server.grpc_url) as client:
                secrets_of_acme = [memo(rng) for _ in range(prompts)]
                for prompt in secrets_of_acme:
                    client.generate(prompt, acme)
                own = client.generate(secrets_of_acme[0], acme)
                # NOTE: probes and never-seen prompts interleaved in a seeded order, so that whatever drifts
                # during the run (other load, the caches filling) weighs on both kinds alike.
                sends = [(True, prompt) for prompt in secrets_of_acme] + [(False, memo(rng)) for _ in range(prompts)]
                rng.shuffle(sends)
                probes, fresh = [], []
                for is_probe, prompt in sends:
                    (probes if is_probe else fresh).append(client.generate(prompt, globex))
    out.write(f"trust mode, {prompts} prompts of tenant acme (acme's own repeat: {own.cached_tokens} of "
              f"{own.prompt_tokens} prompt tokens cached)\n\n"
              "| tenant globex sends | requests | cached_tokens > 0 | TTFT median ms | TTFT stdev ms |\n"
              "|---|---|---|---|---|\n")
    for label, results in (("acme's prompts (probes)", probes), ("prompts nobody sent", fresh)):
        out.write(f"| {label} | {len(results)} | {sum(r.cached_tokens > 0 for r in results)} | "
                  f"{_ms(results, statistics.median)} | {_ms(results, statistics.stdev)} |\n")


def _ms(results: list[GenerateResult], figure) -> str:
    return f"{figure([r.ttft_s * 1000 for r in results]):.1f}"
