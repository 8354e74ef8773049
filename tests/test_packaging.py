"""What the installed package needs at run time is what pyproject.toml declares.

construct (``dcp/protocol/spec.py``), hypothesis (``tools/strategies.py``) and the ``tools``
package are dev-only: a runtime that imported them would break for a user who installed
``dcp-stream`` without the ``dev`` extra. ``dcp/py.typed`` (PEP 561) must ship with it.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNTIME = [
    "dcp.protocol",
    "dcp.producer.server",
    "dcp.producer.cli",
    "dcp.consumer",
    "dcp.ctl.cli",
    "dcp.spark",
]
DEV_ONLY = ["construct", "hypothesis", "tools", "dcp.protocol.spec", "dcp.protocol.spec_layouts"]


def test_the_runtime_never_imports_dev_only_modules() -> None:
    code = (
        f"import sys\nfor m in {RUNTIME!r}: __import__(m)\n"
        f"print(sorted(m for m in {DEV_ONLY!r} if m in sys.modules))"
    )
    # -I: isolated, so neither the cwd nor PYTHONPATH can put ``tools`` on the path
    p = subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "[]", f"the runtime imported dev-only modules: {p.stdout}"


def test_construct_is_a_dev_dependency_and_py_typed_ships() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = project["project"]["dependencies"]
    dev = project["project"]["optional-dependencies"]["dev"]
    assert not [d for d in deps if d.startswith("construct")]
    assert [d for d in dev if d.startswith("construct")]
    assert (ROOT / "dcp" / "py.typed").is_file()
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["dcp"]
