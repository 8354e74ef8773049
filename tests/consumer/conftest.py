"""Fixtures of the consumer SDK tests: a fake producer per test, client factories."""

from __future__ import annotations

import pytest

from dcp.consumer import DcpClient

from .fake_producer import FakeProducer


@pytest.fixture
async def producer():
    async with FakeProducer() as p:
        yield p


def make_client(p: FakeProducer, **kw) -> DcpClient:
    kw.setdefault("noop_interval", None)
    kw.setdefault("retry_timeout", 10.0)
    return DcpClient("127.0.0.1", p.port, **kw)


async def drain(client: DcpClient) -> list:
    """Every item until the client finishes (to_latest)."""
    return [item async for item in client]
