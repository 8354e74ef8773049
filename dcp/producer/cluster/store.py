"""EtcdStore: the few etcd operations the cluster needs, awaitable from trio.

Rules of this module:
- Every operation is one blocking etcd3gw call (etcd's JSON gateway, ``/v3/``) run in
  ``trio.to_thread.run_sync`` under a deadline: the HTTP client gives up after
  ``timeout`` seconds and the trio side waits at most one second longer, abandoning the
  thread (it ends at its own socket timeout) so a hung etcd never holds a task.
- Each worker thread has its own etcd3gw client (``threading.local``): a requests session
  is not documented as safe to share between threads.
- Any failure to get an answer (refused, timed out, an HTTP error, a malformed answer, an
  answer cut off by etcd dying mid-reply) becomes ``StoreUnavailable`` naming the
  endpoint and the operation. A lease that etcd no longer knows (it expired or was
  revoked) is a fact, not an outage: ``LeaseExpired``.
- Conditional writes are single etcd transactions: ``compare_and_put`` puts only if the
  key's mod revision is the one given (0: only if absent) and, with a ``Guard``, only if
  another key still exists with the create revision given (several guards: all must
  hold; create revision 0: the key must be absent). The orchestrator writes the
  map guarded by its election key (cluster/election.py), so a deposed orchestrator cannot
  write a map even if it has not yet noticed it was deposed.
- Changes are followed by polling (``follow``), not with etcd3gw's watch: that watch reads
  its stream in a thread pool of its own outside any nursery, and when the connection
  drops its iterator neither ends nor raises, so a follower would wait forever on a dead
  etcd. A poll is one range read per interval that yields the whole current state (key,
  value and mod revision), so a deletion is seen as surely as a put; the prefixes the
  cluster follows hold a handful of keys.
- Keys are text, values bytes; revisions and lease ids are ints (the gateway sends int64s
  as JSON strings and leaves out fields whose value is zero or false).
"""

from __future__ import annotations

import base64
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import etcd3gw
import requests
import trio
from etcd3gw import exceptions as etcd_errors

__all__ = [
    "Entry",
    "EtcdStore",
    "Guard",
    "LeaseExpired",
    "Snapshot",
    "StoreUnavailable",
    "prefix_end",
]

T = TypeVar("T")


class StoreUnavailable(Exception):
    """etcd did not answer, or answered something this client cannot use."""


class LeaseExpired(Exception):
    """etcd does not know the lease any more: it expired or was revoked."""


@dataclass(frozen=True)
class Entry:
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int = 0


@dataclass(frozen=True)
class Snapshot:
    """A prefix as etcd held it at ``revision`` (etcd's store revision of the read)."""

    revision: int
    entries: dict[str, Entry]

    def versions(self) -> dict[str, int]:
        return {k: e.mod_revision for k, e in self.entries.items()}


@dataclass(frozen=True)
class Guard:
    """A write condition: ``key`` exists and was created at ``create_revision``."""

    key: str
    create_revision: int


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


