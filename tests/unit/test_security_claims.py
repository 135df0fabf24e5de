"""The index of security claims names only tests that exist, and docs/security-claims.md is the script's output."""

import ast
import importlib.util
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "security_claims.py"
INDEX = ROOT / "docs" / "security-claims.md"


@cache
def _claims_module():
    spec = importlib.util.spec_from_file_location("security_claims", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@cache
def _functions(path: Path) -> frozenset[str]:
    """Every function a test file defines, at any depth (a test in a class, a fixture, a parametrized test)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return frozenset(node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))


def _missing(node_id: str) -> str | None:
    path_part, _, name = node_id.partition("::")
    path = ROOT / path_part
    if not (path_part.startswith("tests/") and path.suffix == ".py" and path.is_file()):
        return f"{node_id}: no such test file"
    if name and name.split("[")[0] not in _functions(path):
        return f"{node_id}: {path_part} defines no {name}"
    return None


def test_every_test_the_index_names_exists():
    module = _claims_module()
    named = [test for area in module.AREAS for claim in area.claims for test in claim.tests]
    missing = [problem for problem in map(_missing, named) if problem]
    assert not missing, "\n".join(missing)


def test_every_claim_names_at_least_one_test_and_no_test_twice():
    module = _claims_module()
    for area in module.AREAS:
        for claim in area.claims:
            assert claim.tests and len(set(claim.tests)) == len(claim.tests), claim.text


def test_a_test_that_does_not_exist_is_reported():
    assert _missing("tests/unit/test_security_claims.py::test_every_test_the_index_names_exists") is None
    assert _missing("tests/unit/test_security_claims.py::test_nothing_like_this") is not None
    assert _missing("tests/unit/no_such_file.py") is not None


def test_the_index_is_the_scripts_output():
    assert INDEX.read_text(encoding="utf-8") == _claims_module().markdown(), (
        "docs/security-claims.md is stale: run `python scripts/security_claims.py > docs/security-claims.md`")
