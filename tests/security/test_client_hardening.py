"""Client-side review fixes of issue 18: PLAIN never in clear to another machine, the SCRAM
key derivation off the event loop with a lower iteration cap, dcpctl checking each
node's certificate against that node's name, KvClient not leaking a connection per
failed re-login, and the replication TLS context rebuilt on SIGHUP."""

from __future__ import annotations

import argparse
import base64
from pathlib import Path

import pytest
import trio
import trustme

from dcp.consumer import KvClient
from dcp.consumer.errors import UsageError
from dcp.consumer.security import Credentials, Security, check_plain
from dcp.ctl.access import resolve as ctl_resolve
from dcp.ctl.output import CtlError
from dcp.ctl.remote import Remote
from dcp.producer.server import DcpServer, ServerConfig
from dcp.producer.users import add_user, remove_user
from dcp.protocol.errors import AuthenticationError
from dcp.protocol.sasl import MAX_CLIENT_ITERATIONS, SaslClient
from tests.security.conftest import Pki, tls_server

NVB = 4


def _config(data: Path, users: Path) -> ServerConfig:
    return ServerConfig(port=0, data_dir=str(data), num_vbuckets=NVB, users_file=str(users))


# ---------------------------------------------------------------- PLAIN in clear


@pytest.mark.parametrize("host", ["10.1.2.3", "db.example.com", "::ffff:127.0.0.1", "0.0.0.0"])
def test_plain_without_tls_to_another_host_is_refused(host: str) -> None:
    with pytest.raises(UsageError, match="PLAIN password in clear"):
        KvClient(host, 11210, username="u", password="p", mechanism="PLAIN", tls=False)


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "127.3.4.5", "::1"])
def test_plain_to_loopback_is_allowed(host: str) -> None:
    KvClient(host, 11210, username="u", password="p", mechanism="PLAIN", tls=False)


def test_plain_with_tls_or_scram_to_another_host_is_allowed(pki: Pki) -> None:
    KvClient("10.1.2.3", 11210, username="u", password="p", mechanism="PLAIN", tls=True)
    KvClient("10.1.2.3", 11210, username="u", password="p", tls=False)  # SCRAM
    check_plain("10.1.2.3", Credentials("u", "p", "PLAIN"), pki.client_context())


def _ctl_args(**kw: object) -> argparse.Namespace:
    base = dict(
        host="127.0.0.1",
        user="u",
        password="p",
        mechanism="PLAIN",
        tls=False,
        tls_ca=None,
        tls_cert=None,
        tls_key=None,
    )
    return argparse.Namespace(**(base | kw))


def test_dcpctl_refuses_plain_in_clear_and_a_key_without_a_certificate(tmp_path: Path) -> None:
    with pytest.raises(CtlError, match="PLAIN password in clear") as err:
        ctl_resolve(_ctl_args(host="10.1.2.3"))
    assert err.value.code == 2
    ctl_resolve(_ctl_args())  # loopback: fine
    with pytest.raises(CtlError, match="--tls-key needs --tls-cert") as err:
        ctl_resolve(_ctl_args(tls_key=str(tmp_path / "k.pem")))
    assert err.value.code == 2


async def test_dcpctl_refuses_plain_in_clear_to_another_node() -> None:
    sec = Security(Credentials("u", "p", "PLAIN"), None, "127.0.0.1")
    with pytest.raises(CtlError, match="PLAIN password in clear"):
        async with Remote("10.1.2.3", 11210, 1.0, sec):
            pass


# ---------------------------------------------------------------- SCRAM derivation


def test_the_client_refuses_more_than_a_million_iterations() -> None:
    client = SaslClient("SCRAM-SHA256", "u", "p", nonce_source=lambda n: b"\x01" * n)
    nonce = base64.b64encode(b"\x01" * 18) + b"server"
    salt = base64.b64encode(b"salt").decode()
    too_many = b"r=%s,s=%s,i=%d" % (nonce, salt.encode(), MAX_CLIENT_ITERATIONS + 1)
    client.start()
    with pytest.raises(AuthenticationError, match="iterations"):
        client.step(too_many)
    assert MAX_CLIENT_ITERATIONS == 1_000_000
    client = SaslClient("SCRAM-SHA256", "u", "p", nonce_source=lambda n: b"\x01" * n)
    client.start()
    client.step(b"r=%s,s=%s,i=%d" % (nonce, salt.encode(), 10))


