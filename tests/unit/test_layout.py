"""The package's layout is part of its contract: each sub-package imports only the layers below it.

The layers, lowest first (``ALLOWED`` lists them in this order, with what each package may import):

- ``common``: errors, digests, atomic files, JSON lines, the request record, the plan file, the settings
  declarations; imports nothing.
- ``demo``, ``kv``, ``caches``, ``control``, ``server``: the demo assets and prompts, the KV block model,
  the cache policies and shared tier, the control plane (the adapter set, the live plan, its history, the
  canary files), a tritonserver seen from outside.
- ``triton``: the Python backend's side of Triton (parameters, inputs, responses, metrics, trust, warm-up).
- ``smg_worker``: an instance's KV events on the ``smg`` router's engine protocol (its wire and its socket).
- ``tokenizer_cache``, ``embedding_cache``, ``lora_adapter``: the composing models, each behind its model.py.
- ``planning``: from request logs to a plan, checked against the repository and applied live.
- ``front``: the OpenAI-compatible HTTP front, a client of tritonserver (it reads the repository's tokenizer,
  KV budget, trust mode and what ``lora_adapter`` admits of one tenant from the composing models' settings).
- ``sidecar``: readiness, recovery and the rolling re-plan beside one tritonserver.
- ``fleet``: replicas (each ``warmup_tools sidecar`` in a child process) behind the ``smg`` router, on one
  machine; it runs the serving path as processes and imports none of it.
- ``sim``: traffic generators, benchmarks and load tests (nothing in the serving path imports them).
- ``ops``: the command line and ``make demo``; its bench and traffic commands are the only way into ``sim``.
- the top-level modules (``warmup_tools/__main__.py``): ``python -m warmup_tools``.

Module-level and function-level imports count alike (they are read with :mod:`ast`), and so do
``importlib.import_module`` calls whose module name starts with a literal.
"""

import ast
import graphlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "warmup_tools"
TOP = "warmup_tools"

#: What each sub-package may import besides itself, lowest layer first. Derived from the code; an
#: import outside it is either a mistake or a change of the layering that belongs here, argued.
ALLOWED: dict[str, set[str]] = {
    "common": set(),
    "demo": {"common"},
    "kv": {"common"},
    "caches": {"common"},
    "control": {"common"},
    "server": {"common"},
    "triton": {"common", "caches"},
    "smg_worker": {"common", "kv", "triton"},
    "tokenizer_cache": {"common", "caches", "triton"},
    "embedding_cache": {"common", "caches", "triton"},
    "lora_adapter": {"common", "kv", "control", "triton", "smg_worker"},
    "planning": {"common", "kv", "control", "triton", "embedding_cache", "lora_adapter"},
    "front": {"common", "kv", "server", "triton", "smg_worker", "tokenizer_cache", "lora_adapter"},
    "sidecar": {"common", "kv", "control", "server", "triton", "planning"},
    "fleet": {"common", "server"},
    "sim": {"common", "demo", "kv", "caches", "control", "server", "triton", "tokenizer_cache", "embedding_cache",
            "lora_adapter", "planning", "front", "sidecar", "fleet"},
    "ops": {"common", "demo", "control", "server", "triton", "tokenizer_cache", "embedding_cache", "lora_adapter",
            "planning", "front", "sidecar", "fleet", "sim"},
    TOP: {"ops"},
}


