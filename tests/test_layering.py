"""Import contracts: imports point down only (docs/engine.md, docs/sdk.md).

- ``dcp.protocol`` imports nothing of ours and does no I/O: it is the leaf every other layer
  shares.
- ``dcp.producer.engine`` imports only ``dcp.protocol`` of ours and no trio/socket/time:
  the engine is driven by the server and unit-tested without an event loop.
- ``dcp.consumer`` and ``dcp.spark`` never import ``dcp.producer``: the SDK ships to machines
  that run no server.

Rules of this module: the check is an AST walk over every file of a layer, so an import
counts wherever it is written: at the top, inside a function, or under
``if TYPE_CHECKING:`` (a type-only import is still a dependency a reader and a type checker
must follow). A layer folder that does not exist fails the test (a renamed layer must be
renamed here too, never silently skipped).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "dcp"
_IO = ("trio", "socket", "lmdb", "time", "asyncio", "selectors", "threading")


class Contract:
    """A layer (a folder under dcp/) and what it may not import.

    ``ours_allowed``: when not None, the only ``dcp.*`` packages the layer may import (its
    own package is always allowed). ``forbidden``: modules it may never import.
    """

    def __init__(
        self,
        layer: str,
        *,
        ours_allowed: tuple[str, ...] | None = None,
        forbidden: tuple[str, ...] = (),
    ) -> None:
        self.layer = layer
        self.package = "dcp." + layer.replace("/", ".")
        self.ours_allowed = ours_allowed
        self.forbidden = forbidden

    def violations(self, module: str) -> list[str]:
        out = [f for f in self.forbidden if _within(module, f)]
        if (
            self.ours_allowed is not None
            and _within(module, "dcp")
            and not _within(module, self.package)
            and not any(_within(module, a) for a in self.ours_allowed)
        ):
            out.append(f"ours outside {self.ours_allowed or '(nothing)'}")
        return out

    def __repr__(self) -> str:
        return self.layer


CONTRACTS = [
    Contract("protocol", ours_allowed=(), forbidden=_IO),
    Contract(
        "producer/engine",
        ours_allowed=("dcp.protocol",),
        forbidden=("trio", "socket", "time", "asyncio"),
    ),
    Contract("consumer", forbidden=("dcp.producer", "lmdb")),
    Contract("spark", forbidden=("dcp.producer",)),
]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def imports_of(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module ``source`` (the text of ``module``) imports, absolute, wherever written.

    ``from X import a`` counts both ``X`` and ``X.a`` (``a`` may be a submodule), so
    ``from dcp import producer`` is seen as importing ``dcp.producer``.
    """
    package = module if is_package else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names if a.name != "*")
    return out


def _module_name(path: Path) -> tuple[str, bool]:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


@pytest.mark.parametrize("contract", CONTRACTS, ids=repr)
def test_layer_imports_point_down_only(contract: Contract) -> None:
    base = ROOT / contract.layer
    assert base.is_dir(), f"layer {contract.layer} is gone: update CONTRACTS in this file"
    files = sorted(base.rglob("*.py"))
    assert files, f"layer {contract.layer} has no Python files"
    bad = []
    for path in files:
        name, is_pkg = _module_name(path)
        for mod in sorted(imports_of(path.read_text(), name, is_pkg)):
            for why in contract.violations(mod):
                bad.append(f"{path.relative_to(ROOT.parent)} imports {mod} ({why})")
    assert not bad, "\n".join(bad)


# The checker itself: each contract must be able to fail.

_TYPE_ONLY = """
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from dcp.producer.server import DcpServer
"""


@pytest.mark.parametrize(
    ("contract", "source", "module"),
    [
        (CONTRACTS[0], "from dcp.consumer import x\n", "dcp.protocol.codec"),
        (CONTRACTS[0], "import time\n", "dcp.protocol.codec"),
        (CONTRACTS[0], "from .. import producer\n", "dcp.protocol.codec"),
        (
            CONTRACTS[1],
            "from dcp.producer.config import ServerConfig\n",
            "dcp.producer.engine.bucket",
        ),
        (CONTRACTS[1], "from ..connection import Connection\n", "dcp.producer.engine.bucket"),
        (CONTRACTS[1], "def f():\n    import trio\n", "dcp.producer.engine.bucket"),
        (CONTRACTS[2], _TYPE_ONLY, "dcp.consumer.client"),
        (CONTRACTS[3], _TYPE_ONLY, "dcp.spark.executor"),
    ],
    ids=lambda v: v if isinstance(v, str) and "\n" not in v else None,
)
def test_the_checker_sees_every_kind_of_import(
    contract: Contract, source: str, module: str
) -> None:
    found = [v for mod in imports_of(source, module) for v in contract.violations(mod)]
    assert found, f"{contract.layer} should refuse {source!r}"


@pytest.mark.parametrize(
    ("contract", "source", "module"),
    [
        (CONTRACTS[0], "from .opcodes import Opcode\nimport struct\n", "dcp.protocol.codec"),
        (
            CONTRACTS[1],
            "from dcp.protocol import codec\nfrom .records import Item\n",
            "dcp.producer.engine.bucket",
        ),
        (CONTRACTS[2], "from dcp.protocol import codec\nimport trio\n", "dcp.consumer.client"),
    ],
    ids=["protocol-own", "engine-protocol", "consumer-protocol"],
)
def test_the_checker_allows_what_the_contracts_allow(
    contract: Contract, source: str, module: str
) -> None:
    assert not [v for mod in imports_of(source, module) for v in contract.violations(mod)]