async def test_the_scram_derivation_does_not_stall_the_event_loop(tmp_path: Path) -> None:
    """A login at a million SHA-512 rounds takes about a second of PBKDF2 on the client:
    in a worker thread, so a ticker on the same event loop keeps ticking."""
    users = tmp_path / "users.toml"
    add_user(users, "slow", ["read"], "pw", iterations=MAX_CLIENT_ITERATIONS)
    cfg = ServerConfig(
        port=0, data_dir=str(tmp_path / "d"), num_vbuckets=NVB, users_file=str(users)
    )
    gaps: list[float] = []
    async with DcpServer(cfg) as srv:
        done = trio.Event()

        async def tick() -> None:
            last = trio.current_time()
            while not done.is_set():
                await trio.sleep(0.01)
                now = trio.current_time()
                gaps.append(now - last)
                last = now

        async with trio.open_nursery() as nursery:
            nursery.start_soon(tick)
            start = trio.current_time()
            async with KvClient(
                "127.0.0.1", srv.port, num_vbuckets=NVB, username="slow", password="pw", timeout=60
            ) as kv:
                assert await kv.get_many(["missing"]) == {}
            took = trio.current_time() - start
            done.set()
    assert took > 0.5  # the derivation really ran (else the check below proves nothing)
    assert max(gaps) < took / 2, (max(gaps), took)


# ---------------------------------------------------------------- dcpctl and TLS names


async def test_each_node_is_checked_against_its_own_name(tmp_path: Path, pki: Pki) -> None:
    """``Remote.of(args, host=node)`` keeps ``--host``'s Security: the certificate must be
    checked against ``node``, not against ``--host``."""
    async with tls_server(tmp_path / "data", pki) as srv:
        sec = Security(None, pki.client_context(), server_hostname="other-node.example")
        async with Remote("127.0.0.1", srv.tls_port, 5.0, sec) as r:
            assert await r.num_vbuckets() == NVB
        async with Remote("localhost", srv.tls_port, 5.0, sec) as r:
            assert await r.num_vbuckets() == NVB


# ---------------------------------------------------------------- KvClient re-login


async def test_a_failed_relogin_leaves_no_connection_behind(tmp_path: Path) -> None:
    users = tmp_path / "users.toml"
    add_user(users, "app", ["read"], "pw", iterations=300)
    add_user(users, "other", ["read"], "pw", iterations=300)
    cfg = ServerConfig(
        port=0, data_dir=str(tmp_path / "d"), num_vbuckets=NVB, users_file=str(users)
    )
    async with DcpServer(cfg) as srv:
        async with KvClient(
            "127.0.0.1", srv.port, num_vbuckets=NVB, username="app", password="pw", timeout=5
        ) as kv:
            assert await kv.get_many(["k"]) == {}
            remove_user(users, "app")
            assert srv.authenticator is not None and srv.authenticator.reload()  # closes it
            for _ in range(2):  # each call reconnects and is refused
                with pytest.raises(AuthenticationError):
                    await kv.get_many(["k"])
            with trio.fail_after(5):
                while srv.connections:  # the refused connections were closed by the client
                    await trio.sleep(0.02)


# ---------------------------------------------------------------- replication TLS reload


async def test_sighup_rebuilds_the_replication_tls_context(tmp_path: Path, pki: Pki) -> None:
    """The replica trusts another CA at first (its source's certificate is refused);
    the CA file is replaced and ``reload_tls`` (SIGHUP) runs: replication connects."""
    trusted = tmp_path / "replication-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(trusted))  # not the source's CA
    async with tls_server(tmp_path / "a", pki) as a:
        async with KvClient("127.0.0.1", a.port, num_vbuckets=NVB) as kv:
            await kv.set_many([(f"k{i}", b"v") for i in range(50)])
        cfg = ServerConfig(
            port=0,
            data_dir=str(tmp_path / "b"),
            num_vbuckets=NVB,
            replica_of=f"127.0.0.1:{a.tls_port}",
            replication_tls=True,
            replication_tls_ca=str(trusted),
        )
        async with DcpServer(cfg) as b:

            def caught_up() -> bool:
                return all(
                    b.bucket.vbucket(v).high_seqno == a.bucket.vbucket(v).high_seqno
                    for v in range(NVB)
                )

            await trio.sleep(1.0)
            assert not caught_up()  # the source's certificate is not trusted yet
            pki.ca.cert_pem.write_to_path(str(trusted))
            b.reload_tls()
            with trio.fail_after(20):
                while not caught_up():
                    await trio.sleep(0.05)
