"""Users in etcd (``users_etcd``) against a real etcd: written by ``dcpctl user add
--etcd``, loaded at start, followed while the server runs (added, changed and removed
users applied like a SIGHUP reload), an etcd silent at start refuses the start in one
line, an etcd that goes away later keeps the last users (logged once), a bad record
keeps the previous users."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from dcp.consumer import KvClient
from dcp.producer.cluster.store import EtcdStore
from dcp.producer.server import DcpServer, ServerConfig
from dcp.producer.users import UsersFileError
from dcp.producer.users_etcd import delete_user, put_user
from dcp.protocol.errors import AccessDenied, AuthenticationError
from tests.ctl.support import DCPCTL

from .conftest import EtcdProcess, free_port

NVB = 4
ROOT = Path(__file__).resolve().parents[2]


def _config(data: Path, endpoint: str, prefix: str) -> ServerConfig:
    return ServerConfig(
        port=0,
        data_dir=str(data),
        num_vbuckets=NVB,
        users_etcd=endpoint,
        users_etcd_prefix=prefix,
        auth_timeout=30,
    )


async def _can_write(port: int, user: str, password: str) -> bool:
    """True: logged in and SET; False: the login was refused; AccessDenied propagates."""
    try:
        async with KvClient(
            "127.0.0.1", port, num_vbuckets=NVB, username=user, password=password, timeout=5
        ) as kv:
            await kv.set("k", b"v")
            return True
    except AuthenticationError:
        return False


async def _eventually(check: Callable[[], object], timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not await check():  # type: ignore[misc]
            await trio.sleep(0.1)


@pytest.fixture
def prefix(cluster_name: str) -> str:
    return f"/{cluster_name}/users/"


def test_dcpctl_writes_and_removes_users_in_etcd(etcd_server: EtcdProcess, prefix: str) -> None:
    def user(*args: str, password: str = "") -> subprocess.CompletedProcess[str]:
        cmd = [*DCPCTL, "user", *args, "--etcd", etcd_server.endpoint, "--etcd-prefix", prefix]
        return subprocess.run(
            cmd, input=password + "\n", capture_output=True, text=True, timeout=60, cwd=ROOT
        )

    r = user("add", "app", "--role", "read,write", password="s3cret-pw")
    assert r.returncode == 0, r.stderr
    assert "saved in etcd" in r.stdout

    async def stored() -> bytes | None:
        store = EtcdStore(etcd_server.endpoint)
        try:
            entry = await store.get(prefix + "app")
            return None if entry is None else entry.value
        finally:
            await store.aclose()

    value = trio.run(stored)
    assert value is not None and b'"roles": ["read", "write"]' in value
    assert b"s3cret-pw" not in value and b"stored_key" in value  # keys, never the password
    assert user("remove", "app").returncode == 0
    assert trio.run(stored) is None
    r = user("remove", "app")
    assert r.returncode == 1 and "no user 'app'" in r.stderr


async def test_users_are_loaded_and_followed(tmp_path: Path, etcd_server: EtcdProcess, prefix):
    store = EtcdStore(etcd_server.endpoint)
    try:
        await put_user(store, prefix, "app", ["read", "write"], "pw1", iterations=500)
        async with DcpServer(_config(tmp_path / "d", etcd_server.endpoint, prefix)) as srv:
            assert await _can_write(srv.port, "app", "pw1")
            assert not await _can_write(srv.port, "late", "pw2")
            await put_user(store, prefix, "late", ["write"], "pw2", iterations=500)
            await _eventually(lambda: _can_write(srv.port, "late", "pw2"))
            # a new password and fewer privileges, then the user removed
            async with KvClient(
                "127.0.0.1", srv.port, num_vbuckets=NVB, username="app", password="pw1"
            ) as kv:
                await put_user(store, prefix, "app", ["read"], "pw3", iterations=500)

                async def refused() -> bool:
                    try:
                        await kv.set("k", b"v")
                    except AccessDenied:
                        return True
                    return False

                await _eventually(refused)  # its open connection lost 'write' at once
            assert not await _can_write(srv.port, "app", "pw1")  # the old password is gone
            assert await delete_user(store, prefix, "late")
            await _eventually(lambda: _negated(_can_write(srv.port, "late", "pw2")))
    finally:
        await store.aclose()


async def _negated(check) -> bool:
    return not await check


def test_an_etcd_that_does_not_answer_refuses_the_start(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "dcp.producer", "--port", "0", "--data-dir", str(tmp_path)]
    cmd += ["--users-etcd", endpoint, "--num-vbuckets", "4"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("dcp-server:")]
    assert len(lines) == 1 and "refusing to start" in lines[0] and endpoint in lines[0], r.stderr
    assert "Traceback" not in r.stderr


async def test_a_bad_record_at_start_is_a_users_error(tmp_path: Path, etcd_server, prefix):
    store = EtcdStore(etcd_server.endpoint)
    try:
        await store.put(prefix + "broken", b"{not json")
        with pytest.raises(UsersFileError, match="broken"):
            async with DcpServer(_config(tmp_path / "d", etcd_server.endpoint, prefix)):
                pass
    finally:
        await store.aclose()


async def test_etcd_away_keeps_the_last_users_and_a_bad_record_keeps_the_previous(
    tmp_path: Path, etcd_factory: Callable[[], EtcdProcess], prefix: str, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="dcp.auth")
    etcd = etcd_factory()
    store = EtcdStore(etcd.endpoint)
    try:
        await put_user(store, prefix, "app", ["write"], "pw", iterations=500)
        async with DcpServer(_config(tmp_path / "d", etcd.endpoint, prefix)) as srv:
            await store.put(prefix + "broken", b"{not json")
            await trio.sleep(1.5)  # polled: refused, the previous users stay
            assert await _can_write(srv.port, "app", "pw")
            assert any("not applied" in r.getMessage() for r in caplog.records)
            await store.delete(prefix + "broken")
            etcd.stop()
            await trio.sleep(7)  # several polls fail meanwhile
            assert await _can_write(srv.port, "app", "pw")  # the last users stay
            lost = [r for r in caplog.records if "cannot read the users" in r.getMessage()]
            assert len(lost) == 1  # logged once, not at every poll
            etcd.start()
            await put_user(store, prefix, "after", ["write"], "pw", iterations=500)
            await _eventually(lambda: _can_write(srv.port, "after", "pw"), timeout=20)
    finally:
        await store.aclose()
