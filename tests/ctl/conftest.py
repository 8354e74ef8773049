"""Fixtures: a fresh ``dcp-server`` process per test (it starts in ~0.2 s)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .support import ServerProcess


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path / "data").start()
    try:
        yield srv
    finally:
        srv.kill()
