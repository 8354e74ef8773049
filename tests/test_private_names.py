"""No module of ``dcp`` uses another module's private names.

Rules of this module:
- A name with a leading underscore is private to the module that defines it. The check
  is a small AST walk: it flags ``<expr>._name`` where ``<expr>`` is not ``self``,
  ``cls`` or ``super()`` and ``_name`` is not a dunder, unless the same module defines
  ``_name`` itself (at module level, in a class body or ``__slots__``, or by assigning
  ``self._name``/``cls._name``): classes of one module may work together, classes of
  different modules go through public names. (A name two modules both define is not
  told apart: the check is meant to be simple, not complete.)
- ``ALLOWED`` lists the violations that exist today in files being reworked elsewhere,
  one ``"path: _name"`` entry per module and name. It may only shrink: the test also
  fails when an entry no longer matches anything, so the list stays true.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ALLOWED = frozenset(
    {
        "dcp/producer/cli.py: _exit",  # os._exit: the documented way out after a fork/signal
    }
)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_names(tree: ast.AST) -> set[str]:
    """Names the module defines: defs, classes, assigned names, ``self._x``, __slots__."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            out.add(node.attr)
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
        ):
            out.update(
                c.value
                for c in ast.walk(node.value)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            )
    return out


def _is_own_object(expr: ast.expr) -> bool:
    if isinstance(expr, ast.Name):
        return expr.id in ("self", "cls")
    return (
        isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "super"
    )


def violations(source: str) -> list[tuple[int, str]]:
    """(line, private name) of every use of another module's private name in ``source``."""
    tree = ast.parse(source)
    own = _own_names(tree)
    out = [
        (node.lineno, node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and _is_private(node.attr)
        and not _is_own_object(node.value)
        and node.attr not in own
    ]
    return sorted(out)


def scan(root: Path = ROOT) -> dict[str, list[int]]:
    """``"path: _name"`` -> lines, over every module of ``dcp``."""
    found: dict[str, list[int]] = {}
    for path in sorted((root / "dcp").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for line, name in violations(path.read_text(encoding="utf-8")):
            found.setdefault(f"{rel}: {name}", []).append(line)
    return found


def test_no_module_uses_another_modules_private_names() -> None:
    found = scan()
    new = {k: v for k, v in found.items() if k not in ALLOWED}
    assert not new, (
        "private names of other modules used (make them public or move "
        "the code to their owner):\n"
        + "\n".join(f"{k} (line {', '.join(map(str, v))})" for k, v in sorted(new.items()))
    )


def test_the_allowlist_only_names_violations_that_still_exist() -> None:
    gone = sorted(ALLOWED - scan().keys())
    assert not gone, "fixed: remove from ALLOWED in tests/test_private_names.py:\n" + "\n".join(
        gone
    )


def test_the_check_flags_foreign_private_names_only() -> None:
    src = """
import os


class Record:
    __slots__ = ("_slot",)


class Owner:
    def __init__(self):
        self._mine = 1

    def use(self, other, rec):
        super()._parent_hook()
        self.helper._sub = 2       # an attribute of another object: flagged
        os._exit(0)                # flagged: os defines _exit, not this module
        rec._slot                  # defined here (__slots__)
        other._mine                # defined here (self._mine)
        other.__class__            # dunder
        return cls._cache, _module_level

_module_level = Owner()._mine
"""
    assert violations(src) == [(15, "_sub"), (16, "_exit")]
