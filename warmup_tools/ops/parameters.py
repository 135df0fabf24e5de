"""The parameter reference (``docs/parameters.md``), generated from the settings objects.

``python -m warmup_tools parameters`` prints it; a unit test keeps the file equal to it and every model's
``config.pbtxt`` within it, so a parameter exists with its docs or not at all.
"""

from __future__ import annotations

import re
from pathlib import Path

from warmup_tools.common.settings import ParameterRow, markdown_table, parameter_rows
from warmup_tools.control.plan_history import PlanHistorySettings
from warmup_tools.embedding_cache.settings import EmbeddingCacheSettings
from warmup_tools.fleet.settings import FleetSettings
from warmup_tools.front.settings import FrontSettings
from warmup_tools.lora_adapter.settings import LoraAdapterSettings
from warmup_tools.sidecar.config import SidecarConfig
from warmup_tools.tokenizer_cache.settings import TokenizerCacheSettings

#: Each model's settings object, in pipeline order: ``config.pbtxt`` parameters.
MODEL_SETTINGS = {"tokenizer_cache": TokenizerCacheSettings, "embedding_cache": EmbeddingCacheSettings,
                  "lora_adapter": LoraAdapterSettings}

_HEADER = """# Parameters

Generated from the settings objects by `python -m warmup_tools parameters > docs/parameters.md`: change a
setting's default, bound or doc where it is declared (the class named in each section), not here. A unit test
fails when this page and the code differ.

Model parameters are `config.pbtxt` entries `parameters { key: "<name>" value: { string_value: "<value>" } }`.
A value may reference the environment (`${VAR}`, `${VAR:-fallback}`); an empty value, or an absent parameter,
means the default below. A parameter a model does not know fails its load, naming the parameter.
"""


_SHIPPED = re.compile(r'parameters \{ key: "([a-z_0-9]+)" value: \{ string_value: "([^"]*)" \} \}')


def model_rows(model: str) -> list[ParameterRow]:
    return list(parameter_rows(MODEL_SETTINGS[model]))


def shipped_values(repository: Path, model: str) -> dict[str, str]:
    """The values the repository's ``config.pbtxt`` gives ``model``'s parameters, as written."""
    return dict(_SHIPPED.findall((repository / model / "config.pbtxt").read_text(encoding="utf-8")))


def parameters_markdown(repository: Path | None = None) -> str:
    from warmup_tools.server.config import REPO_ROOT

    repository = repository or REPO_ROOT / "model_repository"
    parts = [_HEADER]
    for model, cls in MODEL_SETTINGS.items():
        parts.append(f"\n## `{model}`\n\nRead by `{cls.__module__}.{cls.__name__}`; the last column is the "
                     "value the shipped `model_repository` gives it (the environment variable that sets it).\n\n")
        parts.append(markdown_table(model_rows(model), shipped_values(repository, model)))
    parts.append("\n## The sidecar\n\nThe keys of the JSON file `--sidecar-config` names (`SidecarConfig` in "
                 f"`{SidecarConfig.__module__}`); `sidecar` flags override them.\n\n")
    parts.append(markdown_table(list(parameter_rows(SidecarConfig))).replace("| parameter |", "| key |", 1))
    parts.append("\n## The plan history\n\nRead by every writer of the control folder's plan (`apply-plan`, "
                 "`plan rollback`, the sidecar's re-plan) from `WARMUP_PLAN_HISTORY_KEEP` (`PlanHistorySettings` in "
                 f"`{PlanHistorySettings.__module__}`); `--history-keep` overrides it ([planner.md](planner.md)).\n\n")
    parts.append(markdown_table(list(parameter_rows(PlanHistorySettings))).replace("| parameter |", "| key |", 1))
    parts.append("\n## The OpenAI front\n\nThe keys of the JSON file `--front-config` names (`FrontSettings` in "
                 f"`{FrontSettings.__module__}`); `WARMUP_FRONT_<KEY>` environment variables set them too, and the "
                 "`front`, `serve` and `sidecar` flags override both ([openai.md](openai.md)).\n\n")
    parts.append(markdown_table(list(parameter_rows(FrontSettings))).replace("| parameter |", "| key |", 1))
    parts.append("\n## The fleet\n\nThe keys of the JSON file `--fleet-config` names (`FleetSettings` in "
                 f"`{FleetSettings.__module__}`); `WARMUP_FLEET_<KEY>` environment variables set them too, and the "
                 "`fleet` flags override both ([fleet.md](fleet.md)).\n\n")
    parts.append(markdown_table(list(parameter_rows(FleetSettings))).replace("| parameter |", "| key |", 1))
    return "".join(parts)
