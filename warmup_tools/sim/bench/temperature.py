"""``python -m warmup_tools bench temperature``: what the sidecar reads of a demo replica, per probe round,
from a cold start, after its warm-up, while a new adapter loads and warms, and after its KV cache is
lost (the ``lora_adapter`` stub killed and reloaded): the lowest warm coverage of any live adapter, the
``lora_adapter`` probe's time to first token (a one-token generation), and the temperature it gives.
The defaults of ``hot_coverage`` and ``hot_probe_ttft_s`` are chosen from these figures (docs/sidecar.md).
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any, Callable, TextIO

from warmup_tools.common.settings import arg
from warmup_tools.control.registry import ControlRegistry
from warmup_tools.demo.prompts import SYSTEM_PROMPTS
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.server.process import RepositoryKey, TritonServer
from warmup_tools.sidecar.app import Sidecar
from warmup_tools.sidecar.config import SidecarConfig

#: The adapter the run adds (a copy of the demo's ``legal``), with its system prompt as the warm prompt.
NEW_ADAPTER = "claims"


def run(assets_dir: Path, *, probe_interval_s: Annotated[float, arg("the sidecar's probe_interval_s")] = 1.0,
        rounds: Annotated[int, arg("probe rounds read in each steady phase")] = 15, out: TextIO = sys.stdout) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-temperature-"))
    try:
        assets = work / "assets"
        assets.mkdir()
        for name in ("lm", "embedder"):
            (assets / name).symlink_to((assets_dir / name).resolve())
        shutil.copytree(assets_dir / "adapters", assets / "adapters")
        control = work / "control"
        env = {"WARMUP_ASSETS_DIR": str(assets), "WARMUP_CONTROL_DIR": str(control), "WARMUP_REDIS_URL": "",
               "WARMUP_REQUEST_LOG_DIR": ""}
        server = TritonServer(REPO_ROOT / "model_repository", env=env, work_dir=work / "triton",
                              explicit_model_control=True, repository_key=RepositoryKey.generate())
        config = SidecarConfig(probe_interval_s=probe_interval_s, probe_timeout_s=10.0, port=0)
        with server, Sidecar(config, server.http_url, server.grpc_url, server.repository_key,
                             REPO_ROOT / "model_repository", control_dir=control) as sidecar:
            watch = _Watch(sidecar, out)
            watch.until("cold start, until ready", lambda s: s["ready"], deadline_s=900)
            watch.rounds(f"after warm-up ({rounds} rounds)", rounds)
            shutil.copytree(assets / "adapters" / "legal", assets / "adapters" / NEW_ADAPTER)
            ControlRegistry(control).add(NEW_ADAPTER, [SYSTEM_PROMPTS["legal"]])
            watch.until(f"new adapter {NEW_ADAPTER}, until live", lambda s: _live(s, NEW_ADAPTER), deadline_s=600)
            watch.rounds(f"after {NEW_ADAPTER} went live ({rounds} rounds)", rounds)
            stubs = server.stub_pids("lora_adapter")
            os.kill(stubs[0], signal.SIGKILL)
            watch.until("KV cache lost (lora_adapter stub killed), until not ready", lambda s: not s["ready"],
                        deadline_s=120)
            watch.until("reload, until ready", lambda s: s["ready"], deadline_s=900)
            watch.rounds(f"after the reload ({rounds} rounds)", rounds)
            # NOTE: the adapter added at run time is not in the repository's configuration: after the reload
            # its instance no longer serves it, and it is retired so the folder is left as it was found.
            ControlRegistry(control).retire(NEW_ADAPTER)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _live(status: dict[str, Any], adapter: str) -> bool:
    instances = dict(status["coverage"].get("instances") or {}).values()
    return bool(instances) and all(adapter in e["adapters"] and e["adapters"][adapter]["live"] for e in instances)


class _Watch:
    """Reads the sidecar's status once per probe round and prints each phase's figures."""

    def __init__(self, sidecar: Sidecar, out: TextIO) -> None:
        self.sidecar, self.out = sidecar, out
        self._round = -1

    def until(self, phase: str, done: Callable[[dict[str, Any]], bool], deadline_s: float) -> None:
        rows, end = [], time.monotonic() + deadline_s
        while time.monotonic() < end:
            status = self._next()
            rows.append(_row(status))
            if done(status):
                break
        self._print(phase, rows)

    def rounds(self, phase: str, count: int) -> None:
        self._print(phase, [_row(self._next()) for _ in range(count)])

    def _next(self) -> dict[str, Any]:
        """The status after the next probe round."""
        while True:
            status = self.sidecar.monitor.snapshot()
            if status["rounds"] != self._round:
                self._round = status["rounds"]
                return status
            time.sleep(0.05)

    def _print(self, phase: str, rows: list[tuple[bool, float | None, float | None, str]]) -> None:
        ttfts = [t for _, _, t, _ in rows if t is not None]
        shares = [c for _, c, _, _ in rows if c is not None]
        states = " ".join(s[0].upper() for *_, s in rows)
        self.out.write(
            f"{phase}: {len(rows)} rounds, ready in {sum(r for r, *_ in rows)}; lowest coverage "
            f"{'-' if not shares else f'{min(shares):.0%}..{max(shares):.0%}'}; lora_adapter probe TTFT ms "
            + (f"p50 {statistics.median(ttfts) * 1000:.0f}, max {max(ttfts) * 1000:.0f} ({len(ttfts)} passing)"
               if ttfts else "none passing")
            + f"\n  per round: {' '.join('-' if t is None else f'{t * 1000:.0f}' for *_, t, _ in rows)}"
            f"\n  coverage:  {' '.join('-' if c is None else f'{c:.2f}' for _, c, _, _ in rows)}"
            f"\n  temperature (C/W/H): {states}\n")
        self.out.flush()


def _row(status: dict[str, Any]) -> tuple[bool, float | None, float | None, str]:
    probe = status["models"].get("lora_adapter", {}).get("last_probe") or {}
    ttft = probe["latency_ms"] / 1000 if probe.get("ok") else None
    shares = [cov["coverage"] for entry in dict(status["coverage"].get("instances") or {}).values()
              if not entry["stale"] for cov in entry["adapters"].values() if cov["live"]]
    return bool(status["ready"]), min(shares) if shares else None, ttft, status["temperature"]["replica"]["state"]
