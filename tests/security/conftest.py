"""Certificates made in the test run (``trustme``) and TLS servers/clients over them.

A test CA signs the server certificate (for 127.0.0.1 and localhost) and client
certificates; nothing is read from outside the test's temporary directory.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme

from dcp.producer.server import DcpServer, ServerConfig


@dataclass
class Pki:
    """Files of one test PKI: the CA and a server certificate it signed."""

    ca: trustme.CA
    ca_file: Path
    cert_file: Path
    key_file: Path
    dir: Path

    def client_context(self, *, client_cert: trustme.LeafCert | None = None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        if client_cert is not None:
            client_cert.configure_cert(ctx)
        return ctx


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    ca_file = directory / "ca.pem"
    cert_file = directory / "server.pem"
    key_file = directory / "server.key"
    ca.cert_pem.write_to_path(str(ca_file))
    leaf.private_key_pem.write_to_path(str(key_file))
    with open(cert_file, "wb") as f:
        for blob in leaf.cert_chain_pems:
            f.write(blob.bytes())
    return Pki(ca, ca_file, cert_file, key_file, directory)


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "pki")


def tls_config(data_dir: Path, pki: Pki, **overrides: Any) -> ServerConfig:
    return ServerConfig(
        port=0,
        tls_port=0,  # replaced below: 0 means "off" in the settings
        data_dir=str(data_dir),
        num_vbuckets=overrides.pop("num_vbuckets", 4),
        tls_cert=str(pki.cert_file),
        tls_key=str(pki.key_file),
        **overrides,
    )


@contextlib.asynccontextmanager
async def tls_server(data_dir: Path, pki: Pki, **overrides: Any) -> AsyncIterator[DcpServer]:
    """A server with a TLS listener on a free port (``server.tls_port``)."""
    cfg = tls_config(data_dir, pki, **overrides)
    cfg.tls_port = _free_port()
    async with DcpServer(cfg) as server:
        yield server


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def open_tls(port: int, ctx: ssl.SSLContext, host: str = "127.0.0.1") -> trio.SSLStream:
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    stream = trio.SSLStream(tcp, ctx, server_hostname=host, https_compatible=True)
    await stream.do_handshake()
    return stream
