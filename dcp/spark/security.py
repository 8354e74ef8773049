"""Credentials and TLS of the Spark connector: resolved once from the options and the
environment, turned into a connected ``WireClient`` wherever one is opened.

Rules of this module:
- Blocking and free of trio: it runs in Spark's driver and executor processes, which
  have no event loop (``dcp.consumer.security`` is the SDK's async counterpart; the
  rules are the same so a user meets one behaviour).
- ``resolve_security`` runs inside ``parse_options`` (at ``load()``, in the process that
  defines the query). An option wins over the environment: ``DCP_USERNAME`` /
  ``DCP_PASSWORD``, ``DCP_TLS_CA`` (turns TLS on), ``DCP_TLS_CERT`` / ``DCP_TLS_KEY``.
  ``tls=false`` turns TLS off whatever the environment says. What it resolves travels to
  the executors inside the picklable ``SourceConfig`` (file paths, not an
  ``SSLContext``): the executors' own environment is not consulted, so every task of a
  query uses the same settings as its planner.
- The TLS files are loaded once at resolve time, so a missing or malformed file is an
  ``OptionError`` naming the option before the query starts; each connection builds its
  context from the same paths (a rotated CA file is picked up by the next connection).
- PLAIN sends the password itself: refused (``OptionError``, before any socket opens)
  unless TLS is on or the host is this machine.
- The password is never part of a message, a ``repr`` or a log line.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field

from dcp.protocol.sasl import MECHANISMS, is_loopback_host

from .errors import OptionError

__all__ = [
    "DEFAULT_MECHANISM",
    "Credentials",
    "TlsFiles",
    "check_plain",
    "is_loopback_host",
    "mechanism_name",
    "resolve_security",
]

DEFAULT_MECHANISM = "SCRAM-SHA512"


@dataclass(frozen=True, slots=True)
class Credentials:
    """Who the connector logs in as (picklable; the password stays out of ``repr``)."""

    username: str
    password: str = field(repr=False)
    mechanism: str = DEFAULT_MECHANISM


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """Where the TLS settings live: a CA file to verify the server with (None: the
    system's CAs) and a client certificate with its key (mutual TLS)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def context(self) -> ssl.SSLContext:
        """A client context over these files (``OSError``/``ssl.SSLError`` if they do not
        load). TLS 1.2 at least; the server's name is checked against the host."""
        ctx = ssl.create_default_context(cafile=self.ca)
        if self.cert:
            ctx.load_cert_chain(self.cert, self.key)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx


def mechanism_name(text: str) -> str:
    """Couchbase's spelling of a SASL mechanism; the RFC's (``SCRAM-SHA-512``) is accepted."""
    name = text.strip().upper().replace("SHA-", "SHA")
    if name not in MECHANISMS:
        raise OptionError(f"option mechanism={text!r}: expected one of {', '.join(MECHANISMS)}")
    return name


def check_plain(host: str, credentials: Credentials | None, tls: bool) -> None:
    """``OptionError`` when PLAIN would send the password in clear to another machine."""
    if credentials is None or credentials.mechanism != "PLAIN" or tls:
        return
    if not is_loopback_host(host):
        raise OptionError(
            f"refusing to send a PLAIN password in clear to {host}: set option tls=true "
            f"(with tlsCaFile) or use a SCRAM mechanism (the default)"
        )


def _flag(raw: str) -> bool:
    v = raw.strip().lower()
    if v not in ("true", "false"):
        raise OptionError(f"option tls={raw!r}: expected true or false")
    return v == "true"


def resolve_security(
    host: str, opts: Mapping[str, str], env: Mapping[str, str] | None = None
) -> tuple[Credentials | None, TlsFiles | None]:
    """Credentials and TLS files from the (lower-cased) options and ``env`` (default
    ``os.environ``); see the module rules. Raises ``OptionError``."""
    env = os.environ if env is None else env
    user = opts.get("username")
    user = (user if user is not None else env.get("DCP_USERNAME", "")).strip()
    if "password" in opts and not user:
        raise OptionError("option password given without a username (option username)")
    creds = None
    if user:
        password = opts.get("password", env.get("DCP_PASSWORD"))
        if password is None:
            raise OptionError(
                f"no password for user {user!r}: give option password or DCP_PASSWORD"
            )
        creds = Credentials(user, password, mechanism_name(opts.get("mechanism", "SCRAM-SHA512")))
    elif "mechanism" in opts:
        raise OptionError("option mechanism given without a username (option username)")
    tls_opt = _flag(opts["tls"]) if "tls" in opts else None
    named = {"tlscafile": "tlsCaFile", "tlscertfile": "tlsCertFile", "tlskeyfile": "tlsKeyFile"}
    given = [named[k] for k in named if opts.get(k, "").strip()]
    files = None
    if tls_opt is False:
        if given:
            raise OptionError(f"option {given[0]} needs TLS, but option tls is false")
    else:
        ca = opts.get("tlscafile", "").strip() or env.get("DCP_TLS_CA") or None
        cert = opts.get("tlscertfile", "").strip() or env.get("DCP_TLS_CERT") or None
        key = opts.get("tlskeyfile", "").strip() or env.get("DCP_TLS_KEY") or None
        if key and not cert:
            raise OptionError("option tlsKeyFile needs tlsCertFile (the client certificate)")
        if tls_opt or ca or cert:
            files = TlsFiles(ca, cert, key)
            try:
                files.context()
            except (OSError, ssl.SSLError) as exc:
                raise OptionError(
                    f"cannot load the TLS files (tlsCaFile={ca!r}, tlsCertFile={cert!r}, "
                    f"tlsKeyFile={key!r}): {exc}"
                ) from exc
    check_plain(host, creds, files is not None)
    return creds, files
