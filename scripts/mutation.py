"""Mutation testing of the security-critical modules: ``make mutation`` (docs/mutation.md).

Runs mutmut (configured in pyproject.toml ``[tool.mutmut]``) over the named modules, or over every module
that config names, then prints per module the mutants generated, killed, survived and the lines marked
``# pragma: no mutate`` (equivalent mutants, each with its reason beside it), and the diff of every mutant
that was not killed. Exits 1 if any mutant survived or no test reached it.

    python scripts/mutation.py                          # every module in [tool.mutmut] only_mutate
    python scripts/mutation.py warmup_tools/kv/hashing.py warmup_tools/triton/inputs.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "mutants"
LOG = WORK / "mutation-run.log"

#: mutmut's exit codes of one mutant's test run, folded into what the report counts.
#: NOTE: a timeout is the mutant making a test hang (a loop that no longer ends): a test noticed it.
KILLED = {1: "killed", 3: "killed", 36: "killed", 24: "killed", -24: "killed", 152: "killed", 255: "killed"}
NOT_KILLED = {0: "survived", 5: "no tests", 33: "no tests", None: "not checked"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("modules", nargs="*", help="source files to mutate (default: every one in [tool.mutmut])")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 2, help="mutants tested at once")
    args = parser.parse_args(argv)

    os.chdir(ROOT)  # mutmut reads ./pyproject.toml
    from mutmut.configuration import config

    configured = config().only_mutate
    modules = args.modules or configured
    unknown = [m for m in modules if m not in configured]
    if unknown:
        parser.error(f"not in [tool.mutmut] only_mutate: {', '.join(unknown)}")

    # NOTE: always from scratch: mutmut reuses earlier verdicts from mutants/, which would report a mutant
    # killed by a test that has since changed.
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir()
    env = dict(os.environ)
    env.setdefault("WARMUP_ASSETS_DIR", str(ROOT / ".assets"))  # tests run inside mutants/, not the checkout
    mutmut = Path(sys.executable).with_name("mutmut")
    names = [module_name(m) + ".*" for m in modules]
    with LOG.open("w") as log:
        run = subprocess.run([str(mutmut), "run", "--max-children", str(args.max_children), *names],
                             cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    if run.returncode != 0:
        print(LOG.read_text("utf-8", errors="replace")[-4000:])
        print(f"error: mutmut exited {run.returncode} (full output in {LOG.relative_to(ROOT)})")
        return 1

    failures = 0
    print(f"{'module':40} {'generated':>9} {'killed':>7} {'survived':>8} {'no tests':>8} {'other':>5} "
          f"{'no mutate':>9}")
    for module in modules:
        counts, not_killed = summarise(module)
        equivalent = sum("pragma: no mutate" in line for line in (ROOT / module).read_text("utf-8").splitlines())
        other = counts.total() - counts["killed"] - counts["survived"] - counts["no tests"]
        print(f"{module:40} {counts.total():>9} {counts['killed']:>7} {counts['survived']:>8} "
              f"{counts['no tests']:>8} {other:>5} {equivalent:>9}")
        failures += len(not_killed)
        for name in not_killed:
            show = subprocess.run([str(mutmut), "show", name], cwd=ROOT, env=env, capture_output=True, text=True,
                                  check=False)
            print(show.stdout, file=sys.stderr)
    if failures:
        print(f"error: {failures} mutants were not killed (diffs above; full output in {LOG.relative_to(ROOT)})")
        return 1
    print("every mutant killed")
    return 0


def module_name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def summarise(module: str) -> tuple[Counter, list[str]]:
    """The verdict counts of one module's mutants, and the names of those not killed."""
    meta = json.loads((WORK / (module + ".meta")).read_text("utf-8"))
    counts: Counter = Counter()
    not_killed = []
    for name, code in sorted(meta["exit_code_by_key"].items()):
        verdict = KILLED.get(code) or NOT_KILLED.get(code, "suspicious")
        counts[verdict] += 1
        if verdict != "killed":
            not_killed.append(name)
    return counts, not_killed


if __name__ == "__main__":
    sys.exit(main())
