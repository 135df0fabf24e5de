"""Fit an engine profile to the real engine on this machine: time its forward (``--forward``: packed, the default,
or hf) through the scheduler's :class:`~warmup_tools.lora_adapter.engine_api.SequenceEngine` protocol, solve for the
coefficients (:mod:`warmup_tools.lora_adapter.profile`) by least squares, write the profile.

``python -m warmup_tools profile-fit --out PROFILE.json`` times prefill batches (prompt sizes,
chunks after a context, several rows) and decode batches (1 to 16 rows at several contexts) of the demo LM
and its adapters, each the median of ``--repeats`` runs after one unrecorded run, with ``--threads`` torch
threads (1: what ``lora_adapter`` runs with here), and fits the prefill and the decode coefficients each on
its own steps. The profile records how well they fit (``fit``: relative residuals per point).
"""

from __future__ import annotations

import dataclasses
import datetime
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Annotated, Callable, Sequence

import numpy as np

from warmup_tools.common.errors import WarmupToolsError
from warmup_tools.common.settings import arg
from warmup_tools.kv.config import DEFAULT_BUDGET_BYTES
from warmup_tools.lora_adapter.engine_api import ForwardRow, SequenceEngine
from warmup_tools.lora_adapter.profile import DecodeCost, EngineProfile, PrefillCost, StepShape
from warmup_tools.lora_adapter.requests import GenerateRequest, SamplingParams
from warmup_tools.lora_adapter.settings import ENGINE_FORWARDS

#: Prefill steps timed: each a list of rows ``(new_tokens, position)``.
PREFILL_BATCHES: tuple[tuple[tuple[int, int], ...], ...] = (
    ((16, 0),), ((64, 0),), ((128, 0),), ((256, 0),), ((512, 0),), ((1024, 0),),
    ((64, 256),), ((64, 1024),), ((256, 768),), ((128, 1536),), ((32, 1900),),
    ((64, 0),) * 4, ((128, 0),) * 2, ((32, 512),) * 4, ((16, 256),) * 8,
)
# NOTE: rows of one step share their past's length here: HfEngine pads a batch to its longest past and its
# longest row, a cost of that engine the profile leaves out (a 256-token prompt beside a 16-token chunk after
# 1,024 tokens took 230 ms here, the sum of the two alone about 85 ms).
#: Decode steps timed: ``(rows, context)``.
DECODE_BATCHES: tuple[tuple[int, int], ...] = tuple((rows, context) for rows in (1, 2, 4, 8, 16)
                                                    for context in (64, 512, 1536))


@dataclasses.dataclass(frozen=True, slots=True)
class FitReport:
    """How well the fitted coefficients reproduce the measured steps."""

    points: int
    rms_rel_error: float
    max_rel_error: float
    #: ``(shape, measured_ms, modelled_ms)`` per point.
    residuals: tuple[tuple[StepShape, float, float], ...]


def fit_prefill(samples: Sequence[tuple[StepShape, float]]) -> tuple[PrefillCost, FitReport]:
    """``overhead_ms``, ``ms_per_row``, ``ms_per_token``, ``ms_per_token_context`` from prefill-only steps'
    milliseconds."""
    coef, report = _fit(samples, lambda s: (1.0, s.prefill_rows - 1, s.prefill_tokens, s.prefill_context_k))
    return PrefillCost(*coef), report


def fit_decode(samples: Sequence[tuple[StepShape, float]]) -> tuple[DecodeCost, FitReport]:
    """``base_ms``, ``ms_per_row``, ``ms_per_1k_context_tokens`` from decode-only steps' milliseconds."""
    coef, report = _fit(samples, lambda s: (1.0, s.decode_rows, s.decode_context_k))
    return DecodeCost(*coef), report


