"""What a plan is made for, read from the model repository it will be written into.

The planner and the stanza writer take the KV block size, storage, dtype and budget from the repository's
``lora_adapter/config.pbtxt`` (through :class:`~warmup_tools.lora_adapter.settings.LoraAdapterSettings`,
the same code the server runs), the tokenizer from ``lora_adapter``'s ``base_model`` and the embedder
from ``embedding_cache``'s ``embedder_path``. No second default, no hand-computed copy: a plan made for
one repository and applied to another with a different block size, tokenizer or budget is refused.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Mapping

from warmup_tools.common.errors import AssetError
from warmup_tools.common.plan import Budgets, Plan, PlanError
from warmup_tools.embedding_cache.settings import EmbedderConfig, EmbeddingCacheSettings
from warmup_tools.lora_adapter.settings import LoraAdapterSettings, discover_adapters, model_context_length


@dataclasses.dataclass(frozen=True, slots=True)
class PlanTarget:
    settings: LoraAdapterSettings
    tokenizer_dir: Path
    #: The embedder ``embedding_cache`` runs (its model folder, providers, threads): the planner's clusters are
    #: the server's.
    embedder: EmbedderConfig
    #: KV bytes one cached token takes on this repository's server (model config, dtype, kv_storage).
    kv_bytes_per_token: int

    @classmethod
    def from_repository(cls, model_repository: Path, environ: Mapping[str, str] | None = None) -> PlanTarget:
        """From the repository's configs, ``${ENV}`` taken from ``environ`` (default: this process's)."""
        settings = LoraAdapterSettings.from_repository(model_repository, environ)
        embedder = EmbeddingCacheSettings.from_repository(model_repository, environ).embedder
        return cls(settings, settings.engine.base_model, embedder, math.ceil(settings.kv_bytes_per_token()))

    @property
    def block_size(self) -> int:
        return self.settings.engine.kv.block_size

    def default_budgets(self, **overrides: Any) -> Budgets:
        """The repository's warm-up share of the KV budget; no bound per adapter below it (the planner's
        arbitration splits it, :mod:`warmup_tools.planning.arbitrate`)."""
        total = overrides.pop("kv_bytes_total", None) or self.settings.engine.kv.warmup_budget_bytes
        per_adapter = overrides.pop("kv_bytes_per_adapter", None) or total
        return Budgets(kv_bytes_total=total, kv_bytes_per_adapter=per_adapter, **overrides)

    def load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer  # heavy; only for planning

        return AutoTokenizer.from_pretrained(self.tokenizer_dir)

    def adapters(self) -> set[str]:
        """The adapters this repository's ``lora_adapter`` loads at start ("" is the base model)."""
        try:
            return {"", *discover_adapters(self.settings.engine.adapter_root, self.settings.engine.adapters)}
        except AssetError as exc:
            raise PlanError(f"the repository's adapters cannot be listed: {exc}") from None

    def check(self, plan: Plan, tokenizer_fingerprint: str, tokenizer: Any | None = None) -> None:
        """Refuse a plan made for another block size, tokenizer or budget, naming both values; then refuse
        any item the server could not warm (longer than the model's context, for an adapter it does not
        have, or whose token ids are not its text's under ``tokenizer``), naming the item."""
        where = f"plan {plan.plan_id}"
        if plan.block_size != self.block_size:
            raise PlanError(f"{where} was made for KV block size {plan.block_size}, but lora_adapter's "
                            f"kv_block_size is {self.block_size}: make a new plan against this repository")
        if plan.tokenizer_fingerprint != tokenizer_fingerprint:
            raise PlanError(f"{where} was made with tokenizer {plan.tokenizer_fingerprint}, but lora_adapter's "
                            f"base_model tokenizer is {tokenizer_fingerprint}: its token ids would not match; "
                            "make a new plan against this repository")
        tokens = sum(len(item["token_ids"]) for item in plan.items)
        planned_per_token = plan.settings.get("kv_bytes_per_token") or self.kv_bytes_per_token
        new_bytes = plan.summary.get("kv_bytes", 0) / planned_per_token * self.kv_bytes_per_token
        budget = self.settings.engine.kv.warmup_budget_bytes
        if new_bytes > budget:
            raise PlanError(f"{where} needs {int(new_bytes)} KV bytes here ({tokens} planned tokens at "
                            f"{self.kv_bytes_per_token} bytes each), but lora_adapter's warm-up share is {budget} "
                            "bytes (kv_cache_bytes less kv_live_reserve): make a new plan against this repository")
        context = model_context_length(self.settings.engine.base_model)
        adapters = self.adapters()
        vocab = len(tokenizer) if tokenizer is not None else None
        for index, item in enumerate(plan.items):
            ids = item["token_ids"]
            name = (f"{where} item {index} (tenant {item.get('tenant')!r}, adapter "
                    f"{item.get('adapter') or '(base)'!r}, {str(item.get('text', ''))[:40]!r})")
            if len(ids) >= context:
                raise PlanError(f"{name} has {len(ids)} tokens, but the base model's context is {context} tokens "
                                "(and warming it generates one more): drop the item or make a new plan")
            if item.get("adapter", "") not in adapters:
                raise PlanError(f"{name} is for adapter {item.get('adapter')!r}, which this repository does not "
                                f"load (it has: {', '.join(sorted(a or '(base)' for a in adapters))}): add the "
                                "adapter under adapter_root or make a new plan")
            if vocab is not None and not _tokens_match(tokenizer, item, vocab):
                raise PlanError(f"{name}: its token ids are not what lora_adapter's tokenizer makes of its text; "
                                "the plan was made with another tokenizer: make a new plan against this repository")


def _tokens_match(tokenizer: Any, item: Mapping[str, Any], vocab: int) -> bool:
    """``item``'s ids are in the vocabulary and, where the item keeps its text, are that text's tokens.

    The text is the span of the prompt the ids cover, so re-encoding it may merge its last token
    differently (the rest of the prompt is gone): all but the last id must match.
    """
    ids = item["token_ids"]
    if any(i < 0 or i >= vocab for i in ids):
        return False
    text = item.get("text")
    if not text:
        return True
    again = list(tokenizer.encode(text, add_special_tokens=True))
    return again[: len(ids) - 1] == list(ids[:-1])
