"""How the engine's modules depend on each other and on dcp/protocol/layout.py.

- No import inside a function: a lazy import hides a dependency (storage and compaction
  used to import each other that way); ``if TYPE_CHECKING:`` imports are module level.
- storage.py and compaction.py do not import each other at all: the LMDB half of
  compaction is storage's (lmdb_compaction.py), the policy is compaction.py's.
- Wire layouts are dcp/protocol/layout.py's: no engine module spells the 24-byte header
  format itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

from dcp.protocol.layout import HEADER
from tests.test_layering import imports_of

ENGINE = Path(__file__).resolve().parents[2] / "dcp" / "producer" / "engine"


def _modules() -> dict[str, ast.Module]:
    return {p.name: ast.parse(p.read_text(encoding="utf-8")) for p in sorted(ENGINE.glob("*.py"))}


def test_no_engine_module_imports_inside_a_function() -> None:
    lazy = []
    for name, tree in _modules().items():
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lazy.extend(
                    f"{name}:{n.lineno}"
                    for n in ast.walk(fn)
                    if isinstance(n, (ast.Import, ast.ImportFrom))
                )
    assert not lazy


def test_storage_and_compaction_do_not_import_each_other() -> None:
    src = {n: (ENGINE / n).read_text(encoding="utf-8") for n in ("storage.py", "compaction.py")}
    pkg = "dcp.producer.engine"
    assert f"{pkg}.compaction" not in imports_of(src["storage.py"], f"{pkg}.storage")
    assert f"{pkg}.storage" not in imports_of(src["compaction.py"], f"{pkg}.compaction")


def test_no_engine_module_spells_the_wire_header_layout() -> None:
    header = HEADER.format.lstrip(">!")
    spelled = [
        f"{name}:{n.lineno}"
        for name, tree in _modules().items()
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and header in n.value
    ]
    assert not spelled
