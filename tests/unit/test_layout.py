"""The package's layout is part of its contract: low layers import nothing above them."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "warmup_tools"


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_common_and_kv_import_nothing_from_the_rest_of_the_package():
    for layer in ("common", "kv"):
        for path in (PACKAGE / layer).rglob("*.py"):
            ours = {m for m in imported_modules(path) if m.startswith("warmup_tools")}
            allowed = {m for m in ours if m.startswith(("warmup_tools.common", f"warmup_tools.{layer}"))}
            assert ours == allowed, f"{path.relative_to(PACKAGE)} imports {sorted(ours - allowed)}"


def test_only_the_triton_package_may_import_the_python_backend():
    for path in PACKAGE.rglob("*.py"):
        if "triton_python_backend_utils" in imported_modules(path):
            assert path.parent.name == "triton", path


def test_the_top_level_reads_like_the_ensemble():
    modules = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(modules) <= 5, modules
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert {"tokenizer_cache", "embedding_cache", "lora_adapter", "kv", "caches", "planning"} <= packages
