"""The users file: who may connect, with which roles, and their salted SCRAM keys.

Rules of this module:
- The file is TOML (docs/security.md shows one)::

      [users.alice]
      roles = ["read", "write"]
      [users.alice.scram-sha512]
      salt = "<base64>"
      iterations = 15000
      stored_key = "<base64>"
      server_key = "<base64>"
      [users.alice.scram-sha256]
      ...

  A password is never stored, only what SCRAM keeps (RFC 5802 §3): a stolen file lets
  an attacker test guesses at ``iterations`` PBKDF2 rounds each, not log in.
- ``Users.load`` checks everything (roles, mechanisms, base64, key sizes, no unknown
  keys) and raises ``UsersFileError`` naming the user and the field: a typo stops the
  server at start, and a bad file at SIGHUP is refused (the old users stay).
- ``add_user`` rewrites the file atomically (a temporary file in the same directory,
  fsync'd, then renamed over the old one; mode 0600, owned by whoever runs it) so a
  server reading it at the same moment sees the old or the new file, never half of one.
  It refuses to rewrite a file that does not load. ``add_user`` and ``remove_user`` hold
  an exclusive ``fcntl`` lock on a lock file beside it (``.NAME.lock``) from reading to
  renaming, so two of them at once (two ``dcpctl user add``) both land. The lock is not
  on the users file itself: the rename replaces that file, and a lock with it.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import fcntl
import hashlib
import os
import tempfile
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from ..protocol.sasl import (
    DEFAULT_ITERATIONS,
    SCRAM_MECHANISMS,
    ScramCredentials,
    make_credentials,
)

__all__ = [
    "PRIVILEGES",
    "ROLES",
    "User",
    "Users",
    "UsersFileError",
    "add_user",
    "check_name",
    "privileges_of",
    "remove_user",
    "user_record",
]

#: What a user may be allowed (gate.py's ``OPCODE_PRIVILEGES`` says which opcodes need
#: which). ``replicate`` is apart from ``stream``: it lets a connection speak for a replica
#: node (DCP control ``consumer_name``, DCP_SEQNO_ACKNOWLEDGED), whose acks release
#: MAJORITY writes, so an ordinary change consumer must not have it.
PRIVILEGES = ("read", "write", "stream", "stats", "admin", "replicate")
#: What a users file may list as roles: a privilege by name, or ``all`` of them.
ROLES = (*PRIVILEGES, "all")
#: users-file table name -> SASL mechanism
_TABLES = {"scram-sha512": "SCRAM-SHA512", "scram-sha256": "SCRAM-SHA256"}
_MECHANISM_FIELDS = ("salt", "iterations", "stored_key", "server_key")
_MAX_NAME_BYTES = 128


class UsersFileError(ValueError):
    """The users file is missing, unreadable, or not what this module writes."""


@dataclass(frozen=True, slots=True)
class User:
    name: str
    roles: tuple[str, ...]
    privileges: frozenset[str]
    #: SASL mechanism (``SCRAM-SHA512``...) -> stored keys
    credentials: Mapping[str, ScramCredentials]


def privileges_of(roles: Iterable[str]) -> frozenset[str]:
    """The privileges ``roles`` grant (``ValueError`` for an unknown role)."""
    out: set[str] = set()
    for role in roles:
        if role == "all":
            out.update(PRIVILEGES)
        elif role in PRIVILEGES:
            out.add(role)
        else:
            raise ValueError(f"unknown role {role!r} (one of {', '.join(ROLES)})")
    return frozenset(out)


def check_name(name: str) -> str:
    """A user name this module accepts: 1..128 UTF-8 bytes, no control characters."""
    if not name or len(name.encode()) > _MAX_NAME_BYTES:
        raise ValueError(f"a user name must be 1..{_MAX_NAME_BYTES} bytes")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise ValueError("a user name may not contain control characters")
    return name


class Users:
    """The users of one users file (immutable; a reload builds a new one)."""

    def __init__(self, users: Mapping[str, User] | None = None, path: str = "") -> None:
        self._users = dict(users or {})
        self.path = path

    @classmethod
    def from_records(cls, records: Mapping[str, Any], where: str) -> Users:
        """Users from ``{name: record}``, each record what a ``[users.NAME]`` table holds
        (etcd's records, users_etcd.py); checked as strictly as a file (``where`` names
        the source in errors)."""
        return cls(_parse({"users": dict(records)}, where), where)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Users:
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise UsersFileError(f"users file {path}: {exc}") from exc
        return cls(_parse(data, str(path)), str(path))

    def get(self, name: str) -> User | None:
        return self._users.get(name)

    def credentials(self, name: str, mechanism: str) -> ScramCredentials | None:
        """``sasl.SaslServer``'s lookup: the stored keys, or None (no such user or no
        keys for that mechanism)."""
        user = self._users.get(name)
        return None if user is None else user.credentials.get(mechanism)

    @property
    def names(self) -> list[str]:
        return sorted(self._users)

    def __len__(self) -> int:
        return len(self._users)

    def __contains__(self, name: object) -> bool:
        return name in self._users


def _b64_field(where: str, field: str, raw: Any, size: int | None = None) -> bytes:
    if not isinstance(raw, str):
        raise UsersFileError(f"{where}: {field} must be a base64 string")
    try:
        value = base64.b64decode(raw, validate=True)
    except binascii.Error as exc:
        raise UsersFileError(f"{where}: {field} is not base64 ({exc})") from None
    if not value or (size is not None and len(value) != size):
        raise UsersFileError(f"{where}: {field} must decode to {size or 'some'} bytes")
    return value


def _parse_credentials(where: str, mechanism: str, table: Any) -> ScramCredentials:
    if not isinstance(table, dict):
        raise UsersFileError(f"{where}: must be a table")
    unknown = sorted(set(table) - set(_MECHANISM_FIELDS))
    missing = [f for f in _MECHANISM_FIELDS if f not in table]
    if unknown or missing:
        raise UsersFileError(f"{where}: unknown fields {unknown} / missing fields {missing}")
    iterations = table["iterations"]
    if not isinstance(iterations, int) or isinstance(iterations, bool) or iterations < 1:
        raise UsersFileError(f"{where}: iterations must be a positive integer")
    size = hashlib.new(SCRAM_MECHANISMS[mechanism]).digest_size
    return ScramCredentials(
        salt=_b64_field(where, "salt", table["salt"]),
        iterations=iterations,
        stored_key=_b64_field(where, "stored_key", table["stored_key"], size),
        server_key=_b64_field(where, "server_key", table["server_key"], size),
    )


def _parse(data: dict[str, Any], path: str) -> dict[str, User]:
    unknown = sorted(set(data) - {"users"})
    if unknown:
        raise UsersFileError(f"users file {path}: unknown top-level keys {unknown}")
    tables = data.get("users", {})
    if not isinstance(tables, dict):
        raise UsersFileError(f"users file {path}: 'users' must be a table of users")
    users: dict[str, User] = {}
    for name, table in tables.items():
        where = f"users file {path}: user {name!r}"
        try:
            check_name(name)
        except ValueError as exc:
            raise UsersFileError(f"{where}: {exc}") from None
        if not isinstance(table, dict):
            raise UsersFileError(f"{where}: must be a table")
        roles = table.get("roles")
        if not isinstance(roles, list) or not roles or not all(isinstance(r, str) for r in roles):
            raise UsersFileError(f"{where}: roles must be a non-empty list of role names")
        try:
            privileges = privileges_of(roles)
        except ValueError as exc:
            raise UsersFileError(f"{where}: {exc}") from None
        extra = sorted(set(table) - {"roles", *_TABLES})
        if extra:
            raise UsersFileError(
                f"{where}: unknown keys {extra} (roles, {', '.join(_TABLES)} are allowed)"
            )
        credentials = {
            mechanism: _parse_credentials(f"{where} [{key}]", mechanism, table[key])
            for key, mechanism in _TABLES.items()
            if key in table
        }
        if not credentials:
            raise UsersFileError(f"{where}: no credentials ({' or '.join(_TABLES)} table)")
        users[name] = User(name, tuple(roles), privileges, credentials)
    return users


def _credentials_table(creds: ScramCredentials) -> dict[str, Any]:
    return {
        "salt": base64.b64encode(creds.salt).decode(),
        "iterations": creds.iterations,
        "stored_key": base64.b64encode(creds.stored_key).decode(),
        "server_key": base64.b64encode(creds.server_key).decode(),
    }


def _read_for_rewrite(path: Path) -> dict[str, Any]:
    """The file's TOML to edit ({} when it does not exist); it must load as users."""
    if not path.exists():
        return {}
    Users.load(path)  # refuse to rewrite (and so lose) a file we cannot read
    return tomllib.loads(path.read_text(encoding="utf-8"))


