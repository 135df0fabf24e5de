"""``python -m warmup_tools bench caches``: what the tokenizer and embedding caches cost and save.

One run prints: tokenisation and embedding latency on hit and miss (p50/p99, in process), hit ratios
on a Zipf-distributed prompt set, the local vs Redis tier latency, and, on the real server, how much
the ensemble's tokenizer and embedding steps add over calling ``lora_adapter`` directly with warm caches.
"""

from __future__ import annotations

import queue
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Annotated, Callable, TextIO

import numpy as np

from warmup_tools.common.settings import arg
from warmup_tools.embedding_cache.settings import EmbedderConfig
from warmup_tools.server.client import GenerateParams, StreamingClient
from warmup_tools.server.config import REPO_ROOT
from warmup_tools.server.process import TritonServer
from warmup_tools.sim.bench.support.servers import local_redis
from warmup_tools.sim.bench.support.tables import percentiles
from warmup_tools.sim.bench.support.text import make_text
from warmup_tools.tokenizer_cache.settings import TokenizerConfig


def timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def zipf_prompts(tokenizer: object, *, distinct: int, requests: int, s: float, rng: random.Random) -> list[str]:
    """``requests`` prompts drawn with Zipf(s) popularity from ``distinct`` templates plus a user part
    that repeats for the popular ones (so exact caches can hit)."""
    bases = [make_text(tokenizer, rng.randint(64, 256), rng) for _ in range(distinct)]
    weights = [1.0 / (rank + 1) ** s for rank in range(distinct)]
    return [rng.choices(bases, weights)[0] for _ in range(requests)]


