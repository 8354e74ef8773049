"""Replication between two in-process servers with authentication on both: the replica
authenticates to its source as the internal user (``replication_user``), over plain TCP
or TLS (``replication_tls``); a wrong password replicates nothing and says why."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio

from dcp.consumer import KvClient, SyncWriteAmbiguous
from dcp.producer.server import DcpServer, ServerConfig
from dcp.producer.users import add_user
from tests.security.conftest import Pki, tls_server

NVB = 4


def _users(path: Path) -> Path:
    add_user(path, "app", ["read", "write"], "app-pw", iterations=500)
    add_user(path, "repl", ["stream", "replicate"], "repl-pw", iterations=500)
    return path


def _config(data: Path, users: Path, **kw: object) -> ServerConfig:
    return ServerConfig(port=0, data_dir=str(data), num_vbuckets=NVB, users_file=str(users), **kw)  # type: ignore[arg-type]


async def _write(port: int, n: int, **kw: object) -> None:
    async with KvClient(
        "127.0.0.1", port, num_vbuckets=NVB, username="app", password="app-pw", **kw
    ) as kv:  # type: ignore[arg-type]
        await kv.set_many([(f"k{i}", b"v%d" % i) for i in range(n)])


async def _caught_up(a: DcpServer, b: DcpServer, timeout: float = 15.0) -> None:
    with trio.fail_after(timeout):
        while any(
            b.bucket.vbucket(v).high_seqno != a.bucket.vbucket(v).high_seqno for v in range(NVB)
        ):
            await trio.sleep(0.02)


async def test_replica_authenticates_as_the_internal_user(tmp_path: Path) -> None:
    users = _users(tmp_path / "users.toml")
    async with DcpServer(_config(tmp_path / "a", users)) as a:
        await _write(a.port, 100)
        cfg_b = _config(
            tmp_path / "b",
            users,
            replica_of=f"127.0.0.1:{a.port}",
            replication_user="repl",
            replication_password="repl-pw",
        )
        async with DcpServer(cfg_b) as b:
            await _caught_up(a, b)
            await _write(a.port, 150)  # live changes too
            await _caught_up(a, b)
            assert sum(b.bucket.vbucket(v).high_seqno for v in range(NVB)) == 250


async def test_wrong_replication_password_replicates_nothing_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    users = _users(tmp_path / "users.toml")
    async with DcpServer(_config(tmp_path / "a", users)) as a:
        await _write(a.port, 20)
        for user, password in (("repl", "wrong"), ("", "")):
            cfg_b = _config(
                tmp_path / f"b{user}",
                users,
                replica_of=f"127.0.0.1:{a.port}",
                replication_user=user,
                replication_password=password,
            )
            async with DcpServer(cfg_b) as b:
                await trio.sleep(1.0)
                assert all(b.bucket.vbucket(v).high_seqno == 0 for v in range(NVB))
        assert "authentication as 'repl' with SCRAM-SHA512 refused" in caplog.text
        assert "DCP_OPEN refused" in caplog.text  # without a user: EACCESS


async def test_replication_over_tls_with_auth(tmp_path: Path, pki: Pki) -> None:
    users = _users(tmp_path / "users.toml")
    async with tls_server(tmp_path / "a", pki, users_file=str(users)) as a:
        await _write(a.tls_port, 60, tls_ca=str(pki.ca_file))
        cfg_b = _config(
            tmp_path / "b",
            users,
            replica_of=f"127.0.0.1:{a.tls_port}",
            replication_user="repl",
            replication_password="repl-pw",
            replication_tls=True,
            replication_tls_ca=str(pki.ca_file),
        )
        async with DcpServer(cfg_b) as b:
            await _caught_up(a, b)
            # the replica's DCP connection on A is the TLS one
            replica_conns = [c for c in a.connections if c.dcp_name]
            assert replica_conns
            assert all(isinstance(c.stream, trio.SSLStream) for c in replica_conns)


async def test_only_a_replicate_replication_user_releases_majority_writes(tmp_path: Path) -> None:
    """The replica names itself (node_name) with the control consumer_name, which needs
    ``replicate`` on an auth-on source: without it the replica still copies everything
    but its acks do not count, and a MAJORITY write is ambiguous at its deadline."""
    users = _users(tmp_path / "users.toml")
    add_user(users, "stream-only", ["stream"], "so-pw", iterations=500)
    async with DcpServer(_config(tmp_path / "a", users)) as a:
        a.durability.set_topology([("self", "B")] * NVB)
        for user, pw in (("repl", "repl-pw"), ("stream-only", "so-pw")):
            cfg_b = _config(
                tmp_path / f"b-{user}",
                users,
                replica_of=f"127.0.0.1:{a.port}",
                replication_user=user,
                replication_password=pw,
                node_name="B",
            )
            async with DcpServer(cfg_b) as b:
                await _write(a.port, 8)
                await _caught_up(a, b)  # both copy: `stream` is enough for that
                async with KvClient(
                    "127.0.0.1",
                    a.port,
                    num_vbuckets=NVB,
                    username="app",
                    password="app-pw",
                    timeout=1.5,
                ) as kv:
                    if user == "repl":
                        await kv.set("m", b"v", durability="majority")
                        continue
                    with pytest.raises(SyncWriteAmbiguous):
                        await kv.set("m", b"w", durability="majority")
