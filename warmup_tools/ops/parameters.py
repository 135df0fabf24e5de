"""The parameter reference (``docs/parameters.md``), generated from the settings objects.

``python -m warmup_tools parameters`` prints it; a unit test keeps the file equal to it and every model's
``config.pbtxt`` within it, so a parameter exists with its docs or not at all.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from warmup_tools.common.flags import file_flag
from warmup_tools.common.settings import ParameterRow, env_name, markdown_table, parameter_rows
from warmup_tools.common.tracing import TracingSettings
from warmup_tools.control.plan_history import PlanHistorySettings
from warmup_tools.embedding_cache.settings import EmbeddingCacheSettings
from warmup_tools.fleet.settings import FleetSettings
from warmup_tools.front.settings import FrontSettings
from warmup_tools.lora_adapter.settings import LoraAdapterSettings
from warmup_tools.ops.cli.options import COMMAND_OPTIONS
from warmup_tools.server.config import REPO_ROOT, ServeConfig
from warmup_tools.sidecar.config import SidecarConfig
from warmup_tools.tokenizer_cache.settings import TokenizerCacheSettings

#: Each process's settings: the section's title, the class, the commands that take it, the page about it.
PROCESS_SETTINGS = (
    ("The server", ServeConfig, "`serve`, `sidecar` and `demo` (and its folders' flags, `--model-repository`, "
     "`--control-dir` and `--assets-dir`, of the plan, adapter, profile and bench commands)", "serving.md"),
    ("The sidecar", SidecarConfig, "`sidecar`", "sidecar.md"),
    ("The plan history", PlanHistorySettings, "`apply-plan`, `plan rollback` and `plan canary` "
     "(`--history-keep`); the sidecar's re-plan reads the variable", "planner.md"),
    ("The OpenAI front", FrontSettings, "`front`, `serve` and `sidecar`", "openai.md"),
    ("The fleet", FleetSettings, "`fleet`, `router` and `join`", "fleet.md"),
    ("Tracing", TracingSettings, "", "tracing.md"),
)

_PROCESSES_INTRO = """
## The processes' settings

The sections below are read by `warmup_tools.common.settings.load_settings`, each key from, lowest
precedence first: its default, the command's JSON file, the environment variable `WARMUP_<SECTION>_<KEY>`
(upper case; the server's and the plan history's have no section: `WARMUP_<KEY>`), the command's flag
`--<key>` (`_` as `-`; `--front-port`, `--sidecar-port` and `--sidecar-host` where two sections share a
key). A key a file does not know, or a value of the wrong type, stops the command naming it.
"""

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
    repository = repository or REPO_ROOT / "model_repository"
    parts = [_HEADER]
    for model, cls in MODEL_SETTINGS.items():
        parts.append(f"\n## `{model}`\n\nRead by `{cls.__module__}.{cls.__name__}`; the last column is the "
                     "value the shipped `model_repository` gives it (the environment variable that sets it).\n\n")
        parts.append(markdown_table(model_rows(model), shipped_values(repository, model)))
    parts.append(generate_request_markdown())
    parts.append(_PROCESSES_INTRO)
    for title, cls, commands, link in PROCESS_SETTINGS:
        file = f"the JSON file `{file_flag(cls)}` names, " if title not in ("The plan history", "Tracing") else ""
        # NOTE: tracing has no flag: the front and tritonserver's models each read it from their environment.
        flags = f", and the flags of {commands}" if commands else " only, in every process that serves requests"
        parts.append(f"\n## {title}\n\nThe keys of `{cls.__name__}` in `{cls.__module__}`: set by {file}"
                     f"`{env_name(cls, '<KEY>')}` variables{flags} ([{link}]({link})).\n\n")
        table = markdown_table(list(parameter_rows(cls))).replace("| parameter |", "| key |", 1)
        parts.append(table.replace(str(REPO_ROOT) + "/", ""))  # the defaults under the checkout, as relative
    parts.append(_COMMANDS_INTRO)
    for cls, commands in COMMAND_OPTIONS:
        parts.append(f"\n### {commands}\n\nThe fields of `{cls.__name__}`.\n\n")
        parts.append(_flag_table(cls))
    return "".join(parts)


_COMMANDS_INTRO = """
## The commands' options

What one invocation of a command does, beyond the processes' settings above: the fields of the classes in
`warmup_tools.ops.cli.options`, each a flag of the commands named (a boolean `--x` also has `--no-x`). They
have no file and no environment variable; a default written `required` is a flag the command needs.
"""


def _flag_table(cls: type) -> str:
    """``cls``'s fields as a table of flags."""
    from warmup_tools.common.flags import flag_of
    from warmup_tools.common.settings import spec_of

    flags = {f.name: flag_of(f.name, spec) for f in dataclasses.fields(cls) if (spec := spec_of(f)) is not None}
    rows = [dataclasses.replace(row, parameter=flags[row.parameter]) for row in parameter_rows(cls)]
    table = markdown_table(rows).replace("| parameter |", "| flag |", 1)
    return table.replace(str(REPO_ROOT) + "/", "")


def generate_request_markdown() -> str:
    """The ``ensemble``'s inputs as a client sends them, from the wire table (warmup_tools/common/wire.py)."""
    from warmup_tools.common.wire import GENERATE_INPUTS, GENERATE_OUTPUTS

    lines = ["\n## The generate request (`ensemble`)\n",
             "Its inputs, from the one table in `warmup_tools.common.wire` (both config.pbtxt files are checked "
             "against it). Triton takes each as optional (a request without `text_input` gets the tokenizer's "
             "error); an absent input takes its default.\n",
             "| input | type | default | bound | what it does |", "|---|---|---|---|---|"]
    for row in GENERATE_INPUTS:
        if not row.ensemble:
            continue
        dims = ", ".join(str(d) for d in row.dims)
        default = "" if row.default is None else str(row.default).lower() if isinstance(row.default, bool) \
            else f"{row.default:g}" if isinstance(row.default, float) else str(row.default)
        lines.append(f"| `{row.name}` | {row.dtype} [{dims}] | {default} | {row.bound} | {row.doc} |")
    lines.append("\nOutputs: " + ", ".join(f"`{name}` ({dtype})" for name, dtype in GENERATE_OUTPUTS) + ".\n")
    return "\n".join(lines)
