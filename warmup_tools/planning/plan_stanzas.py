"""From a warm-up plan to ``model_warmup`` stanzas, and a check of a repository's stanzas.

``python -m warmup_tools stanzas --plan plan.json`` writes, into the three composing models:

* ``tokenizer_cache``: one sample per planned template text (tenant-scoped), so the template's ids are
  cached (and registered as a template) before READY;
* ``embedding_cache``: one sample per planned representative prompt, computed (never sampled away);
* ``lora_adapter``: one sample per planned KV prefix, as token ids with its adapter and tenant, so the
  prefix's KV blocks are filled and pinned under the plan before READY.

Every sample carries ``warmup_plan`` (the plan id); a ``lora_adapter`` sample of an item with a ``retention_s``
also carries ``warmup_retention_s``, how long the blocks it pins stay pinned (without it the model's
``kv_pin_retention_s``). The ensemble gets none (Triton refuses it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from warmup_tools.common.digests import tokenizer_fingerprint
from warmup_tools.common.plan import Plan, PlanError
from warmup_tools.common.wire import plan_retention
from warmup_tools.embedding_cache.semantic import CENTROIDS_FILE, write_centroids
from warmup_tools.planning.stanzas import (
    BEGIN_MARKER,
    COMPOSING_MODELS,
    WARMUP_DIR,
    WarmupInput,
    WarmupSample,
    deserialize_tensor,
    string_input,
    write_model_warmup,
)
from warmup_tools.planning.target import PlanTarget


def samples_from_plan(plan: Plan) -> dict[str, list[WarmupSample]]:
    """Warm-up samples per composing model for ``plan``."""
    plan_id = plan.plan_id
    tag = plan_id[:8]
    samples: dict[str, list[WarmupSample]] = {m: [] for m in COMPOSING_MODELS}
    for i, item in enumerate(plan.tokenizer_templates):
        samples["tokenizer_cache"].append(WarmupSample(f"plan_{tag}_tok_{i:04d}", (
            string_input("text_input", item["text"]),
            string_input("tenant_id", item.get("tenant") or "default"),
            string_input("warmup_plan", plan_id),
        )))
    for i, item in enumerate(plan.embedding_items):
        samples["embedding_cache"].append(WarmupSample(f"plan_{tag}_emb_{i:04d}", (
            string_input("text_input", item["text"]),
            string_input("tenant_id", item.get("tenant") or "default"),
            string_input("warmup_plan", plan_id),
        )))
    for i, item in enumerate(plan.items):
        if item.get("kind") != "kv_prefix":
            continue
        inputs = [
            WarmupInput("input_ids", "TYPE_INT32", np.asarray(item["token_ids"], dtype=np.int32)),
            string_input("tenant_id", item.get("tenant") or "default"),
            WarmupInput("max_tokens", "TYPE_INT32", np.array([1], dtype=np.int32)),
            string_input("warmup_plan", plan_id),
        ]
        if item.get("adapter"):
            inputs.append(string_input("adapter_id", item["adapter"]))
        retention = _retention(i, item)
        if retention is not None:
            inputs.append(WarmupInput("warmup_retention_s", "TYPE_FP32", retention))
        samples["lora_adapter"].append(WarmupSample(f"plan_{tag}_kv_{i:04d}", tuple(inputs)))
    return samples


def _retention(index: int, item: Mapping[str, Any]) -> np.ndarray | None:
    """The item's ``retention_s`` as the sample's FP32 tensor (None: the item has none); :class:`PlanError` for one
    ``lora_adapter`` would refuse (its load would fail on the sample)."""
    try:
        seconds = plan_retention(item.get("retention_s"))
    except ValueError as exc:
        raise PlanError(f"plan item {index}: {exc}") from None
    return None if seconds is None else np.array([seconds], dtype=np.float32)


def write_plan_stanzas(plan: Plan, model_repository: Path, *, target: PlanTarget | None = None,
                       tokenizer: Any | None = None) -> dict[str, int]:
    """Check ``plan`` against the repository, then write its samples (idempotent); samples per model.

    ``target`` and ``tokenizer`` default to what the repository's ``lora_adapter`` serves with; a plan
    made for another block size, tokenizer or budget, or with an item the server could not warm, raises
    :class:`~warmup_tools.common.plan.PlanError` before anything is written.
    """
    model_repository = Path(model_repository)
    target = target or PlanTarget.from_repository(model_repository)
    tokenizer = tokenizer if tokenizer is not None else target.load_tokenizer()
    target.check(plan, tokenizer_fingerprint(tokenizer), tokenizer)
    counts = {}
    for model, model_samples in samples_from_plan(plan).items():
        write_model_warmup(model_repository / model, model_samples)
        counts[model] = len(model_samples)
    write_centroids(model_repository / "embedding_cache" / CENTROIDS_FILE, plan.clusters)
    return counts


def check_repository(model_repository: Path) -> list[str]:
    """Problems with the repository's ``model_warmup`` stanzas: names, types, shapes and data files."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    problems: list[str] = []
    for config_path in sorted(Path(model_repository).glob("*/config.pbtxt")):
        model_dir = config_path.parent
        try:
            config = text_format.Parse(config_path.read_text(), model_config_pb2.ModelConfig())
        except text_format.ParseError as exc:
            problems.append(f"{config_path}: does not parse: {exc}")
            continue
        if config.platform == "ensemble" and len(config.model_warmup):
            problems.append(f"{config_path}: an ensemble may not have model_warmup (Triton refuses to load it)")
        inputs = {i.name: i for i in config.input}
        for sample in config.model_warmup:
            where = f"{model_dir.name}: sample '{sample.name}'"
            if sample.batch_size != 1 and config.max_batch_size == 0:
                problems.append(f"{where}: batch_size must be 1 for a model with max_batch_size 0")
            missing = [name for name, i in inputs.items() if not i.optional and name not in sample.inputs]
            if missing:
                problems.append(f"{where}: required input(s) {', '.join(missing)} missing")
            for name, value in sample.inputs.items():
                problems += _check_input(model_dir, where, name, value, inputs.get(name))
        if BEGIN_MARKER not in config_path.read_text() and len(config.model_warmup) == 0 \
                and model_dir.name in COMPOSING_MODELS:
            problems.append(f"{model_dir.name}: no model_warmup stanza (write one with `warmup_tools stanzas`)")
    return problems


