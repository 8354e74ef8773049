from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dcp.producer.server import DcpServer, ServerConfig

from .wire import WireClient


@contextlib.asynccontextmanager
async def running_server(data_dir: Path, **overrides: Any) -> AsyncIterator[DcpServer]:
    cfg = ServerConfig(
        port=0, data_dir=str(data_dir), num_vbuckets=overrides.pop("num_vbuckets", 4), **overrides
    )
    async with DcpServer(cfg) as server:
        yield server


@contextlib.asynccontextmanager
async def client_of(server: DcpServer) -> AsyncIterator[WireClient]:
    c = await WireClient.connect(server.port, server.bucket.num_vbuckets)
    try:
        yield c
    finally:
        await c.aclose()


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[DcpServer]:
    async with running_server(tmp_path / "data") as srv:
        yield srv


@pytest.fixture
async def client(server: DcpServer) -> AsyncIterator[WireClient]:
    async with client_of(server) as c:
        yield c
