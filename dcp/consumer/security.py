"""Client-side security: credentials, TLS, and the SASL exchange after HELLO.

Rules of this module:
- ``resolve`` turns the client's arguments into a ``Security`` once, in the constructor
  (tier-1 errors: ``UsageError``). An argument wins over the environment:
  ``DCP_USERNAME``/``DCP_PASSWORD`` (credentials), ``DCP_TLS_CA`` (CA file: TLS on),
  ``DCP_TLS_CERT``/``DCP_TLS_KEY`` (client certificate for mutual TLS). ``tls=False``
  turns TLS off whatever the environment says.
- ``Security.connect`` opens the stream and, with TLS, finishes the handshake there,
  so a certificate problem surfaces as a ``TlsError`` (not retried: retrying cannot make
  a certificate trusted) rather than as a lost connection later. A connection reset
  during the handshake stays a transient error.
- ``authenticate`` drives ``dcp.protocol.sasl.SaslClient`` over any "send this request,
  give me the answer" function, so the SDK's two connections and dcpctl share it (its
  SCRAM key derivation runs in a worker thread: the event loop goes on meanwhile).
  SCRAM-SHA512 unless another mechanism is asked for; PLAIN only when asked, and only
  over TLS or to a loopback host (``check_plain``: PLAIN sends the password itself).
  AUTH_ERROR raises ``AuthenticationError`` naming the user and the mechanism;
  nobody retries it (the same password would fail again, and each failure counts
  against the connection on the server).
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from dcp.protocol import codec
from dcp.protocol.errors import AuthenticationError, for_status
from dcp.protocol.opcodes import Status
from dcp.protocol.sasl import MECHANISMS, SaslClient, is_loopback_host

from .errors import TlsError, UsageError

__all__ = [
    "DEFAULT_MECHANISM",
    "Ask",
    "Credentials",
    "Security",
    "TlsError",
    "authenticate",
    "check_plain",
    "client_tls_context",
    "closed_message",
    "mechanism_name",
    "resolve",
    "server_reason",
    "tls_failure",
]

DEFAULT_MECHANISM = "SCRAM-SHA512"
Connector = Callable[[], Awaitable[trio.abc.Stream]]
#: ``ask(build)``: build the request with ``build(opaque)``, send it, return the
#: answer's (status, value). The SASL exchange is strictly one request at a time.
Ask = Callable[[Callable[[int], bytes]], Awaitable[tuple[int, bytes]]]


@dataclass(frozen=True, slots=True)
class Credentials:
    username: str
    password: str = field(repr=False)
    mechanism: str = DEFAULT_MECHANISM


@dataclass(frozen=True, slots=True)
class Security:
    """What a client connects with: its credentials and TLS context (either may be None)."""

    credentials: Credentials | None = None
    tls: ssl.SSLContext | None = None
    #: the name the server's certificate must carry (the host connected to)
    server_hostname: str = ""

    async def connect(self, connector: Connector) -> trio.abc.Stream:
        """``connector()``'s stream, in TLS with the handshake done when TLS is on."""
        stream = await connector()
        if self.tls is None:
            return stream
        tls = trio.SSLStream(
            stream, self.tls, server_hostname=self.server_hostname or None, https_compatible=True
        )
        try:
            await tls.do_handshake()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            await trio.aclose_forcefully(stream)
            failure = tls_failure(exc, self.server_hostname)
            if failure is None:
                raise
            raise failure from exc.__cause__
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        return tls


def tls_failure(exc: BaseException, where: str = "") -> TlsError | None:
    """A ``TlsError`` when ``exc`` (a broken stream) was caused by TLS itself (a
    certificate, a protocol mismatch), None when it is an ordinary lost connection."""
    cause = exc.__cause__
    if not isinstance(cause, ssl.SSLError):
        return None
    at = f" with {where}" if where else ""
    if isinstance(cause, ssl.SSLCertVerificationError):
        text = f"TLS{at}: the server's certificate is not trusted: {cause.verify_message}"
        hint = " (trust the CA that signed it: tls_ca=, dcpctl --tls-ca, or DCP_TLS_CA)"
        err = TlsError(text + hint)
    elif cause.reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE"):
        err = TlsError(f"TLS{at}: the server does not speak TLS on this port ({cause})")
    elif "CERTIFICATE" in str(cause.reason or "").upper():
        err = TlsError(f"TLS{at}: the server refused our client certificate ({cause})")
    else:
        err = TlsError(f"TLS{at} failed: {cause}")
    return err


def closed_message(stream: trio.abc.Stream, received: int) -> str:
    """Why a connection ended with EOF, as far as the client can tell. Over TLS 1.3 a
    server that refuses our client certificate cannot say so (the refusal comes after
    our side of the handshake and the alert is not always sent): EOF before any answer
    is the sign."""
    if isinstance(stream, trio.SSLStream) and not received:
        return (
            "the server closed the TLS connection before answering (does it require a "
            "client certificate? tls_cert= or DCP_TLS_CERT)"
        )
    return "the server closed the connection"