def _check_input(model_dir: Path, where: str, name: str, value: Any, declared: Any) -> list[str]:
    from tritonclient.grpc import model_config_pb2

    if declared is None:
        return [f"{where}: input '{name}' is not an input of the model"]
    problems = []
    dtype = model_config_pb2.DataType.Name(value.data_type)
    if value.data_type != declared.data_type:
        problems.append(f"{where}: input '{name}' is {dtype}, the model declares "
                        f"{model_config_pb2.DataType.Name(declared.data_type)}")
    dims = list(value.dims)
    if any(d < 1 for d in dims):
        problems.append(f"{where}: input '{name}' needs concrete dims, got {dims}")
    declared_dims = list(declared.dims)
    if len(dims) != len(declared_dims) or any(d != w and w != -1 for d, w in zip(dims, declared_dims)):
        problems.append(f"{where}: input '{name}' dims {dims} do not fit the declared {declared_dims}")
    if value.input_data_file:
        path = model_dir / WARMUP_DIR / value.input_data_file
        if not path.exists():
            problems.append(f"{where}: data file {path} is missing")
        else:
            try:
                array = deserialize_tensor(path.read_bytes(), dtype, dims)
                if array.size != int(np.prod(dims)):
                    raise ValueError("size mismatch")
            except ValueError as exc:
                problems.append(f"{where}: data file {path.name} does not hold {dims} {dtype}: {exc}")
    return problems