def run(assets_dir: Path, *, n: Annotated[int, arg("texts looked up per cache", flag="requests")] = 300,
        out: TextIO = sys.stdout) -> None:
    from transformers import AutoTokenizer

    from warmup_tools.embedding_cache.embedder import OnnxEmbedder
    from warmup_tools.tokenizer_cache.service import TokenizerService

    rng = random.Random(0)
    tok = AutoTokenizer.from_pretrained(assets_dir / "lm")
    texts = [make_text(tok, 300, rng) for _ in range(n)]
    rows: list[tuple[str, str, float, float]] = []

    service = TokenizerService(TokenizerConfig(assets_dir / "lm"))
    it = iter(texts)
    rows.append(("tokenizer", "miss", *percentiles(timed(lambda: service.encode(next(it)), n))))
    it = iter(texts)
    rows.append(("tokenizer", "hit", *percentiles(timed(lambda: service.encode(next(it)), n))))

    embedder = OnnxEmbedder(EmbedderConfig(assets_dir / "embedder", num_threads=1))
    m = max(30, n // 5)
    it = iter(texts[:m])
    rows.append(("embedding", "miss", *percentiles(timed(lambda: embedder.embed(next(it)), m))))
    it = iter(texts[:m])
    rows.append(("embedding", "hit", *percentiles(timed(lambda: embedder.embed(next(it)), m))))

    out.write("\nIn-process latency (300-token prompts):\n\n| cache | lookup | p50 ms | p99 ms |\n|---|---|---|---|\n")
    for name, kind, p50, p99 in rows:
        out.write(f"| {name} | {kind} | {p50:.3f} | {p99:.3f} |\n")

    prompts = zipf_prompts(tok, distinct=2000, requests=5000, s=1.1, rng=rng)
    zipf = TokenizerService(TokenizerConfig(assets_dir / "lm", cache_bytes=256 << 10))
    for p in prompts:
        zipf.encode(p)
    emb = OnnxEmbedder(EmbedderConfig(assets_dir / "embedder", cache_bytes=256 << 10, num_threads=1))
    emb_prompts = prompts[:1500]
    for p in emb_prompts:
        emb.embed(p)
    out.write(f"\nHit ratios on Zipf(1.1) prompts (2,000 distinct, 256 KiB local budget each): tokenizer "
              f"{zipf.local.stats.hit_ratio:.3f} over {len(prompts)} requests (SLRU), embedding "
              f"{emb.local.stats.hit_ratio:.3f} over {len(emb_prompts)} requests (decayed LFU)\n")
    out.flush()
    _tier_latency(out)
    _ensemble_overhead(assets_dir, tok, rng, out)


def _tier_latency(out: TextIO) -> None:
    from warmup_tools.caches.redis_tier import SharedTier, decode_array, encode_array
    from warmup_tools.caches.settings import SharedTierSettings
    from warmup_tools.caches.store import LocalCache
    from warmup_tools.caches.tiered import TieredCache

    with local_redis() as url:
        if url is None:
            out.write("\nLocal vs Redis tier: skipped (redis-server not installed)\n")
            return
        tier = SharedTier(SharedTierSettings(url=url, timeout_ms=50))
        writer = TieredCache(LocalCache(64 << 20, "slru"), tier, kind="tok", fingerprint="bench",
                             encode=encode_array, decode=decode_array)
        reader = TieredCache(LocalCache(64 << 20, "slru"), tier, kind="tok", fingerprint="bench",
                             encode=encode_array, decode=decode_array)
        ids = np.arange(300, dtype=np.int32)
        keys = [uuid.uuid4().bytes for _ in range(500)]
        for key in keys:
            writer.put("t", key, ids)
        local = [timed(lambda k=k: writer.get("t", k), 1)[0] for k in keys]
        shared = [timed(lambda k=k: reader.get("t", k), 1)[0] for k in keys]  # first read: from Redis
        lp, lq = percentiles(local)
        sp, sq = percentiles(shared)
        out.write(f"\nLocal vs Redis tier (300 token ids): local hit p50 {lp:.4f} ms / p99 {lq:.4f} ms; "
                  f"Redis hit p50 {sp:.3f} ms / p99 {sq:.3f} ms\n")
        tier.close()


def _ensemble_overhead(assets_dir: Path, tok: object, rng: random.Random, out: TextIO) -> None:
    import tritonclient.grpc as grpcclient

    env = {"WARMUP_ASSETS_DIR": str(assets_dir), "WARMUP_CONTROL_DIR": ""}
    prompts = [make_text(tok, 300, rng) for _ in range(20)]
    with TritonServer(REPO_ROOT / "model_repository", env=env) as server:
        server.wait_ready(timeout=600)
        params = GenerateParams(max_tokens=1)
        responses: queue.Queue = queue.Queue()
        direct = grpcclient.InferenceServerClient(server.grpc_url)
        direct.start_stream(callback=lambda result, error: responses.put((result, error)))

        def lora(ids: list[int]) -> float:
            tensor = grpcclient.InferInput("input_ids", [len(ids)], "INT32")
            tensor.set_data_from_numpy(np.asarray(ids, dtype=np.int32))
            limit = grpcclient.InferInput("max_tokens", [1], "INT32")
            limit.set_data_from_numpy(np.array([1], dtype=np.int32))
            start = time.perf_counter()
            direct.async_stream_infer("lora_adapter", [tensor, limit])
            _, error = responses.get(timeout=120)
            if error is not None:
                raise error
            return time.perf_counter() - start

        with StreamingClient(server.grpc_url) as client:
            for p in prompts:  # warm every cache: tokenizer, embedding (sampled), KV
                for _ in range(3):
                    client.generate(p, params)
            ens, raw = [], []
            for _ in range(5):
                for p in prompts:
                    ens.append(client.generate(p, params).ttft_s)
                    raw.append(lora(tok.encode(p)))
        direct.stop_stream()
        direct.close()
    ep, eq = percentiles(ens)
    rp, rq = percentiles(raw)
    out.write(f"\nEnsemble vs lora_adapter directly, warm caches, 300-token prompts, max_tokens=1, "
              f"{len(ens)} requests each: ensemble TTFT p50 {ep:.2f} ms (p99 {eq:.2f}); lora_adapter p50 "
              f"{rp:.2f} ms (p99 {rq:.2f}); the tokenizer and embedding steps add {ep - rp:.2f} ms at p50\n")

