"""DcpClient: the async (trio) consumer. Streams any set of vbuckets, from one node over one
connection or from a cluster over one connection per node, and hands the application whole
snapshots.

Rules of this module:
- The application sees only whole snapshots (``SnapshotBatch``) and ``RollbackEvent``s,
  in the order they completed, through ``async for`` / ``getone`` / ``getmany``. Raw
  mode (``raw=True``) hands out events as they arrive instead (for tools).
- Positions advance only when the application commits (``await batch.commit()`` or
  ``await client.commit()``); delivery is at-least-once: after a reconnect or restart,
  delivered-but-uncommitted snapshots are delivered again, never skipped.
- Tasks live in the nursery opened by ``__aenter__`` (nothing starts in the
  constructor). One supervisor task (``supervisor.py``) owns the connection: connect,
  handshake, stream; on a transient failure it reconnects with exponential backoff
  (50 ms .. 5 s) and gives up with ``RetryTimeoutError`` only after ``retry_timeout``
  seconds without progress. Fatal errors reach the application through the iterator,
  after the batches that completed before them. This module is the application's side:
  iteration, hand-off (with its buffer acks) and commits.
- A cluster (a bootstrap list, or a node whose config names a cluster) is followed by
  ``cluster.py``: the same session, queue, commits and guarantees; each batch's buffer
  ack goes to the connection that sent it (``Supervisor.conn_for``).
- ``aclose()`` is idempotent and always releases the socket and tasks.
- Usage errors (bad arguments, invalid offsets) raise ``UsageError`` subclasses from the
  constructor or ``__aenter__`` at once.
"""

from __future__ import annotations

import ssl
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

import trio

from dcp.protocol.flow_control import FlowControl
from dcp.protocol.frames import DEFAULT_MAX_BODY_SIZE

from .batches import Event, RollbackEvent, SnapshotBatch, SnapshotMarker, StreamEnd
from .config import bootstrap, settings
from .connection import DcpConnection
from .delivery import CommitPoint, Delivery, RawChunk
from .errors import DcpClientError, UsageError
from .offset import Offset, StartFrom
from .offset_store import OffsetStore
from .rollback import RollbackPolicy
from .security import check_plain, resolve
from .supervisor import Connector, Supervisor

__all__ = ["DcpClient"]

#: What the iterator hands out: batches and rollbacks (raw mode: events as they arrive).
Delivered = SnapshotBatch | RollbackEvent | Event | SnapshotMarker | StreamEnd
_STATS_KEYS = (
    "bytes_received",
    "items",
    "batches",
    "buffer_acks",
    "noops",
    "stream_requests",
    "stream_reopens",
    "stream_retries",
    "rollbacks",
    "connects",
    "reconnects",
    "commits",
    "probes",
)


