"""Prompt embeddings with ONNX Runtime and a tiered exact cache, for the ``embedding_cache`` model.

Local tier: bounded by bytes, its eviction policy chosen by ``eviction`` (LFU with time decay by default);
optional shared tier: Redis. Keys hold the tenant and
the embedding model's fingerprint.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging

import numpy as np

from warmup_tools.caches.redis_tier import SharedTier, checked_decoder, encode_array
from warmup_tools.caches.store import LocalCache
from warmup_tools.caches.tiered import CacheSource, TieredCache
from warmup_tools.common.digests import fingerprint_file, text_digest
from warmup_tools.common.errors import AssetError
from warmup_tools.embedding_cache.settings import EmbedderConfig

LOGGER = logging.getLogger(__name__)


def cuda_device_count() -> int:
    """Number of CUDA devices the driver reports; 0 when there is no driver (no torch needed)."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if libcuda.cuInit(0) != 0 or libcuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return int(count.value)


def choose_providers(requested: str = "auto") -> list[str]:
    """ONNX Runtime providers: CUDA first when both the build and the machine have it, else the CPU.

    NOTE: onnxruntime-gpu lists CUDAExecutionProvider even on machines without a GPU, and asking for it
    there prints a wall of errors; we ask only when a device exists.
    """
    import onnxruntime as ort

    if requested != "auto":
        return [p.strip() for p in requested.split(",") if p.strip()]
    available = ort.get_available_providers()
    if "CUDAExecutionProvider" in available and cuda_device_count() > 0:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


@dataclasses.dataclass(frozen=True, slots=True)
class EmbeddingResult:
    """``vector`` is None when the text missed the cache and was not sampled for computing."""

    vector: np.ndarray | None
    #: local, shared, computed, or skipped (a miss that was not sampled)
    source: CacheSource


class OnnxEmbedder:
    """Sentence embeddings (mean-pooled, L2-normalised inside the graph) with an exact cache."""

    def __init__(self, config: EmbedderConfig, *, shared: SharedTier | None = None) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        self.config = config
        model_dir, num_threads = config.model_dir, config.num_threads
        model_path = model_dir / "model.onnx"
        if not model_path.exists():
            raise AssetError(
                f"{model_path} does not exist; build the demo assets with `python -m warmup_tools assets` "
                "or point embedder_path at a folder holding model.onnx and tokenizer.json"
            )
        meta = json.loads((model_dir / "config.json").read_text()) if (model_dir / "config.json").exists() else {}
        self.dim = int(meta.get("dim", 384))
        self.max_length = int(meta.get("max_length", 256))
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.tokenizer.enable_truncation(self.max_length)
        self.tokenizer.enable_padding()
        options = ort.SessionOptions()
        options.log_severity_level = 3
        if num_threads > 0:
            options.intra_op_num_threads = num_threads
            options.inter_op_num_threads = 1
        self.providers = choose_providers(config.providers)
        self.session = ort.InferenceSession(str(model_path), options, providers=self.providers)
        self._input_names = {i.name for i in self.session.get_inputs()}
        self.fingerprint = fingerprint_file(model_path)[:16]
        self.local: LocalCache[tuple, np.ndarray] = LocalCache(config.cache_bytes, config.eviction, config.policy)
        self.cache: TieredCache[np.ndarray] = TieredCache(
            self.local, shared, kind="emb", fingerprint=self.fingerprint, encode=encode_array,
            decode=checked_decoder("float32", length=self.dim, finite=True))

    def lookup(self, text: str, tenant: str = "default") -> EmbeddingResult:
        """The cached embedding of ``text`` (local, then shared tier), or a MISS with no vector."""
        vector, source = self.cache.get(tenant, text_digest(text))
        return EmbeddingResult(vector, source if vector is not None else CacheSource.MISS)

    def compute(self, text: str, tenant: str = "default") -> np.ndarray:
        """Embed ``text`` and cache it (read-only, shared by every later hit); with a shared tier, one
        instance embeds a text at a time while the others wait for its vector (``redis_lock_wait_ms``)."""
        return self.cache.get_or_compute(tenant, text_digest(text), lambda: self._embed_one(text))[0]

    def _embed_one(self, text: str) -> np.ndarray:
        vector = self.embed_batch([text])[0]
        vector.setflags(write=False)
        return vector

    def embed(self, text: str, tenant: str = "default") -> np.ndarray:
        """The embedding of one text, from the cache or computed (always)."""
        cached = self.lookup(text, tenant)
        return cached.vector if cached.vector is not None else self.compute(text, tenant)

    def embed_batch(self, texts: list[str]) -> np.ndarray:
        """Embeddings of many texts, computed (no cache), shape ``[len(texts), dim]``."""
        encodings = self.tokenizer.encode_batch(texts)
        feeds = {
            "input_ids": np.asarray([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.asarray([e.attention_mask for e in encodings], dtype=np.int64),
            "token_type_ids": np.asarray([e.type_ids for e in encodings], dtype=np.int64),
        }
        (out,) = self.session.run(["embedding"], {k: v for k, v in feeds.items() if k in self._input_names})
        return np.ascontiguousarray(out, dtype=np.float32)