def mechanism_name(mechanism: str) -> str:
    """Couchbase's spelling (``SCRAM-SHA512``); the RFC's (``SCRAM-SHA-512``) is accepted."""
    name = mechanism.strip().upper().replace("SHA-", "SHA")
    if name not in MECHANISMS:
        raise UsageError(f"mechanism must be one of {', '.join(MECHANISMS)}, not {mechanism!r}")
    return name


def client_tls_context(
    ca: str | None = None, cert: str | None = None, key: str | None = None
) -> ssl.SSLContext:
    """A client context verifying the server against ``ca`` (None: the system's CAs),
    presenting the client certificate ``cert`` (PEM, with its key unless ``key``)."""
    try:
        ctx = ssl.create_default_context(cafile=ca)
        if cert:
            ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(f"cannot load TLS files (ca={ca!r} cert={cert!r}): {exc}") from exc
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def check_plain(host: str, credentials: Credentials | None, tls: object) -> None:
    """``UsageError`` when PLAIN would send the password in clear to another machine."""
    if credentials is None or credentials.mechanism != "PLAIN" or tls is not None:
        return
    if not is_loopback_host(host):
        raise UsageError(
            f"refusing to send a PLAIN password in clear to {host}: use TLS (tls=, "
            "--tls) or a SCRAM mechanism"
        )


def resolve(
    host: str,
    *,
    username: str | None,
    password: str | None,
    mechanism: str | None,
    tls: ssl.SSLContext | bool | None,
    tls_ca: str | None,
    tls_cert: str | None,
) -> Security:
    """The client's ``Security`` from its arguments and the environment (module rules)."""
    env = os.environ
    user = username if username is not None else env.get("DCP_USERNAME", "")
    if password is not None and not user:
        raise UsageError("password given without a username (username= or DCP_USERNAME)")
    creds = None
    if user:
        pw = password if password is not None else env.get("DCP_PASSWORD")
        if pw is None:
            raise UsageError(f"no password for user {user!r} (password= or DCP_PASSWORD)")
        creds = Credentials(user, pw, mechanism_name(mechanism or DEFAULT_MECHANISM))
    elif mechanism is not None:
        raise UsageError("mechanism given without a username (username= or DCP_USERNAME)")
    ctx: ssl.SSLContext | None = None
    if isinstance(tls, ssl.SSLContext):
        if tls_ca or tls_cert:
            raise UsageError("give either tls=<SSLContext> or tls_ca=/tls_cert=, not both")
        ctx = tls
    elif tls is not False:
        ca = tls_ca if tls_ca is not None else env.get("DCP_TLS_CA") or None
        cert = tls_cert if tls_cert is not None else env.get("DCP_TLS_CERT") or None
        if tls or ca or cert:
            ctx = client_tls_context(ca, cert, env.get("DCP_TLS_KEY") or None)
    elif tls_ca or tls_cert:
        raise UsageError("tls=False together with tls_ca=/tls_cert=")
    check_plain(host, creds, ctx)
    return Security(creds, ctx, host)


async def authenticate(ask: Ask, creds: Credentials) -> None:
    """Authenticate as ``creds`` (see the module rules). Raises ``AuthenticationError``
    (refused, or a server that cannot prove it knows the user's keys) or the
    ``StatusError`` of another refusal (EINVAL: the server found our message malformed;
    NOT_SUPPORTED/UNKNOWN_COMMAND: a server without SASL)."""
    mech = creds.mechanism
    client = SaslClient(mech, creds.username, creds.password)
    who = f"user {creds.username!r} with {mech}"
    first = client.start()
    status, value = await ask(lambda o: codec.sasl_auth(mech, first, opaque=o))
    if status == Status.AUTH_CONTINUE:
        try:  # PBKDF2 at the server's iterations (up to a second): not on the event loop
            final = await trio.to_thread.run_sync(client.step, value)
        except AuthenticationError as exc:
            raise AuthenticationError(message=f"authentication as {who} failed: {exc}") from exc
        status, value = await ask(lambda o: codec.sasl_step(mech, final, opaque=o))
    if status == Status.SUCCESS:
        try:
            client.finish(value)
        except AuthenticationError as exc:
            raise AuthenticationError(message=f"authentication as {who} failed: {exc}") from exc
        return
    if status == Status.AUTH_ERROR:
        detail = server_reason(value) or "wrong user name or password"
        raise AuthenticationError(message=f"authentication as {who} refused: {detail}", value=value)
    raise for_status(status, value, f"SASL authentication as {who}: {server_reason(value)}")


def server_reason(value: bytes) -> str:
    """The server's reason: its JSON error context (XERROR style) or the plain text."""
    try:
        return str(json.loads(value)["error"]["context"])[:200]
    except (ValueError, KeyError, TypeError):
        return bytes(value[:200]).decode("utf-8", "replace")
