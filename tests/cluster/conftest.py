"""The ``cluster`` fixture: real ``dcp-server`` processes on loopback (``nodes.py``),
every one of them killed when the test ends, pass or fail."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from .nodes import Node


class Cluster:
    """Makes nodes under one temporary directory and remembers them for the teardown."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.nodes: list[Node] = []

    def node(self, name: str, num_vbuckets: int, args: Sequence[str] = ()) -> Node:
        n = Node(self.root, name, num_vbuckets, args)
        self.nodes.append(n)
        return n

    def assert_no_crash(self) -> None:
        """No node logged an unhandled exception (a crash or a task that died)."""
        for n in self.nodes:
            tbs = n.tracebacks()
            assert not tbs, f"{n.name} logged {len(tbs)} traceback(s):\n{tbs[0]}"

    def kill_all(self) -> None:
        for n in self.nodes:
            n.kill()


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.kill_all()
