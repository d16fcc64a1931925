"""The mutation check: apply each mutant of catalogue.py to a copy of the repository and run the tests
named for it; every one of them must fail. A mutant that no named test catches is a hole in the suite.

    python -m tests.mutants                 # every mutant, its named tests (what .ci/run runs)
    python -m tests.mutants --only NAME     # one mutant
    python -m tests.mutants --full          # the whole suite per mutant: how many tests catch each
    python -m tests.mutants --list          # the catalogue

The copy holds `hf_spin/`, `tests/`, `benchmarks/` and `pyproject.toml`; pytest runs in it, so `import hf_spin`
finds the mutated package first (checked for every mutant). Exit status 1 when a mutant survives.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .catalogue import MUTANTS, Mutant

ROOT = Path(__file__).resolve().parents[2]
COPIED = ("hf_spin", "tests", "benchmarks", "pyproject.toml")
FAILED_LINE = re.compile(r"^FAILED (\S+)", re.M)
SUMMARY_LINE = re.compile(r"^=*\s*(.*(?:passed|failed|error).*?)\s*=*$", re.M)


def make_copy(mutant: Mutant, into: Path) -> None:
    """The repository's package and tests under `into`, with `mutant` applied."""
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, into / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, into / name)
    target = into / mutant.path
    text = target.read_text()
    count = text.count(mutant.old)
    if count != 1:
        raise SystemExit(
            f"mutant {mutant.name!r}: its snippet occurs {count} times in {mutant.path} (must be once); "
            "update tests/mutants/catalogue.py"
        )
    target.write_text(text.replace(mutant.old, mutant.new))


def pytest(into: Path, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *args],
        cwd=into,
        env=env,
        capture_output=True,
        text=True,
    )


def imports_the_copy(into: Path) -> bool:
    probe = "import hf_spin, pathlib; print(pathlib.Path(hf_spin.__file__).resolve())"
    out = subprocess.run([sys.executable, "-c", probe], cwd=into, capture_output=True, text=True).stdout.strip()
    return out.startswith(str(into.resolve()))


def check(mutant: Mutant, full: bool) -> tuple[bool, str]:
    """(caught, one line of report) for one mutant."""
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        into = Path(tmp)
        make_copy(mutant, into)
        if not imports_the_copy(into):
            raise SystemExit(f"the copy in {into} does not import its own hf_spin; the check would test the original")
        start = time.perf_counter()
        run = pytest(into, ["-m", "not real_models"] if full else list(mutant.tests))
        seconds = time.perf_counter() - start
    failed = set(FAILED_LINE.findall(run.stdout))
    summary = (SUMMARY_LINE.findall(run.stdout) or [run.stdout.strip().splitlines()[-1:] or "no output"])[-1]
    missed = [t for t in mutant.tests if t not in failed]
    # exit status 1: tests ran and failed (2-4: interrupted, usage or collection errors, which prove nothing)
    caught = run.returncode == 1 and not missed
    line = f"{'caught  ' if caught else 'SURVIVED'} {mutant.name}: {summary} ({seconds:.0f} s)"
    if missed:
        line += "\n    named tests that passed: " + ", ".join(missed)
    if run.returncode not in (0, 1):
        line += f"\n    pytest exit status {run.returncode}:\n" + run.stdout[-2000:] + run.stderr[-2000:]
    return caught, line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.mutants", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only", action="append", choices=[m.name for m in MUTANTS], help="run this mutant (repeatable)"
    )
    parser.add_argument("--full", action="store_true", help="run the whole suite (not real_models) per mutant")
    parser.add_argument("--list", action="store_true", help="print the catalogue and exit")
    args = parser.parse_args(argv)
    mutants = [m for m in MUTANTS if not args.only or m.name in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.name} ({m.path}): {m.why}\n    " + "\n    ".join(m.tests))
        return 0
    survived = 0
    for m in mutants:
        caught, line = check(m, args.full)
        survived += not caught
        print(line, flush=True)
    print(f"{len(mutants) - survived} of {len(mutants)} mutants caught")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