def measure(engine: SequenceEngine, *, repeats: int = 7, seed: int = 0,
            clock: Callable[[], float] = time.perf_counter) -> tuple[list[tuple[StepShape, float]],
                                                                     list[tuple[StepShape, float]]]:
    """Median milliseconds of :data:`PREFILL_BATCHES` (each run from the same past) and :data:`DECODE_BATCHES`
    (consecutive steps of the same rows) through the engine's :class:`SequenceEngine` protocol, as the scheduler
    drives it: whichever forward ``engine`` is (packed, Hugging Face, simulated). Each row is a sequence of its
    own whose past is computed by an untimed forward first; only the step measured is timed."""
    rng = random.Random(seed)
    names: list[str | None] = sorted(engine.adapters) or [None]
    ids = [rng.randrange(3, engine.vocab_size) for _ in range(engine.context_length)]
    seq_ids = iter(range(-1, -(1 << 30), -1))  # NOTE: negative, so never a scheduler's sequence of this engine
    request = GenerateRequest(tuple(ids[:1]), None, "default", False, SamplingParams(max_tokens=1))

    def opened(batch: Sequence[tuple[int, int]]) -> list[ForwardRow]:
        """One new sequence per row holding ``position`` tokens of KV (computed untimed); the rows of the step."""
        rows = []
        for i, (new, position) in enumerate(batch):
            seq, adapter = next(seq_ids), names[i % len(names)]
            engine.open(seq, request, sampled=False)
            engine.load_prefix(seq, None)
            if position:
                engine.forward([ForwardRow(seq, ids[:position], 0, adapter)])
            rows.append(ForwardRow(seq, ids[position:position + new], position, adapter))
        return rows

    def closed(rows: Sequence[ForwardRow]) -> None:
        for row in rows:
            engine.close(row.seq_id)
        engine.forget_batches()

    prefill = []
    for batch in PREFILL_BATCHES:
        runs = []
        for attempt in range(repeats + 1):
            rows = opened(batch)
            engine.forget_batches()
            started = clock()
            engine.forward(rows)
            if attempt:  # the first run is not recorded (allocations, an adapter's first use)
                runs.append((clock() - started) * 1000.0)
            closed(rows)
        prefill.append((StepShape.of(batch), statistics.median(runs)))
    decode = []
    for count, context in DECODE_BATCHES:
        # NOTE: steady decoding, as the scheduler runs it: each step continues the same rows by one token.
        rows = opened([(1, context)] * count)
        runs = []
        for step in range(repeats + 1):
            started = clock()
            engine.forward(rows)
            if step:
                runs.append((clock() - started) * 1000.0)
            rows = [ForwardRow(row.seq_id, ids[row.position + 1:row.position + 2], row.position + 1, row.adapter)
                    for row in rows]
        closed(rows)
        decode.append((StepShape.of([(1, context + repeats // 2)] * count), statistics.median(runs)))
    return prefill, decode


def fit_profile(assets: Path, *, name: Annotated[str, arg("the profile's name")] = "cpu-demo-lm",
                hardware: Annotated[str, arg("the machine, in words (empty: the CPU's or the GPU's name)")] = "",
                threads: Annotated[int, arg("torch CPU threads (lora_adapter runs with 1 here)", ge=1)] = 1,
                repeats: Annotated[int, arg("timed runs per step (their median is kept)", ge=1)] = 7,
                device: Annotated[str, arg("the engine's device: auto (the first CUDA device, else CPU), cpu, cuda, "
                                           "cuda:1")] = "auto",
                dtype: Annotated[str, arg("auto (bfloat16 on a GPU, float32 on the CPU), float32, float16, "
                                          "bfloat16")] = "auto",
                forward: Annotated[str, arg("the real engine's forward timed (lora_adapter's engine_forward)",
                                            choices=ENGINE_FORWARDS)] = "packed") -> EngineProfile:
    """Time the real engine's ``forward`` on the demo LM in ``assets`` through the scheduler's protocol and return the
    fitted profile."""
    import torch

    from warmup_tools.kv.config import KVCacheConfig
    from warmup_tools.lora_adapter.engines import make_engine
    from warmup_tools.lora_adapter.settings import EngineConfig

    torch.set_num_threads(threads)
    engine = make_engine(EngineConfig(base_model=assets / "lm", adapter_root=assets / "adapters", device=device,
                                      dtype=dtype, num_threads=threads, forward=forward,
                                      kv=KVCacheConfig(budget_bytes=0)))
    gpu = engine.device.type == "cuda"
    prefill_samples, decode_samples = measure(engine, repeats=repeats, clock=_clock(engine.device))
    prefill, prefill_report = fit_prefill(prefill_samples)
    decode, decode_report = fit_decode(decode_samples)
    kv_bytes = int(engine.kv_bytes_per_token)
    dtype_name = str(engine.dtype).removeprefix("torch.")
    hardware = hardware or (f"{torch.cuda.get_device_name(engine.device)}, {dtype_name}" if gpu else _cpu_name())
    fit = {"command": f"python -m warmup_tools profile-fit --threads {threads} --repeats {repeats}"
                      + (f" --device {device} --dtype {dtype}" if (device, dtype) != ("auto", "auto") else "")
                      + (f" --forward {forward}" if forward != "packed" else ""),
           "forward": forward,
           "date": datetime.date.today().isoformat(), "threads": threads, "repeats": repeats,
           "device": str(engine.device), "torch": torch.__version__}
    for label, report in (("prefill", prefill_report), ("decode", decode_report)):
        fit |= {f"{label}_points": report.points, f"{label}_rms_rel_error": round(report.rms_rel_error, 4),
                f"{label}_max_rel_error": round(report.max_rel_error, 4),
                f"{label}_measured_vs_modelled_ms": [[dataclasses.asdict(s), round(m, 3), round(f, 3)]
                                                     for s, m, f in report.residuals]}
    return EngineProfile(
        name=name, hardware=hardware,
        model=f"the project's demo LM ({assets / 'lm'}), {dtype_name}, its LoRA adapters",
        source=f"fitted by `python -m warmup_tools profile-fit` on the real engine's {forward} forward, through "
               "the scheduler's SequenceEngine protocol",
        kv_bytes_per_token=kv_bytes, kv_capacity_tokens=DEFAULT_BUDGET_BYTES // kv_bytes,
        prefill=_rounded(prefill), decode=_rounded(decode), device="gpu" if gpu else "cpu",
        notes=f"Modelled. kv_bytes_per_token is the demo LM's {dtype_name} KV (2 x layers x KV heads x head_dim x "
              "bytes); kv_capacity_tokens is the default kv_cache_bytes (256 MiB) over it.",
        fit=fit)


def _clock(device: object) -> Callable[[], float]:
    """``time.perf_counter``, after the device's queued work on a GPU (a CUDA forward returns before it ran)."""
    import torch

    if getattr(device, "type", "cpu") != "cuda":
        return time.perf_counter

    def synchronized() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return synchronized


# ------------------------------------------------------------------------------------------ helpers
def _fit(samples: Sequence[tuple[StepShape, float]],
         features: Callable[[StepShape], tuple[float, ...]]) -> tuple[list[float], FitReport]:
    """Least squares with every coefficient >= 0: a column whose coefficient comes out negative is dropped
    (fixed at 0) and the rest refitted. NOTE: relative errors are what matter (a 2 ms step off by 1 ms is
    worse than a 200 ms step off by 2 ms), so each row is weighted by 1 / measured."""
    if not samples:
        raise WarmupToolsError("no timed steps to fit")
    x = np.array([features(shape) for shape, _ in samples], dtype=float)
    y = np.array([ms for _, ms in samples], dtype=float)
    w = 1.0 / np.maximum(y, 1e-6)
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (solution >= 0).all():
            coef[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    modelled = x @ coef
    rel = (modelled - y) / np.maximum(y, 1e-9)
    residuals = tuple((shape, float(ms), float(m)) for (shape, ms), m in zip(samples, modelled))
    return [float(c) for c in coef], FitReport(len(samples), float(np.sqrt(np.mean(rel ** 2))),
                                               float(np.abs(rel).max()), residuals)


def _rounded(cost: PrefillCost | DecodeCost) -> PrefillCost | DecodeCost:
    return type(cost)(**{k: round(v, 5) for k, v in dataclasses.asdict(cost).items()})


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, one torch thread"
    except OSError:
        pass
    return platform.processor() or platform.machine()



def summary(profile: EngineProfile) -> str:
    """The fitted coefficients and how well they fit, in two lines."""
    fit = profile.fit
    return (f"prefill {dataclasses.asdict(profile.prefill)}, decode {dataclasses.asdict(profile.decode)}\n"
            f"fit: prefill rms {fit['prefill_rms_rel_error']:.1%} max {fit['prefill_max_rel_error']:.1%} over "
            f"{fit['prefill_points']} steps; decode rms {fit['decode_rms_rel_error']:.1%} max "
            f"{fit['decode_max_rel_error']:.1%} over {fit['decode_points']} steps")
