"""The SDK over TLS: ``DcpClient``/``KvClient`` with ``tls=``/``tls_ca=``/``tls_cert=``
(or the environment) against the server's TLS listener; certificate trouble is a
``TlsError`` at once, never retried."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from dcp.consumer import DcpClient, KvClient, RetryTimeoutError, TlsError, UsageError
from dcp.consumer.security import resolve
from tests.security.conftest import Pki, make_pki, tls_server


async def test_kv_and_dcp_over_tls_with_a_ca_file(tmp_path: Path, pki: Pki) -> None:
    async with tls_server(tmp_path / "d", pki) as server:
        async with KvClient(
            "127.0.0.1", server.tls_port, num_vbuckets=4, tls_ca=str(pki.ca_file)
        ) as kv:
            await kv.set_many([(f"k{i}", f"v{i}".encode()) for i in range(50)])
            assert (await kv.get("k7")).value == b"v7"
        got: dict[bytes, bytes] = {}
        async with DcpClient(
            "127.0.0.1", server.tls_port, to_latest=True, tls_ca=str(pki.ca_file)
        ) as client:
            async for batch in client:
                for ev in batch.events:
                    got[bytes(ev.key)] = bytes(ev.value)
        assert got == {f"k{i}".encode(): f"v{i}".encode() for i in range(50)}


async def test_environment_turns_tls_on_and_tls_false_turns_it_off(
    tmp_path: Path, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DCP_TLS_CA", str(pki.ca_file))
    async with tls_server(tmp_path / "d", pki) as server:
        async with KvClient("127.0.0.1", server.tls_port, num_vbuckets=4) as kv:
            await kv.set("a", b"1")
        async with KvClient("127.0.0.1", server.port, num_vbuckets=4, tls=False) as kv:
            assert (await kv.get("a")).value == b"1"
    assert (
        resolve(
            "h", username=None, password=None, mechanism=None, tls=False, tls_ca=None, tls_cert=None
        ).tls
        is None
    )


async def test_untrusted_certificate_is_a_tls_error_not_a_retry(tmp_path: Path, pki: Pki) -> None:
    stranger = make_pki(tmp_path / "other")
    async with tls_server(tmp_path / "d", pki) as server:
        with trio.fail_after(5):  # not retried until the 30 s timeout
            with pytest.raises(TlsError, match="not trusted"):
                async with KvClient(
                    "127.0.0.1", server.tls_port, timeout=30, tls_ca=str(stranger.ca_file)
                ):
                    pass
            with pytest.raises(TlsError, match="not trusted"):
                async with DcpClient(
                    "127.0.0.1", server.tls_port, retry_timeout=30, tls_ca=str(stranger.ca_file)
                ) as client:
                    await client.getone()
            with pytest.raises(TlsError, match="does not speak TLS"):
                async with KvClient("127.0.0.1", server.port, timeout=30, tls_ca=str(pki.ca_file)):
                    pass


async def test_mutual_tls_client_certificate(tmp_path: Path, pki: Pki) -> None:
    cert = pki.ca.issue_cert("sdk-client")
    pem = tmp_path / "client.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(pem))
    async with tls_server(tmp_path / "d", pki, tls_ca=str(pki.ca_file)) as server:
        async with KvClient(
            "127.0.0.1",
            server.tls_port,
            num_vbuckets=4,
            tls_ca=str(pki.ca_file),
            tls_cert=str(pem),
        ) as kv:
            await kv.set("m", b"tls")
        # TLS 1.3: the refusal comes after the client's handshake, often as a bare EOF
        with pytest.raises((TlsError, RetryTimeoutError), match="client certificate"):
            async with KvClient(
                "127.0.0.1", server.tls_port, timeout=1, tls_ca=str(pki.ca_file)
            ) as kv:
                await kv.get("m")
        with pytest.raises((TlsError, RetryTimeoutError), match="client certificate"):
            async with DcpClient(
                "127.0.0.1", server.tls_port, retry_timeout=1, tls_ca=str(pki.ca_file)
            ) as client:
                await client.getone()


def test_bad_tls_arguments_are_usage_errors(tmp_path: Path, pki: Pki) -> None:
    with pytest.raises(UsageError, match="cannot load TLS files"):
        KvClient(tls_ca=str(tmp_path / "missing.pem"))
    with pytest.raises(UsageError, match="not both"):
        DcpClient(tls=pki.client_context(), tls_ca=str(pki.ca_file))
    with pytest.raises(UsageError, match="tls=False"):
        KvClient(tls=False, tls_ca=str(pki.ca_file))


async def test_tls_ingest_and_stream_smoke(tmp_path: Path, pki: Pki) -> None:
    """Many pipelined batches in, every item out with a small flow-control window: TLS
    records split and join frames at every boundary, and nothing is lost or altered."""
    n = 20_000
    value = bytes(range(256)) * 2
    async with tls_server(tmp_path / "d", pki, num_vbuckets=16) as server:
        async with KvClient(
            "127.0.0.1", server.tls_port, num_vbuckets=16, tls_ca=str(pki.ca_file)
        ) as kv:
            for start in range(0, n, 2000):
                await kv.set_many(
                    [(f"key:{i}", value + b"%d" % i) for i in range(start, start + 2000)]
                )
        seen = 0
        async with DcpClient(
            "127.0.0.1",
            server.tls_port,
            to_latest=True,
            buffer_size=256 * 1024,
            tls_ca=str(pki.ca_file),
        ) as client:
            async for batch in client:
                for ev in batch.events:
                    i = int(bytes(ev.key).split(b":")[1])
                    assert bytes(ev.value) == value + b"%d" % i
                    seen += 1
                await client.commit(batch)
        assert seen == n
