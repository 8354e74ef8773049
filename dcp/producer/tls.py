"""The TLS listener's parts: the server's ``ssl.SSLContext`` and the handshake that must
finish before a TLS connection is served.

Rules of this module:
- ``server_context`` builds the context from the settings (``tls_cert``, ``tls_key``;
  ``tls_ca`` turns on mutual TLS: a client certificate signed by that CA is required).
  A file that cannot be read or is not a certificate/key raises ``ConfigError`` naming
  the setting, so a bad setting stops the server before it listens, and a rotation
  (``DcpServer.reload_tls``) keeps the old context when the new files are bad.
- ``handshake`` runs in the connection's own task (never in the accept loop, which must
  not wait for one client), bounded by ``tls_handshake_timeout``: a client that connects
  and stalls, or that sends garbage, is dropped and logged, and other clients never
  notice. Only a finished handshake gives the connection its TLS stream; from then on
  the connection runs the same ``Connection`` code as a plaintext one.
- The streams are ``trio.SSLStream`` over the standard ``ssl`` module: no hand-written
  record layer.
- ``TlsContexts`` holds the server's two contexts: the listener's (read at each accept)
  and the replication connections' (read at each connect). ``reload`` (SIGHUP) rebuilds
  both from their files, so a rotated certificate or CA serves the next connection; when
  a file is bad it raises ``ConfigError`` and both current contexts stay.
"""

from __future__ import annotations

import logging
import ssl
from typing import TYPE_CHECKING

import trio

from .config import ConfigError, ServerConfig

if TYPE_CHECKING:
    from .connection import Connection

__all__ = [
    "TlsContexts",
    "handshake",
    "is_tls",
    "peer_subject",
    "replication_context",
    "server_context",
]

log = logging.getLogger("dcp.server")


def server_context(cfg: ServerConfig) -> ssl.SSLContext:
    """The TLS listener's context (see the module rules). TLS 1.2 at least."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"tls_cert/tls_key: cannot load {cfg.tls_cert!r} with key {cfg.tls_key!r}: {exc}"
        ) from exc
    if cfg.tls_ca:
        try:
            ctx.load_verify_locations(cafile=cfg.tls_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"tls_ca: cannot load {cfg.tls_ca!r}: {exc}") from exc
        ctx.verify_mode = ssl.CERT_REQUIRED
    else:
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def replication_context(cfg: ServerConfig) -> ssl.SSLContext:
    """The context of this node's replication connections (``replication_tls``): the
    sources' certificates are verified against ``replication_tls_ca`` (empty: the
    system's CAs), and the node's own ``tls_cert``/``tls_key``, when set, are its client
    certificate for sources that require one (mutual TLS)."""
    try:
        ctx = ssl.create_default_context(cafile=cfg.replication_tls_ca or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"replication_tls_ca: cannot load {cfg.replication_tls_ca!r}: {exc}"
        ) from exc
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cfg.tls_cert and cfg.tls_key:
        try:
            ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"tls_cert/tls_key: cannot load {cfg.tls_cert!r}: {exc}") from exc
    return ctx


class TlsContexts:
    """The server's TLS contexts (see the module rules); None where that TLS is off."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.listener = server_context(cfg) if cfg.tls_port else None
        self.replication = replication_context(cfg) if cfg.replication_tls else None

    def current_listener(self) -> ssl.SSLContext:
        assert self.listener is not None
        return self.listener

    def current_replication(self) -> ssl.SSLContext:
        assert self.replication is not None
        return self.replication

    def reload(self) -> None:
        """Rebuild both contexts from their files (``ConfigError``: neither changes)."""
        listener = server_context(self.cfg) if self.listener is not None else None
        replication = replication_context(self.cfg) if self.replication is not None else None
        if listener is not None:
            self.listener = listener
            log.info("TLS certificate reloaded from %s", self.cfg.tls_cert)
        if replication is not None:
            self.replication = replication
            log.info("replication TLS context reloaded (CA %s)", self.cfg.replication_tls_ca)

    def describe(self, port: int) -> str:
        """The TLS listener for the 'listening' log line."""
        if not port:
            return "off"
        return f"{port} (client certificates required)" if self.cfg.tls_ca else str(port)


def is_tls(stream: trio.abc.Stream) -> bool:
    """Whether ``stream`` is encrypted (e.g. PLAIN may only be used over TLS or loopback)."""
    return isinstance(stream, trio.SSLStream)


def peer_subject(stream: trio.abc.Stream) -> str:
    """The client certificate's common name ("" without one): for log lines."""
    if not isinstance(stream, trio.SSLStream):
        return ""
    cert = stream.getpeercert()
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return ""


async def handshake(conn: Connection, ctx: ssl.SSLContext, timeout: float) -> bool:
    """Wrap ``conn.stream`` in TLS and finish the handshake within ``timeout`` seconds.
    True: ``conn.stream`` is now the TLS stream. False: the handshake failed or stalled;
    the caller closes the connection (``conn.close_reason`` says why)."""
    # https_compatible: a client that closes its socket without a close_notify is seen as
    # a plain EOF. Truncation cannot hide in this protocol: every frame carries its
    # length, so a cut frame is still an incomplete frame.
    tls = trio.SSLStream(conn.stream, ctx, server_side=True, https_compatible=True)
    with trio.move_on_after(timeout):
        try:
            await tls.do_handshake()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            cause = exc.__cause__ or exc
            conn.close_reason = f"TLS handshake failed: {cause}"
            log.info("TLS handshake failed id=%d peer=%s: %s", conn.id, conn.peer, cause)
            return False
        # Connection is typed for the socket it was accepted with (its peer name comes
        # from there); from here on it only sends and receives, which any stream does
        conn.stream = tls  # type: ignore[assignment]
        log.debug(
            "TLS connection id=%d peer=%s %s %s client=%s",
            conn.id,
            conn.peer,
            tls.version(),
            (tls.cipher() or ("?",))[0],
            peer_subject(tls) or "-",
        )
        return True
    conn.close_reason = f"TLS handshake not done within tls_handshake_timeout={timeout:g} s"
    log.info(
        "TLS handshake timed out id=%d peer=%s after %g s: closed", conn.id, conn.peer, timeout
    )
    return False
