"""Users kept in etcd (``users_etcd``): every node of a cluster reads the same users.

Rules of this module:
- One key per user, ``<users_etcd_prefix><name>``, whose value is the JSON form of the
  users file's ``[users.NAME]`` table (roles and salted SCRAM keys, never a password;
  users.py checks it as strictly as the file). ``put_user``/``delete_user`` write them
  (``dcpctl user add|remove --etcd``).
- All etcd access goes through ``cluster.store.EtcdStore`` (blocking etcd3gw calls in
  worker threads, under a deadline). At start ``load_users`` must succeed: an etcd that
  does not answer, or a record that does not load, raises ``UsersFileError`` and the
  server refuses to start with that one line.
- ``follow_users`` then polls the prefix (``EtcdStore.follow``) and applies each changed
  state like a SIGHUP reload (``Authenticator.replace``: new privileges at once, removed
  users' connections closed). A bad record keeps the previous users (logged); an etcd
  that stops answering keeps the last users, logged once until it answers again.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import trio

from .auth import Authenticator
from .cluster.store import EtcdStore, Snapshot, StoreUnavailable
from .users import Users, UsersFileError, check_name, user_record

if TYPE_CHECKING:
    from .config import ServerConfig

__all__ = ["delete_user", "follow_users", "load_users", "open_users_etcd", "put_user", "users_of"]

log = logging.getLogger("dcp.auth")

#: Seconds between two reads of the users prefix, and before retrying a silent etcd.
POLL_INTERVAL = 0.5
RETRY_INTERVAL = 2.0


def users_of(snapshot: Snapshot, prefix: str, endpoint: str) -> Users:
    """The users a prefix holds (``UsersFileError`` naming the key of a bad record)."""
    records: dict[str, Any] = {}
    for key, entry in snapshot.entries.items():
        name = key[len(prefix) :]
        try:
            records[name] = json.loads(entry.value)
        except ValueError as exc:
            raise UsersFileError(f"etcd {endpoint} key {key}: not JSON ({exc})") from None
    return Users.from_records(records, f"etcd {endpoint} {prefix}")


async def load_users(store: EtcdStore, prefix: str) -> Users:
    """The users now (see the module rules: failures are ``UsersFileError``)."""
    try:
        snapshot = await store.get_prefix(prefix)
    except StoreUnavailable as exc:
        raise UsersFileError(f"users_etcd: {exc}") from None
    users = users_of(snapshot, prefix, store.endpoint)
    if not len(users):
        log.warning("no users under %s in etcd %s: nobody can log in", prefix, store.endpoint)
    return users


async def open_users_etcd(config: ServerConfig) -> tuple[EtcdStore, Authenticator]:
    """The store and an ``Authenticator`` holding the users in etcd now (module rules)."""
    try:
        store = EtcdStore(config.users_etcd)
    except ValueError as exc:
        raise UsersFileError(f"users_etcd: {exc}") from None
    try:
        users = await load_users(store, config.users_etcd_prefix)
    except BaseException:
        await store.aclose()
        raise
    log.info("users from etcd %s: %d users", config.users_etcd, len(users))
    return store, Authenticator(users, "")


async def follow_users(
    authenticator: Authenticator,
    store: EtcdStore,
    prefix: str,
    *,
    interval: float = POLL_INTERVAL,
    retry: float = RETRY_INTERVAL,
) -> None:
    """Apply every change of the users in etcd until cancelled (module rules)."""
    current = {name: authenticator.users.get(name) for name in authenticator.users.names}
    unreachable = False
    while True:
        try:
            async for snapshot in store.follow(prefix, interval=interval):
                if unreachable:
                    log.info("etcd %s answers again: following its users", store.endpoint)
                    unreachable = False
                try:
                    users = users_of(snapshot, prefix, store.endpoint)
                except UsersFileError as exc:
                    log.error("users in etcd not applied, keeping the previous users: %s", exc)
                    continue
                seen = {name: users.get(name) for name in users.names}
                if seen != current:
                    current = seen
                    authenticator.replace(users)
                    log.info("users from etcd %s applied: %d users", store.endpoint, len(users))
        except StoreUnavailable as exc:
            if not unreachable:
                log.warning("cannot read the users from etcd, keeping the last ones: %s", exc)
                unreachable = True
        await trio.sleep(retry)


async def put_user(
    store: EtcdStore, prefix: str, name: str, roles: list[str], password: str, **kw: Any
) -> None:
    """Add or replace ``name`` in etcd (salted keys, never the password)."""
    record = await trio.to_thread.run_sync(lambda: user_record(name, roles, password, **kw))
    await store.put(prefix + name, json.dumps(record, sort_keys=True).encode())


async def delete_user(store: EtcdStore, prefix: str, name: str) -> bool:
    """Remove ``name`` from etcd; False when it was not there."""
    check_name(name)
    return await store.delete(prefix + name)
