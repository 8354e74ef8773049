"""Reliability tests: an in-process server for the regression tests (the harness itself is
imported as ``tools.chaos.*``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from dcp.producer.server import DcpServer, ServerConfig


@contextlib.asynccontextmanager
async def running_server(data_dir: Path, **overrides: Any) -> AsyncIterator[DcpServer]:
    """An in-process server on a free loopback port."""
    cfg = ServerConfig(
        host="127.0.0.1",
        port=0,
        data_dir=str(data_dir),
        num_vbuckets=overrides.pop("num_vbuckets", 4),
        **overrides,
    )
    async with DcpServer(cfg) as server:
        yield server
