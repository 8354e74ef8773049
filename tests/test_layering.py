"""Imports point down only (STYLE.md): protocol and engine are leaves, the consumer never
imports the producer, and the protocol layer has no I/O."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "dcp"

FORBIDDEN = {
    "protocol": ("trio", "socket", "lmdb", "time", "asyncio", "dcp.producer", "dcp.consumer"),
    "producer/engine": ("trio", "socket", "time", "asyncio", "dcp.consumer"),
    "consumer": ("dcp.producer", "lmdb"),
    "spark": ("dcp.producer",),
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    pkg = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts[:-1])
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
    return out


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_point_down_only(layer: str) -> None:
    base = ROOT / layer
    if not base.exists():
        pytest.skip(f"{layer} not present yet")
    bad = []
    for path in base.rglob("*.py"):
        for mod in _imports(path):
            for forbidden in FORBIDDEN[layer]:
                if mod == forbidden or mod.startswith(forbidden + "."):
                    bad.append(f"{path.relative_to(ROOT.parent)} imports {mod}")
    assert not bad, "\n".join(bad)