def module_name(path: Path, root: Path = PACKAGE.parent) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path = PACKAGE.parent) -> set[str]:
    """Every module ``path`` imports, absolute (relative imports resolved), wherever the import is."""
    this = module_name(path, root)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            # `from warmup_tools import sim`, `from warmup_tools.kv import blocks`: a name may be a module
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and _is_import_module(node.func):
            first = node.args[0]
            if isinstance(first, ast.JoinedStr) and first.values:
                first = first.values[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                names.add(first.value.rstrip("."))
    return names


def _is_import_module(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id == "import_module")


def sub_packages() -> set[str]:
    return {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}


def package_of(module: str) -> str | None:
    """The sub-package (or ``TOP``) a module of ours belongs to; None for a module that is not ours."""
    parts = module.split(".")
    if parts[0] != TOP or module == TOP:  # the package itself: its (empty) __init__ runs before any of it
        return None
    return parts[1] if len(parts) > 1 and parts[1] in sub_packages() else TOP


def package_imports() -> dict[str, dict[str, set[str]]]:
    """``{package: {imported package: {"file: module", ...}}}`` over every module of the package."""
    found: dict[str, dict[str, set[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = package_of(module_name(path))
        for module in imported_modules(path):
            target = package_of(module)
            if target is not None and target != source:
                found.setdefault(source, {}).setdefault(target, set()).add(
                    f"{path.relative_to(PACKAGE.parent)}: {module}")
    return found


def test_every_sub_package_has_a_row():
    assert set(ALLOWED) == sub_packages() | {TOP}


def test_no_package_imports_outside_its_row():
    wrong = [f"{source} may not import {target} ({', '.join(sorted(where))})"
             for source, targets in package_imports().items()
             for target, where in sorted(targets.items()) if target not in ALLOWED[source]]
    assert not wrong, "\n".join(wrong)


def test_the_table_has_no_cycle_and_lists_each_layer_after_what_it_imports():
    order = list(graphlib.TopologicalSorter(ALLOWED).static_order())  # raises CycleError on a cycle
    assert set(order) == set(ALLOWED)
    seen: set[str] = set()
    for package, allowed in ALLOWED.items():
        assert allowed <= seen, f"{package} may import {sorted(allowed - seen)}, listed after it"
        seen.add(package)


def module_imports() -> dict[str, set[str]]:
    """``{module: {module of ours it imports}}`` over every module of the package (``TYPE_CHECKING`` and
    function-level imports included: a cycle hidden in either is still two modules that need each other)."""
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {module: {m for m in imported_modules(path) if m in paths and m != module}
            for module, path in paths.items()}


def test_no_module_imports_a_module_that_imports_it_back():
    try:
        graphlib.TopologicalSorter(module_imports()).prepare()
    except graphlib.CycleError as exc:
        raise AssertionError(f"an import cycle: {' -> '.join(exc.args[1])} (move what both need into a module "
                             "of its own)") from None


def test_the_cycle_check_sees_a_cycle(tmp_path):
    root = tmp_path / "warmup_tools" / "sim"
    root.mkdir(parents=True)
    (root / "one.py").write_text("def f():\n    from warmup_tools.sim import two\n")
    (root / "two.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                 "    from warmup_tools.sim.one import f\n")
    graph = {module_name(p, tmp_path): {m for m in imported_modules(p, tmp_path)} for p in root.glob("*.py")}
    assert "warmup_tools.sim.two" in graph["warmup_tools.sim.one"]
    assert "warmup_tools.sim.one" in graph["warmup_tools.sim.two"]
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(graph).prepare()


#: The benchmarks' package, and the package of what they share (its docstring says what lives there).
BENCH = f"{TOP}.sim.bench"
SUPPORT = f"{BENCH}.support"


def benchmark_modules() -> set[str]:
    """The modules of the benchmarks: each key of ``BENCHES``, with ``_`` for ``-``."""
    from warmup_tools.ops.cli.bench import BENCHES

    return {f"{BENCH}.{name.replace('-', '_')}" for name in BENCHES}


def bench_layering_problems(graph: dict[str, set[str]], benchmarks: set[str]) -> list[str]:
    """What breaks the benchmarks' layering in ``graph`` (``{module: {module it imports}}``): a benchmark that
    imports another benchmark, a module of the support package that imports a benchmark (a way round the first),
    and a module of ``sim/bench/`` that is neither a benchmark nor in the support package."""
    problems = []
    for module, imported in sorted(graph.items()):
        if not module.startswith(BENCH + "."):
            continue
        in_support = module == SUPPORT or module.startswith(SUPPORT + ".")
        if module not in benchmarks and not in_support:
            problems.append(f"{module} is no benchmark (not in BENCHES): a helper belongs in {SUPPORT}")
        for target in sorted(imported & benchmarks - {module}):
            who = "the benchmark" if module in benchmarks else "the support module" if in_support else "the module"
            problems.append(f"{who} {module} imports the benchmark {target} (move what they share into {SUPPORT})")
    return problems


def test_no_benchmark_imports_another_benchmark():
    """Module-level, ``TYPE_CHECKING`` and function-level imports alike, as the cycle test reads them."""
    graph = module_imports()
    benchmarks = benchmark_modules()
    assert benchmarks <= set(graph), f"BENCHES names no module: {sorted(benchmarks - set(graph))}"
    problems = bench_layering_problems(graph, benchmarks)
    assert not problems, "\n".join(problems)


def test_the_bench_layering_check_sees_a_benchmark_importing_another(tmp_path):
    bench = tmp_path / "warmup_tools" / "sim" / "bench"
    (bench / "support").mkdir(parents=True)
    (bench / "__init__.py").write_text("")
    (bench / "support" / "__init__.py").write_text("")
    (bench / "one.py").write_text("def run():\n    from warmup_tools.sim.bench import two\n")
    (bench / "two.py").write_text("from warmup_tools.sim.bench.support.shared import helper\n\ndef run():\n"
                                  "    return helper()\n")
    (bench / "support" / "shared.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                 "    from warmup_tools.sim.bench.one import run\n")
    (bench / "stray.py").write_text("def helper():\n    return 1\n")
    graph = {module_name(p, tmp_path): imported_modules(p, tmp_path) for p in bench.rglob("*.py")}
    benchmarks = {f"{BENCH}.one", f"{BENCH}.two"}
    assert bench_layering_problems(graph, benchmarks) == [
        f"the benchmark {BENCH}.one imports the benchmark {BENCH}.two (move what they share into {SUPPORT})",
        f"{BENCH}.stray is no benchmark (not in BENCHES): a helper belongs in {SUPPORT}",
        f"the support module {SUPPORT}.shared imports the benchmark {BENCH}.one (move what they share into "
        f"{SUPPORT})"]
    (bench / "one.py").write_text("from warmup_tools.sim.bench.support.shared import helper\n")
    (bench / "support" / "shared.py").write_text("def helper():\n    return 1\n")
    (bench / "stray.py").unlink()
    graph = {module_name(p, tmp_path): imported_modules(p, tmp_path) for p in bench.rglob("*.py")}
    assert bench_layering_problems(graph, benchmarks) == []


def test_the_import_reader_sees_function_level_relative_and_dynamic_imports(tmp_path):
    module = tmp_path / "warmup_tools" / "ops" / "probe.py"
    module.parent.mkdir(parents=True)
    module.write_text("import importlib\n\ndef f(name):\n    from ..kv import blocks\n"
                      "    from warmup_tools import sim\n"
                      "    return importlib.import_module(f'warmup_tools.demo.{name}')\n")
    found = imported_modules(module, root=tmp_path)
    assert {"warmup_tools.kv", "warmup_tools.sim", "warmup_tools.demo"} <= found
    assert {package_of(m) for m in found} == {None, "kv", "sim", "demo"}


def test_within_ops_only_the_cli_reaches_sim():
    """``make demo`` and the deploy helpers are no way into the benchmarks; the bench and traffic commands are."""
    for path in (PACKAGE / "ops").rglob("*.py"):
        if path.name != "cli.py" and path.parent.name != "cli":
            assert not any(package_of(m) == "sim" for m in imported_modules(path)), path


def test_only_the_triton_package_may_import_the_python_backend():
    for path in PACKAGE.rglob("*.py"):
        if "triton_python_backend_utils" in imported_modules(path):
            assert path.parent.name == "triton", path


def test_the_top_level_reads_like_the_ensemble():
    modules = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(modules) <= 5, modules
    packages = sub_packages()
    assert {"tokenizer_cache", "embedding_cache", "lora_adapter", "kv", "caches", "planning"} <= packages