def _write_atomically(path: Path, data: dict[str, Any]) -> None:
    text = tomli_w.dumps(data)
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fchmod(f.fileno(), 0o600)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold the users file's lock (see the module rules) for a read-modify-write."""
    directory = path.parent if str(path.parent) else Path(".")
    fd = os.open(directory / f".{path.name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def user_record(
    name: str, roles: Iterable[str], password: str, *, iterations: int = DEFAULT_ITERATIONS
) -> dict[str, Any]:
    """What the users file (or etcd) holds for a user: roles and salted keys for both
    SCRAM mechanisms, never the password (``ValueError`` for bad arguments)."""
    check_name(name)
    roles = list(roles)
    if not roles:
        raise ValueError("a user needs at least one role")
    privileges_of(roles)
    if not password:
        raise ValueError("the password may not be empty")
    entry: dict[str, Any] = {"roles": roles}
    for key, mechanism in _TABLES.items():
        entry[key] = _credentials_table(
            make_credentials(mechanism, password, iterations=iterations)
        )
    return entry


def add_user(
    path: str | os.PathLike[str],
    name: str,
    roles: Iterable[str],
    password: str,
    *,
    iterations: int = DEFAULT_ITERATIONS,
) -> None:
    """Add ``name`` to the users file at ``path`` (created if missing), or replace its
    roles and password: salted keys for both SCRAM mechanisms, never the password."""
    entry = user_record(name, roles, password, iterations=iterations)  # before the lock: slow
    file = Path(path)
    with _locked(file):
        data = _read_for_rewrite(file)
        data.setdefault("users", {})[name] = entry
        _write_atomically(file, data)


def remove_user(path: str | os.PathLike[str], name: str) -> bool:
    """Remove ``name`` from the users file; False when it was not there."""
    file = Path(path)
    with _locked(file):
        data = _read_for_rewrite(file)
        if name not in data.get("users", {}):
            return False
        del data["users"][name]
        _write_atomically(file, data)
    return True
