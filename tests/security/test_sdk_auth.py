"""The SDK against a server with a users file: the right password works for KV and DCP
(blocking facades and the environment too), a wrong one is an ``AuthenticationError``
at once, naming user and mechanism, never retried; no credentials is ``AccessDenied``
with a hint."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from dcp.consumer import (
    AccessDenied,
    AuthenticationError,
    BlockingKvClient,
    DcpClient,
    KvClient,
)
from dcp.producer.server import DcpServer, ServerConfig
from dcp.producer.users import add_user
from tests.security.conftest import Pki, tls_server


def _users(tmp_path: Path) -> Path:
    path = tmp_path / "users.toml"
    add_user(path, "app", ["read", "write", "stream", "stats"], "app-pw", iterations=500)
    add_user(path, "writer", ["write"], "w-pw", iterations=500)
    return path


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[DcpServer]:
    cfg = ServerConfig(
        port=0, data_dir=str(tmp_path / "d"), num_vbuckets=4, users_file=str(_users(tmp_path))
    )
    async with DcpServer(cfg) as srv:
        yield srv


async def _stream(port: int, **kw: object) -> dict[bytes, bytes]:
    got: dict[bytes, bytes] = {}
    async with DcpClient("127.0.0.1", port, to_latest=True, **kw) as client:  # type: ignore[arg-type]
        async for batch in client:
            for ev in batch.events:
                got[bytes(ev.key)] = bytes(ev.value)
    return got


@pytest.mark.parametrize("mechanism", [None, "SCRAM-SHA256", "PLAIN"])
async def test_right_password_kv_and_dcp(server: DcpServer, mechanism: str | None) -> None:
    creds = {"username": "app", "password": "app-pw", "mechanism": mechanism}
    async with KvClient("127.0.0.1", server.port, num_vbuckets=4, **creds) as kv:  # type: ignore[arg-type]
        await kv.set_many([(f"k{i}", b"v") for i in range(20)])
        assert (await kv.get("k3")).value == b"v"
    assert len(await _stream(server.port, **creds)) == 20


async def test_wrong_password_fails_at_once_and_is_not_retried(
    server: DcpServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    with trio.fail_after(10):  # retry timeouts are 60 s: no retry happens
        with pytest.raises(AuthenticationError, match="user 'app' with SCRAM-SHA512"):
            async with KvClient(
                "127.0.0.1", server.port, timeout=60, username="app", password="bad"
            ):
                pass
        with pytest.raises(AuthenticationError, match="user 'app' with SCRAM-SHA512"):
            await _stream(server.port, username="app", password="bad", retry_timeout=60)
    # one failed attempt per client on the server
    assert caplog.text.count("authentication failed id=") == 2


async def test_no_credentials_or_privilege_is_access_denied(server: DcpServer) -> None:
    with pytest.raises(AccessDenied, match="requires authentication"):
        await _stream(server.port)
    with pytest.raises(AccessDenied):
        await _stream(server.port, username="writer", password="w-pw")
    async with KvClient(
        "127.0.0.1", server.port, num_vbuckets=4, username="writer", password="w-pw"
    ) as kv:
        await kv.set("w", b"1")
        with pytest.raises(AccessDenied):
            await kv.get("w")


async def test_blocking_facade_with_credentials_from_the_environment(
    server: DcpServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DCP_USERNAME", "app")
    monkeypatch.setenv("DCP_PASSWORD", "app-pw")

    def work() -> bytes:
        with BlockingKvClient("127.0.0.1", server.port, num_vbuckets=4) as kv:
            kv.set("env", b"yes")
            return kv.get("env").value

    assert await trio.to_thread.run_sync(work) == b"yes"


async def test_tls_and_scram_together(tmp_path: Path, pki: Pki) -> None:
    async with tls_server(tmp_path / "d", pki, users_file=str(_users(tmp_path))) as srv:
        creds = {"username": "app", "password": "app-pw", "tls_ca": str(pki.ca_file)}
        async with KvClient("127.0.0.1", srv.tls_port, num_vbuckets=4, **creds) as kv:  # type: ignore[arg-type]
            await kv.set("s", b"secret")
        assert await _stream(srv.tls_port, **creds) == {b"s": b"secret"}
