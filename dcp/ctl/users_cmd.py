"""``dcpctl user add | remove``: write the server's users file (``--users-file``), or a
cluster's users in etcd (``--etcd``).

Rules of this module:
- Offline: the file is edited in place with the server's own writer
  (``dcp.producer.users``: salted SCRAM keys, never the password; an atomic rewrite
  under a lock), and a running server reads it again on SIGHUP. Nothing is sent to a
  server.
- With ``--etcd URL`` the same record goes to etcd (``dcp.producer.users_etcd``: one key
  per user under ``--etcd-prefix``); servers with ``users_etcd`` follow it within a
  second. etcd not answering is one line, exit 1.
- The password is asked twice on a terminal; otherwise it is the first line of stdin
  (for scripts: ``printf '%s\\n' "$PW" | dcpctl user add ...``). Never a flag: a flag
  would show in ``ps`` and in the shell's history. An empty password is refused.
- Bad input (unknown role, bad name, unreadable file) is one line and exit status 1 or 2.
"""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from typing import Any

from .output import CtlError, Output

__all__ = ["cmd_user_add", "cmd_user_remove", "read_password"]


def _users_file(args: argparse.Namespace) -> str:
    path = args.users_file or os.environ.get("DCP_USERS_FILE", "")
    if not path:
        raise CtlError("--users-file is required (or env DCP_USERS_FILE)", code=2)
    return str(path)


def read_password(name: str) -> str:
    """The new password: asked twice on a terminal, else the first line of stdin."""
    if sys.stdin.isatty():
        try:
            first = getpass.getpass(f"password for {name}: ")
            again = getpass.getpass(f"password for {name} (again): ")
        except EOFError:
            raise CtlError("no password given", code=2) from None
        if first != again:
            raise CtlError("the two passwords differ", code=2)
        password = first
    else:
        password = sys.stdin.readline().removesuffix("\n").removesuffix("\r")
    if not password:
        raise CtlError(f"empty password for user {name!r}", code=2)
    return password


def _etcd(action: str, args: argparse.Namespace, *call_args: Any) -> Any:
    """Run ``users_etcd``'s ``put_user``/``delete_user`` against ``--etcd``."""
    import trio

    from ..producer.cluster.store import EtcdStore, StoreUnavailable
    from ..producer.users_etcd import delete_user, put_user

    async def run() -> Any:
        store = EtcdStore(args.etcd)
        try:
            do = put_user if action == "add" else delete_user
            return await do(store, args.etcd_prefix, args.name, *call_args)
        finally:
            await store.aclose()

    try:
        return trio.run(run)
    except StoreUnavailable as exc:
        raise CtlError(str(exc)) from None
    except ValueError as exc:
        raise CtlError(f"--etcd {args.etcd}: {exc}", code=2) from None


def cmd_user_add(args: argparse.Namespace, out: Output) -> int:
    from ..producer.users import UsersFileError, add_user, check_name, privileges_of

    etcd = getattr(args, "etcd", None)
    path = f"etcd {etcd} {args.etcd_prefix}" if etcd else _users_file(args)
    roles = [r.strip() for r in args.role.split(",") if r.strip()]
    try:  # refuse bad arguments before asking for a password
        check_name(args.name)
        if not roles:
            raise ValueError("--role needs at least one role")
        privileges = privileges_of(roles)
    except ValueError as exc:
        raise CtlError(str(exc), code=2) from None
    password = read_password(args.name)
    if etcd:
        _etcd("add", args, roles, password)
    try:
        if not etcd:
            add_user(path, args.name, roles, password)
    except UsersFileError as exc:
        raise CtlError(str(exc)) from None
    except (OSError, ValueError) as exc:
        raise CtlError(f"cannot write {path}: {exc}") from None
    doc = {
        "user": args.name,
        "roles": roles,
        "privileges": sorted(privileges),
        ("etcd" if etcd else "users_file"): path,
    }
    if out.json_mode:
        out.json(doc)
    else:
        when = "servers following etcd apply it" if etcd else "a running server reads it on SIGHUP"
        out.line(f"user {args.name} ({', '.join(sorted(privileges))}) saved in {path}; {when}")
    return 0


def cmd_user_remove(args: argparse.Namespace, out: Output) -> int:
    from ..producer.users import UsersFileError, remove_user

    etcd = getattr(args, "etcd", None)
    if etcd:
        path = f"etcd {etcd} {args.etcd_prefix}"
        if not _etcd("remove", args):
            raise CtlError(f"no user {args.name!r} in {path}")
        if out.json_mode:
            out.json({"user": args.name, "removed": True, "etcd": path})
        else:
            out.line(f"user {args.name} removed from {path}; servers following etcd apply it")
        return 0
    path = _users_file(args)
    try:
        removed = remove_user(path, args.name)
    except UsersFileError as exc:
        raise CtlError(str(exc)) from None
    except OSError as exc:
        raise CtlError(f"cannot write {path}: {exc}") from None
    if not removed:
        raise CtlError(f"no user {args.name!r} in {path}")
    if out.json_mode:
        out.json({"user": args.name, "removed": True, "users_file": path})
    else:
        out.line(f"user {args.name} removed from {path}; a running server reads it on SIGHUP")
    return 0
