"""``dcpctl user add | remove``: write the server's users file (``--users-file``).

Rules of this module:
- Offline: the file is edited in place with the server's own writer
  (``dcp.producer.users``: salted SCRAM keys, never the password; an atomic rewrite),
  and a running server reads it again on SIGHUP. Nothing is sent to a server.
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


def cmd_user_add(args: argparse.Namespace, out: Output) -> int:
    from ..producer.users import UsersFileError, add_user, check_name, privileges_of

    path = _users_file(args)
    roles = [r.strip() for r in args.role.split(",") if r.strip()]
    try:  # refuse bad arguments before asking for a password
        check_name(args.name)
        if not roles:
            raise ValueError("--role needs at least one role")
        privileges = privileges_of(roles)
    except ValueError as exc:
        raise CtlError(str(exc), code=2) from None
    password = read_password(args.name)
    try:
        add_user(path, args.name, roles, password)
    except UsersFileError as exc:
        raise CtlError(str(exc)) from None
    except (OSError, ValueError) as exc:
        raise CtlError(f"cannot write {path}: {exc}") from None
    doc = {
        "user": args.name,
        "roles": roles,
        "privileges": sorted(privileges),
        "users_file": path,
    }
    if out.json_mode:
        out.json(doc)
    else:
        out.line(
            f"user {args.name} ({', '.join(sorted(privileges))}) saved in {path}; "
            "a running server reads it on SIGHUP"
        )
    return 0


def cmd_user_remove(args: argparse.Namespace, out: Output) -> int:
    from ..producer.users import UsersFileError, remove_user

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
