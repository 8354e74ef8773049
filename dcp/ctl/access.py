"""Credentials and TLS of dcpctl's connections: the flags and the password prompt.

Rules of this module:
- Flags (before or after the command, like ``--host``): ``--user`` (env DCP_USERNAME),
  ``--password`` (env DCP_PASSWORD; otherwise asked on the terminal; without a terminal
  a one-line error, never a hang), ``--mechanism`` (SCRAM-SHA512 unless told), ``--tls``,
  ``--tls-ca`` (env DCP_TLS_CA; implies ``--tls``), ``--tls-cert``/``--tls-key`` (env
  DCP_TLS_CERT/DCP_TLS_KEY: a client certificate for mutual TLS).
- PLAIN goes in clear only to a loopback host: without TLS it is refused with a one-line
  error (here for ``--host``, and by ``Remote`` for each other node it connects to).
- ``resolve`` runs once, before trio starts (the prompt must not block the event loop),
  and leaves a ``dcp.consumer.security.Security`` in ``args.security``: every connection
  the command opens (``Remote``, ``KvClient``, ``DcpClient``) uses that one.
- Nothing heavy at import: ``inspect`` never loads trio or the SDK.
"""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from typing import TYPE_CHECKING, Any

from .output import CtlError

if TYPE_CHECKING:
    from ..consumer.security import Security

__all__ = ["add_options", "resolve", "sdk_options"]

_S = argparse.SUPPRESS


def add_options(p: argparse.ArgumentParser, top: bool) -> None:
    """The credential and TLS flags (``top``: with defaults; a command's: suppressed, so
    a flag given before the command is not overwritten)."""

    def default(value: Any) -> Any:
        return value if top else _S

    env = os.environ
    p.add_argument(
        "--user",
        default=default(env.get("DCP_USERNAME") or None),
        help="authenticate as this user (env DCP_USERNAME)",
    )
    p.add_argument(
        "--password",
        default=default(None),
        help="the user's password (prefer env DCP_PASSWORD or the prompt: a flag shows in ps)",
    )
    p.add_argument(
        "--mechanism",
        default=default(None),
        help="SASL mechanism: SCRAM-SHA512 (default), SCRAM-SHA256 or PLAIN",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        default=default(False),
        help="connect with TLS (to the server's --tls-port)",
    )
    p.add_argument(
        "--tls-ca",
        default=default(env.get("DCP_TLS_CA") or None),
        help="CA file to verify the server with (implies --tls; env DCP_TLS_CA)",
    )
    p.add_argument(
        "--tls-cert",
        default=default(env.get("DCP_TLS_CERT") or None),
        help="client certificate PEM for mutual TLS (env DCP_TLS_CERT)",
    )
    p.add_argument(
        "--tls-key",
        default=default(env.get("DCP_TLS_KEY") or None),
        help="its private key, when not in the certificate file (env DCP_TLS_KEY)",
    )


def _password(user: str) -> str:
    given = os.environ.get("DCP_PASSWORD")
    if given is not None:
        return given
    if not sys.stdin.isatty():
        raise CtlError(
            f"no password for user {user!r}: set DCP_PASSWORD, give --password, or run on "
            "a terminal to be asked",
            code=2,
        )
    try:
        return getpass.getpass(f"password for {user}: ")
    except EOFError:
        raise CtlError(f"no password for user {user!r}", code=2) from None


def resolve(args: argparse.Namespace) -> Security:
    """The command's ``Security`` from its flags (asking for the password if needed);
    also stored in ``args.security``."""
    from ..consumer.errors import UsageError
    from ..consumer.security import (
        DEFAULT_MECHANISM,
        Credentials,
        Security,
        check_plain,
        client_tls_context,
        mechanism_name,
    )

    creds = None
    try:
        if args.user:
            password = args.password if args.password is not None else _password(args.user)
            creds = Credentials(
                args.user, password, mechanism_name(args.mechanism or DEFAULT_MECHANISM)
            )
        elif args.password is not None or args.mechanism:
            raise CtlError("--password/--mechanism need --user (or DCP_USERNAME)", code=2)
        if args.tls_key and not args.tls_cert:
            raise CtlError("--tls-key needs --tls-cert (or DCP_TLS_CERT)", code=2)
        ctx = None
        if args.tls or args.tls_ca or args.tls_cert:
            ctx = client_tls_context(args.tls_ca, args.tls_cert, args.tls_key)
        check_plain(args.host, creds, ctx)
    except UsageError as exc:
        raise CtlError(str(exc), code=2) from None
    args.security = Security(creds, ctx, args.host)
    return args.security


def sdk_options(args: argparse.Namespace) -> dict[str, Any]:
    """``DcpClient``/``KvClient`` keyword arguments for ``args.security`` (none when the
    command was called without ``resolve``: the SDK's own defaults then)."""
    sec: Security | None = getattr(args, "security", None)
    if sec is None:
        return {}
    creds = sec.credentials
    return {
        "username": creds.username if creds else None,
        "password": creds.password if creds else None,
        "mechanism": creds.mechanism if creds else None,
        "tls": sec.tls if sec.tls is not None else False,
    }