def prefix_end(prefix: str) -> bytes:
    """The range end that covers every key starting with ``prefix`` (etcd's convention:
    the prefix with its last byte below 0xff incremented; no such byte: to the end)."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return b"\0"
    raw[-1] += 1
    return bytes(raw)


def _entry(kv: dict[str, Any]) -> Entry:
    return Entry(
        key=base64.b64decode(kv["key"]).decode(),
        value=base64.b64decode(kv.get("value", "")),
        mod_revision=int(kv.get("mod_revision", 0)),
        create_revision=int(kv.get("create_revision", 0)),
        lease=int(kv.get("lease", 0)),
    )


def _lease_not_found(exc: etcd_errors.Etcd3Exception) -> bool:
    return "lease not found" in (exc.detail_text or "")


class EtcdStore:
    """The cluster's view of etcd. ``endpoint`` is ``http://HOST:PORT``."""

    def __init__(self, endpoint: str, *, timeout: float = 2.0) -> None:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"etcd endpoint must be http://HOST:PORT, not {endpoint!r}")
        self.endpoint = endpoint
        self.timeout = timeout
        self._host = parts.hostname
        self._port = parts.port or 2379
        self._scheme = parts.scheme
        self._local = threading.local()
        self._clients: list[etcd3gw.Etcd3Client] = []
        self._lock = threading.Lock()

    # -- plumbing ---------------------------------------------------------------------

    def _client(self) -> etcd3gw.Etcd3Client:
        client = getattr(self._local, "client", None)
        if client is None:
            client = etcd3gw.client(
                host=self._host,
                port=self._port,
                protocol=self._scheme,
                timeout=self.timeout,
                api_path="/v3/",  # etcd >= 3.4: no discovery round trip
            )
            self._local.client = client
            with self._lock:
                self._clients.append(client)
        return client

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        client = self._client()
        result: dict[str, Any] = client.post(client.get_url(path), json=body)
        return result

    async def _run(self, what: str, call: Callable[[], T]) -> T:
        def guarded() -> T:
            try:
                return call()
            except (LeaseExpired, StoreUnavailable):
                raise
            except etcd_errors.Etcd3Exception as exc:
                if _lease_not_found(exc):
                    raise LeaseExpired(f"{what}: etcd no longer knows the lease") from exc
                detail = exc.detail_text or type(exc).__name__
                raise StoreUnavailable(f"etcd at {self.endpoint}: {what} failed: {detail}") from exc
            except (KeyError, ValueError, TypeError) as exc:
                raise StoreUnavailable(
                    f"etcd at {self.endpoint}: {what}: malformed answer ({exc!r})"
                ) from exc
            except requests.RequestException as exc:  # cut off mid-answer (etcd killed)
                raise StoreUnavailable(f"etcd at {self.endpoint}: {what}: {exc!r}") from exc

        with trio.move_on_after(self.timeout + 1.0):
            return await trio.to_thread.run_sync(guarded, abandon_on_cancel=True)
        raise StoreUnavailable(
            f"etcd at {self.endpoint}: {what} got no answer within {self.timeout + 1.0:g} s"
        )

    async def aclose(self) -> None:
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.session.close()

    # -- reads --------------------------------------------------------------------------

    async def get(self, key: str) -> Entry | None:
        def call() -> Entry | None:
            kvs = self._post("/kv/range", {"key": _b64(key)}).get("kvs", [])
            return _entry(kvs[0]) if kvs else None

        return await self._run(f"get {key}", call)

    async def get_prefix(self, prefix: str) -> Snapshot:
        def call() -> Snapshot:
            res = self._post(
                "/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
            )
            entries = {e.key: e for e in map(_entry, res.get("kvs", []))}
            return Snapshot(int(res["header"]["revision"]), entries)

        return await self._run(f"get prefix {prefix}", call)

    async def follow(self, prefix: str, *, interval: float = 0.25) -> AsyncIterator[Snapshot]:
        """Yield the prefix's state now, then every time a key under it changes.

        A read that fails raises ``StoreUnavailable`` out of the iteration: the caller
        decides whether to wait and follow again (its last snapshot stays valid to act on).
        Changes between two polls are merged: a follower sees states, not every event.
        """
        last: dict[str, int] | None = None
        while True:
            snap = await self.get_prefix(prefix)
            if snap.versions() != last:
                last = snap.versions()
                yield snap
            await trio.sleep(interval)

    # -- writes -------------------------------------------------------------------------

    async def put(self, key: str, value: bytes, *, lease: int = 0) -> int:
        """Put unconditionally; returns the store revision of the write."""

        def call() -> int:
            body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
            if lease:
                body["lease"] = lease
            return int(self._post("/kv/put", body)["header"]["revision"])

        return await self._run(f"put {key}", call)

    async def compare_and_put(
        self,
        key: str,
        value: bytes,
        *,
        mod_revision: int,
        lease: int = 0,
        guard: Guard | None = None,
        guards: Sequence[Guard] = (),
    ) -> int | None:
        """Put only if ``key``'s mod revision is ``mod_revision`` (0: the key is absent) and
        every guard holds (``guard`` and ``guards`` alike; a guard with create revision 0
        holds while its key is absent: etcd compares a missing key's create revision as
        0). Returns the new mod revision, or None when a condition failed."""
        compare: list[dict[str, Any]] = [
            {"key": _b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": mod_revision}
        ]
        for g in ([guard] if guard is not None else []) + list(guards):
            compare.append(
                {
                    "key": _b64(g.key),
                    "result": "EQUAL",
                    "target": "CREATE",
                    "create_revision": g.create_revision,
                }
            )
        put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = lease
        txn = {"compare": compare, "success": [{"request_put": put}], "failure": []}

        def call() -> int | None:
            res = self._post("/kv/txn", txn)
            return int(res["header"]["revision"]) if res.get("succeeded") else None

        return await self._run(f"compare-and-put {key}", call)

    async def delete(self, key: str, *, mod_revision: int | None = None) -> bool:
        """Delete ``key`` (only if its mod revision is ``mod_revision``, when given).
        True when a key was deleted."""
        if mod_revision is None:

            def call() -> bool:
                return int(self._post("/kv/deleterange", {"key": _b64(key)}).get("deleted", 0)) > 0

        else:
            txn = {
                "compare": [
                    {
                        "key": _b64(key),
                        "result": "EQUAL",
                        "target": "MOD",
                        "mod_revision": mod_revision,
                    }
                ],
                "success": [{"request_delete_range": {"key": _b64(key)}}],
                "failure": [],
            }

            def call() -> bool:
                res = self._post("/kv/txn", txn)
                if not res.get("succeeded"):
                    return False
                deleted = res["responses"][0].get("response_delete_range", {}).get("deleted", 0)
                return int(deleted) > 0

        return await self._run(f"delete {key}", call)

    # -- leases -------------------------------------------------------------------------

    async def grant_lease(self, ttl: int) -> tuple[int, int]:
        """A new lease; returns (lease id, the TTL etcd granted, which may exceed ``ttl``:
        etcd raises TTLs below its minimum)."""

        def call() -> tuple[int, int]:
            res = self._post("/lease/grant", {"TTL": ttl, "ID": 0})
            if res.get("error"):
                raise StoreUnavailable(f"etcd at {self.endpoint}: lease grant: {res['error']}")
            return int(res["ID"]), int(res.get("TTL", ttl))

        return await self._run("lease grant", call)

    async def refresh_lease(self, lease: int) -> int:
        """Keep ``lease`` alive; returns its TTL from now. Raises ``LeaseExpired`` when etcd
        no longer knows it (the gateway answers without a TTL then)."""

        def call() -> int:
            ttl = int(self._post("/lease/keepalive", {"ID": lease})["result"].get("TTL", 0))
            if ttl <= 0:
                raise LeaseExpired(f"lease {lease:x} has expired")
            return ttl

        return await self._run("lease keepalive", call)

    async def revoke_lease(self, lease: int) -> None:
        """Revoke ``lease`` (its keys are deleted); a lease already gone is not an error."""

        def call() -> None:
            try:
                self._post("/kv/lease/revoke", {"ID": lease})
            except etcd_errors.Etcd3Exception as exc:
                if not _lease_not_found(exc):
                    raise

        await self._run("lease revoke", call)