class DcpClient:
    """Async DCP consumer.

    Args:
        host, port: the server, or a cluster's bootstrap list: ``"h1:p1,h2:p2"`` or a list
            of ``(host, port)`` pairs (``port`` is the default for entries without one);
            ignored when ``connector`` is given. A cluster is followed node by node
            (docs/sdk.md, "Clusters").
        vbuckets: vbuckets to stream; None = every vbucket the server reports.
        start: where vbuckets without a saved or explicit offset start
            (``StartFrom.BEGINNING`` or ``StartFrom.NOW``).
        offsets: explicit start offsets per vbucket; they win over the offset store.
        to_latest: stop each vbucket at the high seqno it had when the client first
            connected; iteration ends when all are reached.
        offset_store: where commits are saved (``FileOffsetStore``...); None = keep
            committed positions in memory only.
        name: DCP connection name (reusing a name makes the server drop the older
            connection of that name).
        raw: deliver events as they arrive instead of whole snapshots.
        rollback_policy: ``RollbackPolicy.RESUME`` (deliver ``RollbackEvent``, resume) or
            ``RollbackPolicy.FAIL`` (raise ``RollbackError``).
        buffer_size: flow-control window in bytes (0 disables flow control).
        ack_ratio: send a buffer ack when this fraction of the window is acknowledgeable.
        noop_interval: seconds between server noops (None disables). After one interval
            with nothing read the client sends a NOOP probe; a connection with nothing read
            for twice this long is closed as dead and reopened.
        connect_timeout: seconds for connect + handshake of one attempt.
        retry_timeout: seconds of failed retries (reconnects, stream retries) before the
            error is raised to the application.
        include_delete_times: deletions carry their delete time (DCP_OPEN flag 0x20).
        include_expirations: deliver expirations as ``Expiration`` events (implies
            delete times).
        stream_flags: extra DCP_STREAM_REQ flags (``StreamRequestFlag``).
        receive_size: bytes per socket read.
        max_queue_bytes: bound of the delivery queue when flow control is off.
        connector: ``async () -> trio.abc.Stream`` replacing the TCP connect (tests).
        username, password, mechanism, tls, tls_ca, tls_cert: log in after HELLO and/or
            use TLS; defaults from ``DCP_USERNAME``... (``security.py``, docs/sdk.md).
        cluster: None (default): follow a cluster when the config says it is one; False:
            stream from the one address given and never ask for a config; True: always
            route by the config.
        prefer_replica: in a cluster, stream a vbucket from a replica whose high seqno is
            within ``max_replica_lag`` seqnos of its active's and at least the vbucket's
            resume point (re-checked on every config refresh; the replica streaming stays
            while it qualifies); otherwise from the active.
        config_poll_interval: seconds between config polls in a cluster (moves that end
            no stream are followed this way).
        stable_only: receive only whole snapshots no single node failure can roll back
            (at or below each vbucket's stable seqno; docs/sdk.md, "Stable-only
            streams"); a server that refuses it fails the client. Not with
            ``prefer_replica``.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 11210,
        *,
        vbuckets: Iterable[int] | None = None,
        start: StartFrom | str = StartFrom.BEGINNING,
        offsets: Mapping[int, Offset] | None = None,
        to_latest: bool = False,
        offset_store: OffsetStore | None = None,
        name: str | None = None,
        raw: bool = False,
        rollback_policy: RollbackPolicy | str = RollbackPolicy.RESUME,
        buffer_size: int = 10 * 1024 * 1024,
        ack_ratio: float = 0.2,
        noop_interval: float | None = 120.0,
        connect_timeout: float = 10.0,
        retry_timeout: float = 60.0,
        include_delete_times: bool = False,
        include_expirations: bool = False,
        stream_flags: int = 0,
        receive_size: int = 256 * 1024,
        max_queue_bytes: int = 64 * 1024 * 1024,
        max_body_size: int = DEFAULT_MAX_BODY_SIZE,
        connector: Connector | None = None,
        username: str | None = None,
        password: str | None = None,
        mechanism: str | None = None,
        tls: ssl.SSLContext | bool | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        cluster: bool | None = None,
        prefer_replica: bool = False,
        max_replica_lag: int = 1000,
        config_poll_interval: float = 2.5,
        stable_only: bool = False,
    ) -> None:
        addresses = bootstrap(host, port, connector)
        security = resolve(
            addresses[0][0] if addresses else host,
            username=username,
            password=password,
            mechanism=mechanism,
            tls=tls,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
        )
        cfg = settings(
            host=host,
            port=port,
            vbuckets=vbuckets,
            start=start,
            offsets=offsets,
            offset_store=offset_store,
            name=name,
            raw=raw,
            rollback_policy=rollback_policy,
            buffer_size=buffer_size,
            ack_ratio=ack_ratio,
            noop_interval=noop_interval,
            connect_timeout=connect_timeout,
            retry_timeout=retry_timeout,
            include_delete_times=include_delete_times,
            include_expirations=include_expirations,
            stream_flags=stream_flags,
            receive_size=receive_size,
            max_queue_bytes=max_queue_bytes,
            max_body_size=max_body_size,
            connector=connector,
            security=security,
            cluster=cluster,
            prefer_replica=prefer_replica,
            max_replica_lag=max_replica_lag,
            config_poll_interval=config_poll_interval,
            stable_only=stable_only,
        )
        for addr_host, _ in addresses[1:]:  # a PLAIN password goes to every node
            check_plain(addr_host, security.credentials, security.tls)
        self._cfg = cfg.connection
        self._store = offset_store
        self._delivery = Delivery()
        self._delivery.on_dropped = self._ack_dropped
        self._offsets: dict[int, Offset] = {}
        self._store_lock = trio.Lock()
        self._unsaved = False
        self._stats = dict.fromkeys(_STATS_KEYS, 0)
        self._supervisor = Supervisor(
            cfg.connection,
            cfg.connector,
            self._delivery,
            self._stats,
            self.commit,
            vbuckets=cfg.vbuckets,
            start=cfg.start,
            explicit=cfg.offsets,
            to_latest=to_latest,
            connect_timeout=connect_timeout,
            retry_timeout=retry_timeout,
            routing=cfg.cluster,
        )
        self._ready: deque[Any] = deque()  # raw mode: events of the chunk being iterated
        self._state = "new"
        self._nursery: trio.Nursery | None = None
        self._nursery_cm: Any = None
        #: set once every vbucket has a resolved start position
        self.started = self._supervisor.started

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> DcpClient:
        if self._state != "new":
            raise UsageError("a DcpClient can only be entered once")
        self._state = "running"
        if self._store is not None:
            self._supervisor.saved = await self._store.aload()
        self._offsets = dict(self._supervisor.saved)
        self._nursery_cm = trio.open_nursery()
        self._nursery = await self._nursery_cm.__aenter__()
        self._nursery.start_soon(self._supervisor.run)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop streaming and release the connection. Idempotent; safe when cancelled."""
        if self._state == "closed":
            return
        self._state = "closed"
        self._delivery.close()
        cm, self._nursery_cm = self._nursery_cm, None
        if cm is not None:
            assert self._nursery is not None
            self._nursery.cancel_scope.cancel()
            await cm.__aexit__(None, None, None)

    def _check_usable(self) -> None:
        if self._state == "new":
            raise UsageError("use the client inside `async with` first")

    # ------------------------------------------------------------------ iteration

    def __aiter__(self) -> DcpClient:
        return self

    async def __anext__(self) -> Delivered:
        """The next snapshot batch or rollback event (raw mode: the next event).

        Raises:
            StopAsyncIteration: ``to_latest`` streams all reached their end.
            RollbackError, StreamError, RetryTimeoutError: see the class docstring.
            ClientClosedError: the client was closed.
        """
        self._check_usable()
        return await self._wait_next()

    async def getone(self) -> Delivered | None:
        """Like ``__anext__`` but returns None when every stream has finished."""
        try:
            return await self.__anext__()
        except StopAsyncIteration:
            return None

    async def getmany(
        self, *, timeout: float | None = None, max_items: int = 10_000
    ) -> list[Delivered]:
        """Everything ready now (at least one item, waiting up to ``timeout`` seconds).

        Returns an empty list on timeout or when every stream has finished.
        """
        self._check_usable()
        out: list[Delivered] = []
        try:
            if timeout is None:
                out.append(await self._wait_next())
            else:
                with trio.move_on_after(timeout):
                    out.append(await self._wait_next())
                if not out:
                    return out
            while len(out) < max_items:
                item = await self._next(False)
                if item is None:
                    break
                out.append(item)
        except StopAsyncIteration:
            pass
        except DcpClientError:
            if not out:
                raise
        return out

    async def _wait_next(self) -> Delivered:
        item = await self._next(True)
        assert item is not None  # waiting ends with an item or an exception
        return item

    async def _next(self, wait: bool) -> Delivered | None:
        """The next item (``wait=False``: None when nothing is ready); raises at the end."""
        delivery = self._delivery
        if self._cfg.raw:
            ready = self._ready
            while True:
                while ready:
                    e = ready.popleft()
                    if type(e) is CommitPoint:
                        self._delivered(e.batch)
                        continue
                    if type(e) is RollbackEvent:
                        self._delivered(e)
                    return e
                chunk = await delivery.get() if wait else delivery.get_nowait()
                if chunk is None:
                    return None
                if isinstance(chunk, RawChunk):
                    self._hand_off(chunk.flow, chunk.nbytes)
                    ready.extend(chunk.events)
                else:
                    self._delivered(chunk)
                    return chunk
        entry = await delivery.get() if wait else delivery.get_nowait()
        if isinstance(entry, SnapshotBatch):
            self._stats["batches"] += 1
            self._hand_off(entry.flow, entry.nbytes)
            session = self._supervisor.session
            p = session.positions.get(entry.vbucket) if session is not None else None
            if p is not None and entry.gen == p.gen and entry.epoch == p.epoch:
                p.tip = entry  # inline Session.delivered (per batch)
            return entry
        if isinstance(entry, RollbackEvent):
            self._delivered(entry)
            return entry
        assert entry is None, entry  # RawChunks are queued in raw mode only
        return None

    def _delivered(self, item: SnapshotBatch | RollbackEvent) -> None:
        session = self._supervisor.session
        if session is not None:
            session.delivered(item)

    def _hand_off(self, fc: FlowControl, nbytes: int) -> None:
        self._send_ack(fc, fc.handed(nbytes))

    def _ack_dropped(self, fc: FlowControl) -> None:
        """Purged batches made bytes ackable on ``fc``'s connection (``Delivery.purge``)."""
        self._send_ack(fc, fc.due())

    def _send_ack(self, fc: FlowControl, n: int) -> None:
        if not n or self._nursery is None or self._state != "running":
            return
        sup = self._supervisor
        conn = sup.conn
        if conn is None or conn.fc is not fc:  # a cluster: the connection that sent it
            conn = sup.conn_for(fc)
        if conn is not None:
            self._nursery.start_soon(conn.send_ack, n)

    # ------------------------------------------------------------------ commits

    async def commit(
        self,
        items: SnapshotBatch
        | RollbackEvent
        | Iterable[SnapshotBatch | RollbackEvent]
        | None = None,
    ) -> bool:
        """Commit delivered snapshots/rollbacks and save the positions to the offset store.

        With no argument, commits everything this client has handed to the application
        (per vbucket, the last batch or rollback event). Committing a batch commits
        everything before it on its vbucket. Items delivered before a reconnect or
        rollback are ignored (they are, or were, delivered again).

        Returns:
            True if a committed position moved (and was saved).
        Raises:
            whatever the offset store raised; the positions stay committed in memory and
            the next ``commit()`` saves them again.
        """
        self._check_usable()
        session = self._supervisor.session
        if session is None:
            return False
        if items is None:
            moved = session.commit_delivered()
        elif isinstance(items, (SnapshotBatch, RollbackEvent)):
            moved = [items.vbucket] if session.commit(items) else []
        else:
            moved = session.commit_many(items)
        for vb in moved:
            self._offsets[vb] = session[vb].committed_offset()
        if not moved and not self._unsaved:
            return False
        self._stats["commits"] += 1
        if self._store is not None:
            self._unsaved = True  # until a save succeeds; the next commit() retries it
            async with self._store_lock:
                await self._store.asave(dict(self._offsets))
                self._unsaved = False
        return bool(moved)

    def committed(self) -> dict[int, Offset]:
        """Committed offsets (what a restart resumes from), per vbucket."""
        return dict(self._offsets)

    # ------------------------------------------------------------------ introspection

    @property
    def vbuckets(self) -> list[int] | None:
        session = self._supervisor.session
        if session is not None:
            return sorted(session.positions)
        return self._supervisor.vbuckets

    @property
    def name(self) -> str:
        return self._cfg.name

    def statistics(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self._stats)
        out["queued_entries"] = len(self._delivery)
        out["queued_bytes"] = self._delivery.nbytes
        sup = self._supervisor
        conn = sup.conn
        if sup.runner is None:
            out["connected"] = conn is not None and conn.error is None
            out["flow_control"] = conn.fc.statistics() if conn is not None else None
            return out
        out.update(sup.runner.statistics())
        return out

    @property
    def _conn(self) -> DcpConnection | None:
        """The current connection (``tools/bench/worker.py`` looks at its stream table)."""
        return self._supervisor.conn
