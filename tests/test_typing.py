"""mypy over ``dcp`` (settings: ``[tool.mypy]`` in pyproject.toml) may not get worse.

The errors mypy reported when type checking was introduced are recorded in
``tests/typing_baseline.txt``, one per line, without line numbers (so editing a file does
not churn the baseline). The test fails when an error appears that the baseline does not
have, and also when an error in the baseline is gone: then the baseline must shrink with
it, so it can never hide a new error behind a fixed one. Regenerate it after fixing errors::

    .venv/bin/python -m tests.test_typing --update      # or: make typing-baseline

Rules of this module: mypy runs as a subprocess from the repository root with the
project's config, so what this test sees is what ``make typecheck`` prints.
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "tests" / "typing_baseline.txt"
_LINE = re.compile(r"^(?P<path>[^:\s]+\.pyi?):\d+(?::\d+)?: error: (?P<msg>.*)$")


def mypy_errors() -> collections.Counter[str]:
    """``path: error: message  [code]`` of every error, counted (line numbers dropped)."""
    proc = subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    if proc.returncode not in (0, 1):  # 2: mypy itself failed (bad config, crash)
        raise RuntimeError(f"mypy failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return parse(proc.stdout)


def parse(output: str) -> collections.Counter[str]:
    out: collections.Counter[str] = collections.Counter()
    for line in output.splitlines():
        m = _LINE.match(line)
        if m:
            out[f"{m['path']}: {m['msg']}"] += 1
    return out


def read_baseline() -> collections.Counter[str]:
    lines = [ln for ln in BASELINE.read_text().splitlines() if ln and not ln.startswith("#")]
    return collections.Counter(lines)


def compare(now: collections.Counter[str], baseline: collections.Counter[str]) -> list[str]:
    """What is wrong with ``now`` against ``baseline``, as messages for the developer."""
    new = now - baseline
    gone = baseline - now
    problems = [f"new type error: {e}" for e in sorted(new.elements())]
    problems += [
        f"fixed (remove it from {BASELINE.name}, or run `make typing-baseline`): {e}"
        for e in sorted(gone.elements())
    ]
    return problems


def write_baseline(errors: collections.Counter[str]) -> None:
    head = (
        "# mypy errors allowed in dcp/ (tests/test_typing.py): this list may only shrink.\n"
        f"# {sum(errors.values())} errors; regenerate: make typing-baseline\n"
    )
    BASELINE.write_text(head + "".join(f"{e}\n" for e in sorted(errors.elements())))


def test_no_type_error_beyond_the_baseline_and_the_baseline_only_shrinks() -> None:
    problems = compare(mypy_errors(), read_baseline())
    assert not problems, "\n".join(problems)


def test_compare_reports_new_errors_and_errors_fixed_but_still_listed() -> None:
    base = parse(
        "dcp/a.py:3: error: Bad  [x]\ndcp/a.py:9: error: Bad  [x]\n"
        "dcp/b.py:1: note: a note\nFound 2 errors in 1 file\n"
    )
    assert base == collections.Counter({"dcp/a.py: Bad  [x]": 2})
    moved = parse("dcp/a.py:30: error: Bad  [x]\ndcp/a.py:90: error: Bad  [x]\n")
    assert compare(moved, base) == []  # line numbers do not matter
    one_more = moved + parse("dcp/c.py:1:5: error: Worse  [y]\n")
    assert compare(one_more, base) == ["new type error: dcp/c.py: Worse  [y]"]
    assert compare(parse("dcp/a.py:3: error: Bad  [x]\n"), base)[0].startswith("fixed")


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: python -m tests.test_typing --update")
    errors = mypy_errors()
    write_baseline(errors)
    print(f"{BASELINE}: {sum(errors.values())} errors")
