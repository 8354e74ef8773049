"""The TLS listener (``tls_port``): the same protocol as the plaintext port, over TLS;
mutual TLS with ``tls_ca``; handshakes that fail or stall cost nobody else anything."""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

import pytest
import trio
import trustme

from dcp.producer.config import ConfigError
from dcp.producer.server import DcpServer
from dcp.protocol import Opcode, Status, codec
from tests.producer.wire import WireClient
from tests.security.conftest import Pki, make_pki, open_tls, tls_config, tls_server


async def _version(client: WireClient) -> bytes:
    r = await client.call(codec.request(Opcode.VERSION, opaque=7), 7)
    assert r.status == Status.SUCCESS
    return bytes(r.value)


async def _wait_no_connections(server: DcpServer, timeout: float) -> None:
    with trio.fail_after(timeout):
        while server.connections:
            await trio.sleep(0.02)


async def test_tls_port_serves_the_protocol_and_plaintext_still_works(
    tmp_path: Path, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "dcp.server")
    async with tls_server(tmp_path / "d", pki) as server:
        assert server.tls_port and server.tls_port != server.port
        assert f"tls_port={server.tls_port}" in caplog.text
        stream = await open_tls(server.tls_port, pki.client_context())
        tls_client = WireClient(stream, 4)  # type: ignore[arg-type]
        try:
            assert stream.version() in ("TLSv1.2", "TLSv1.3")
            await tls_client.set(b"k", b"over tls")
            plain = await WireClient.connect(server.port)
            try:
                r = await plain.call(
                    codec.request(Opcode.GET, vbucket=plain.vb(b"k"), key=b"k", opaque=9), 9
                )
                assert r.status == Status.SUCCESS and bytes(r.value) == b"over tls"
                assert await _version(plain) == await _version(tls_client)
            finally:
                await plain.aclose()
        finally:
            await tls_client.aclose()


async def test_plaintext_bytes_on_the_tls_port_close_that_connection_only(
    tmp_path: Path, pki: Pki
) -> None:
    async with tls_server(tmp_path / "d", pki, tls_handshake_timeout=30.0) as server:
        good = WireClient(await open_tls(server.tls_port, pki.client_context()), 4)  # type: ignore[arg-type]
        raw = await trio.open_tcp_stream("127.0.0.1", server.tls_port)
        try:
            await raw.send_all(codec.hello("plain", []))  # a memcached frame, not a ClientHello
            with trio.fail_after(5):
                while await raw.receive_some(4096):
                    pass  # (a TLS alert may come first) then EOF
            assert await _version(good)
        finally:
            await raw.aclose()
            await good.aclose()
        await _wait_no_connections(server, 5)


async def test_stalled_handshake_is_dropped_after_the_timeout(
    tmp_path: Path, pki: Pki, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "dcp.server")
    async with tls_server(tmp_path / "d", pki, tls_handshake_timeout=0.5) as server:
        stalled = await trio.open_tcp_stream("127.0.0.1", server.tls_port)
        # half a ClientHello: a record header promising more than is sent
        await stalled.send_all(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
        started = trio.current_time()
        try:
            with trio.fail_after(10):
                while server.connections:
                    await trio.sleep(0.02)
            assert trio.current_time() - started >= 0.3  # not before the timeout
            with trio.fail_after(5):
                assert await stalled.receive_some(4096) == b""  # closed by the server
            # the listener is fine: a real client is served
            good = WireClient(await open_tls(server.tls_port, pki.client_context()), 4)  # type: ignore[arg-type]
            try:
                assert await _version(good)
            finally:
                await good.aclose()
        finally:
            await stalled.aclose()
    assert "TLS handshake timed out" in caplog.text


async def test_mutual_tls_requires_a_certificate_the_ca_signed(tmp_path: Path, pki: Pki) -> None:
    async with tls_server(tmp_path / "d", pki, tls_ca=str(pki.ca_file)) as server:
        signed = pki.ca.issue_cert("client@example")
        ok = WireClient(  # type: ignore[arg-type]
            await open_tls(server.tls_port, pki.client_context(client_cert=signed)), 4
        )
        try:
            assert await _version(ok)
        finally:
            await ok.aclose()

        other_ca = trustme.CA()
        for cert in (None, other_ca.issue_cert("intruder@example")):
            with pytest.raises((trio.BrokenResourceError, EOFError)):
                stream = await open_tls(server.tls_port, pki.client_context(client_cert=cert))
                # with TLS 1.3 the server's verdict arrives after the client's handshake
                client = WireClient(stream, 4)  # type: ignore[arg-type]
                try:
                    await _version(client)
                finally:
                    await client.aclose()
        await _wait_no_connections(server, 5)


async def test_bad_certificate_files_stop_the_server_before_it_listens(
    tmp_path: Path, pki: Pki
) -> None:
    cfg = tls_config(tmp_path / "d", pki)
    cfg.tls_port = 1
    cfg.tls_key = str(tmp_path / "missing.key")
    with pytest.raises(ConfigError, match="tls_cert/tls_key"):
        DcpServer(cfg)
    cfg = tls_config(tmp_path / "d", pki, tls_ca=str(pki.key_file))
    cfg.tls_port = 1
    with pytest.raises(ConfigError, match="tls_ca"):
        DcpServer(cfg)
    assert not (tmp_path / "d").exists()  # nothing was opened


async def test_reload_tls_rotates_the_certificate_for_new_connections(
    tmp_path: Path, pki: Pki
) -> None:
    async with tls_server(tmp_path / "d", pki) as server:
        old_ctx = pki.client_context()
        before = WireClient(await open_tls(server.tls_port, old_ctx), 4)  # type: ignore[arg-type]
        try:
            new = make_pki(tmp_path / "new")
            server.config.tls_cert = str(new.cert_file)
            server.config.tls_key = str(new.key_file)
            server.reload_tls()
            after = WireClient(await open_tls(server.tls_port, new.client_context()), 4)  # type: ignore[arg-type]
            try:
                assert await _version(after)
            finally:
                await after.aclose()
            with pytest.raises(trio.BrokenResourceError) as info:
                await open_tls(server.tls_port, old_ctx)  # the old CA no longer matches
            assert isinstance(info.value.__cause__, ssl.SSLCertVerificationError)
            assert await _version(before)  # an open connection keeps its session

            server.config.tls_key = str(tmp_path / "missing.key")
            with pytest.raises(ConfigError):
                server.reload_tls()  # bad files: the current certificate stays
            again = WireClient(await open_tls(server.tls_port, new.client_context()), 4)  # type: ignore[arg-type]
            await again.aclose()
        finally:
            await before.aclose()
