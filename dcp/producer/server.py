"""DcpServer: the composition root. It opens the engine, builds the server's parts,
listens on one TCP port (KV and DCP), and on a second one speaking TLS when ``tls_port``
is set, and owns every task.

Rules of this module:
- ``DcpServer`` builds the parts and wires them; each part owns its state and no other
  module reaches into it: ``Persistence`` (persistence.py: the storage lock, flushing,
  pause, the storage error, compaction, the final flush), ``Backfills`` (backfills.py:
  limiters and disk scans), ``StreamRegistry`` (stream_registry.py: streams by vbucket,
  the dirty set, housekeeping), the handler table (dispatch.py, handed to each
  ``Connection``; with a users file each connection gets its own gated table from
  ``Authenticator``, auth.py), the accept loop and output guard (limits.py), the TLS
  context and handshake (tls.py), the cluster (cluster/serving.py ``ClusterSide``: the
  etcd agent, joined before the first connection is accepted and left first at a
  graceful stop, or a single node's config). STAT and metrics read the server through
  ``ServerView`` (server_view.py), which ``DcpServer`` satisfies.
- Both listeners serve the same ``Connection`` code; the TLS context is built with the
  server (a bad certificate stops it before the data directory is opened) and is read
  at each accept, so ``reload_tls`` rotates the certificate for new connections. The
  replication connections' context (``replication_tls``) is read at each connect, and
  ``reload_tls`` rebuilds it too (a rotated CA or client certificate).
- ``DcpServer.run`` owns every task through nurseries: the background nursery (flusher,
  expiry, compaction, housekeeping, backfills, output guard, metrics) outlives the
  connection nursery, so a graceful stop can end streams, close connections, then flush
  and mark a clean shutdown. The parts that need the open bucket exist from the moment
  ``run`` has opened it (``task_status.started``) on.
- The engine is touched only from the trio thread, except the blocking storage calls
  that the engine marks as such (``write_batch``, backfill scans), which run in worker
  threads. Every storage write goes through ``Persistence``, one at a time.
- Sockets never reach the engine; the engine never sees trio.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import secrets
import ssl
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import trio

from ..protocol.opcodes import StreamEndStatus
from .active_stream import ActiveStream
from .auth import Authenticator
from .backfills import Backfills
from .cluster.serving import ClusterSide
from .cluster.store import EtcdStore
from .config import ServerConfig
from .connection import Connection
from .dispatch import HANDLERS, HandlerTable
from .durability import DurabilityMonitor
from .engine import Bucket, EngineConfig, VBucket
from .limits import accept_connections, guard_output
from .metrics import ServerMetrics, serve_metrics
from .persistence import Persistence
from .replication.link import SourceAuth, tls_open_stream
from .replication.manager import ReplicationManager
from .stream_registry import StreamRegistry
from .sync_waiters import SyncWaiters, start_durability
from .tls import TlsContexts
from .users_etcd import follow_users, open_users_etcd
from .vbucket_states import VBucketStates

__all__ = ["DcpServer", "ServerConfig", "open_server"]

log = logging.getLogger("dcp.server")


def _random_uuid() -> int:
    return secrets.randbits(64) or 1


class DcpServer:
    """A running server. Use ``async with DcpServer(config) as server`` or ``run()``."""

    def __init__(
        self,
        config: ServerConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
        uuid_source: Callable[[], int] = _random_uuid,
        handlers: HandlerTable = HANDLERS,
        cluster_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = (config or ServerConfig()).validate()
        self.clock = clock
        self.uuid_source = uuid_source
        #: what each connection's reader dispatches to (dispatch.py)
        self.handlers = handlers
        #: the users and their privileges (auth.py); None: authentication is off. Built
        #: here: a bad users file raises ``UsersFileError`` before anything runs.
        self.authenticator = Authenticator.from_config(self.config)
        self.port = 0
        #: the TLS listener's port (0: none)
        self.tls_port = 0
        #: the TLS contexts, listener's and replication's (tls.py; ``reload_tls``). Built
        #: here: bad certificate files raise ``ConfigError`` before anything runs.
        self.tls = TlsContexts(self.config)
        self.metrics_port = 0
        self.metrics = ServerMetrics()
        self.connections: set[Connection] = set()
        self.clean_shutdown = True
        #: set when a connection reaches its output cap (``limits.guard_output`` waits)
        self.output_event = trio.Event()
        # Built by ``run`` once the bucket is open (see the module rules).
        self.bucket: Bucket
        #: the bucket's vbuckets by id (fixed once it is open): the SET fast path's index
        self.vbuckets: tuple[VBucket, ...] = ()
        self.persistence: Persistence
        self.stream_registry: StreamRegistry
        self.backfills: Backfills
        self.vbucket_states: VBucketStates
        #: majority and stable seqnos per vbucket (durability.py, sync_waiters.py)
        self.durability: DurabilityMonitor
        #: connections with a durable write waiting, by vbucket (sync_waiters.py)
        self.sync_waiters = SyncWaiters()
        self._by_name: dict[str, Connection] = {}
        self._shutdown = trio.Event()
        self._stopped = trio.Event()
        self._accept_scope = trio.CancelScope()
        self._replication_scope = trio.CancelScope()
        self._started_at = time.monotonic()
        self._exit_stack: contextlib.AsyncExitStack | None = None
        self._users_store: EtcdStore | None = None
        #: the cluster as handlers see it (cluster/serving.py); ``cluster_options``: the
        #: ``ClusterAgent``'s keyword arguments (tests inject a fake orchestrator)
        self.cluster = ClusterSide(self, cluster_options)
        #: cluster mode: may active vbuckets take writes now (the agent's fencing gate)?
        #: None on a single node: the write paths check ``is None`` and nothing else
        self.write_gate: Callable[[], bool] | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def history_enabled(self) -> bool:
        return bool(self.config.history_seconds or self.config.history_bytes)

    def uptime(self) -> float:
        return time.monotonic() - self._started_at

    def _engine_config(self) -> EngineConfig:
        c = self.config
        return EngineConfig(
            num_vbuckets=c.num_vbuckets,
            max_value_size=c.max_item_size,
            checkpoint_max_items=c.checkpoint_max_items,
            checkpoint_memory_quota=c.checkpoint_memory_quota,
            checkpoint_retain_seconds=c.checkpoint_retain_seconds,
            history_seconds=c.history_seconds,
            history_bytes=c.history_bytes,
            tombstone_purge_age=c.tombstone_purge_age,
            map_size=c.map_size,
        )

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Open the data directory, listen, serve until ``request_shutdown``."""
        # Named (absolute) before anything can fail: opening may take long (warm-up,
        # migration) or fail, and the operator must know which directory it was.
        await self._open_users()
        users_store = self._users_store
        log.info("opening data_dir=%s", Path(self.config.data_dir).resolve())
        Path(self.config.data_dir).mkdir(parents=True, exist_ok=True)
        bucket = await trio.to_thread.run_sync(
            functools.partial(
                Bucket.open,
                self.config.data_dir,
                self._engine_config(),
                clock=self.clock,
                uuid_source=self.uuid_source,
            )
        )
        try:
            self.bucket = bucket
            self.vbuckets = tuple(bucket.vbuckets)
            persistence = self.persistence = Persistence(
                bucket, self.config, self.metrics, self.connections, self.clock
            )
            registry = self.stream_registry = StreamRegistry(on_new_items=persistence.wake)
            bucket.add_listener(registry.mark_dirty)
            self.durability = start_durability(self)
            async with trio.open_nursery() as bg:
                self.backfills = Backfills(bucket.storage, self.config, self.metrics, bg)
                bg.start_soon(persistence.run_flusher)
                bg.start_soon(self._run_expiry)
                bg.start_soon(persistence.run_compaction)
                bg.start_soon(
                    registry.run_housekeeping, bucket, self.config.checkpoint_retain_seconds
                )
                bg.start_soon(guard_output, self)
                if self.authenticator is not None:
                    bg.start_soon(self.authenticator.enforce_auth_timeout, self.config.auth_timeout)
                if users_store is not None and self.authenticator is not None:
                    bg.start_soon(
                        follow_users, self.authenticator, users_store, self.config.users_etcd_prefix
                    )
                if self.config.metrics_port:
                    self.metrics_port = await bg.start(
                        serve_metrics, self, self.config.host, self.config.metrics_port
                    )
                async with trio.open_nursery() as conns:
                    listeners = await trio.open_tcp_listeners(
                        self.config.port, host=self.config.host
                    )
                    self.port = listeners[0].socket.getsockname()[1]
                    tls_listeners: list[trio.SocketListener] = []
                    if self.tls.listener is not None:
                        tls_listeners = await trio.open_tcp_listeners(
                            self.config.tls_port, host=self.config.host
                        )
                        self.tls_port = tls_listeners[0].socket.getsockname()[1]
                    await self._start_replication(bg)
                    await self.cluster.start(bg)  # joins: a refusal stops the start here
                    conns.start_soon(self._accept, listeners, tls_listeners, conns)
                    log.info(
                        "listening host=%s port=%d tls_port=%s data_dir=%s vbuckets=%d",
                        self.config.host,
                        self.port,
                        self.tls.describe(self.tls_port),
                        Path(self.config.data_dir).resolve(),
                        bucket.num_vbuckets,
                    )
                    task_status.started(self)
                    await self._shutdown.wait()
                    await self.cluster.stop()
                    self._replication_scope.cancel()
                    await self._stop_connections()
                    conns.cancel_scope.cancel()
                if self.clean_shutdown:
                    with trio.CancelScope(shield=True):
                        if not await persistence.final_flush():
                            self.clean_shutdown = False
                bg.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(
                    functools.partial(bucket.close, clean=self.clean_shutdown)
                )
                if users_store is not None:
                    await users_store.aclose()
                await self.cluster.aclose()
            log.info("stopped clean=%s", self.clean_shutdown)
            self._stopped.set()

    async def _open_users(self) -> None:
        """``users_etcd``: the users now (etcd must answer, else ``UsersFileError``)."""
        if self.config.users_etcd and self._users_store is None:
            self._users_store, self.authenticator = await open_users_etcd(self.config)

    async def _start_replication(self, bg: trio.Nursery) -> None:
        """This node's vbucket states and replication (vbucket_states.py, replication/):
        started before the first connection is accepted, so SET_VBUCKET_STATE and the
        static topology (``replica_of``) always find them."""
        node = self.config.advertise or f"{self.config.host}:{self.port}"
        states = self.vbucket_states = VBucketStates(self, node)
        # acks name this node as the cluster map does (none without a cluster: there the
        # active's chain is itself alone); one flush listener acks what got persisted
        acks_as = self.config.node_name
        manager = ReplicationManager(states, consumer_name=acks_as, **self.replication_options())
        self.persistence.add_flush_listener(manager.flushed)
        await bg.start(self._run_replication, manager)
        states.manager = manager
        bg.start_soon(states.run)
        states.start(self.config.replica_of)
        if self.config.replica_of:
            log.info("every vbucket is a replica of %s", self.config.replica_of)

    def replication_options(self) -> dict[str, Any]:
        """Credentials (``replication_user``, the node's internal user) and TLS of this
        node's replication connections to their sources."""
        c = self.config
        options: dict[str, Any] = {}
        if c.replication_user:
            options["auth"] = SourceAuth(c.replication_user, c.replication_password)
        if self.tls.replication is not None:
            options["open_stream"] = tls_open_stream(self.tls.current_replication)
        return options

    async def _run_replication(
        self, manager: ReplicationManager, *, task_status: Any = trio.TASK_STATUS_IGNORED
    ) -> None:
        # its own cancel scope: a graceful stop ends replication before the final flush,
        # so nothing is applied after the last flush was collected
        with self._replication_scope:
            await manager.run(task_status=task_status)

    async def _run_expiry(self) -> None:
        """The expiry pager: expire items whose time is up, wake their streams. (It writes
        to memory, like a client: it is neither persistence nor streaming.)"""
        while True:
            await trio.sleep(self.config.expiry_interval)
            n = self.bucket.expire(self.clock())
            if n:
                log.info("expiry pager expired=%d", n)
                self.stream_registry.wake_dirty()

    async def _accept(
        self,
        listeners: list[trio.SocketListener],
        tls_listeners: list[trio.SocketListener],
        conns: trio.Nursery,
    ) -> None:
        with self._accept_scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(accept_connections, self, listeners, conns)
                if tls_listeners:
                    nursery.start_soon(
                        accept_connections, self, tls_listeners, conns, self.tls.current_listener
                    )

    @property
    def tls_context(self) -> ssl.SSLContext | None:
        """The TLS listener's current context (None: no TLS listener)."""
        return self.tls.listener

    def reload_tls(self) -> None:
        """SIGHUP: rebuild the TLS contexts from their files (``TlsContexts.reload``)."""
        self.tls.reload()

    async def serve_connection(self, conn: Connection) -> None:
        """Run one accepted connection (``limits`` has added it to ``connections``)."""
        try:
            await conn.run()
        except Exception:  # a bug in one connection must not stop the server for all
            log.exception("connection id=%d failed; closed it, the server goes on", conn.id)

    async def _stop_connections(self) -> None:
        """Stop accepting, end every stream with Disconnected, let writers send it."""
        self._accept_scope.cancel()
        for conn in list(self.connections):
            conn.end_all_streams(StreamEndStatus.DISCONNECTED)
        with trio.move_on_after(2.0):
            while any(c.ready for c in self.connections):
                await trio.sleep(0.01)
        for conn in list(self.connections):
            conn.close("server shutting down")

    def request_shutdown(self, clean: bool = True) -> None:
        """Begin a graceful stop (``clean=False`` skips the final flush and the marker)."""
        self.clean_shutdown = self.clean_shutdown and clean
        self._shutdown.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def aclose(self) -> None:
        self.request_shutdown()
        await self._stopped.wait()

    async def __aenter__(self) -> DcpServer:
        await self._open_users()  # before the nursery: a refusal is raised as it is
        stack = contextlib.AsyncExitStack()
        nursery = await stack.enter_async_context(trio.open_nursery())
        try:
            await nursery.start(self.run)
        except BaseException:
            await stack.aclose()  # a run that failed to start leaves no nursery open
            raise
        self._exit_stack = stack
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.request_shutdown()
        assert self._exit_stack is not None
        await self._exit_stack.aclose()

    # ------------------------------------------------------------------ operators, tests

    async def flush_all(self) -> None:
        """Persist everything queued (``Persistence.flush_all``)."""
        await self.persistence.flush_all()

    def pause_persistence(self) -> None:
        """Hold the flusher (writes still land in memory; durable writes wait)."""
        self.persistence.pause()

    def resume_persistence(self) -> None:
        self.persistence.resume()

    # ------------------------------------------------------------------ ServerView

    @property
    def storage_error(self) -> str | None:
        """Why storage cannot persist right now (None: it can)."""
        return self.persistence.storage_error

    def output_bytes(self) -> int:
        """Output all connections hold (queued answers and buffers being sent)."""
        return sum(c.unsent_bytes for c in self.connections)

    def streams(self) -> list[ActiveStream]:
        return self.stream_registry.all()

    def streams_of(self, vbid: int) -> list[ActiveStream]:
        return self.stream_registry.of(vbid)

    def replication_of(self, vbid: int) -> dict[str, Any]:
        """How replica ``vbid`` is fed ({} when it has no source or nothing runs yet)."""
        manager = self.vbucket_states.manager if hasattr(self, "vbucket_states") else None
        info = manager.vbucket_info(vbid) if manager is not None else None
        return info or {}

    def replication_sources(self) -> dict[str, dict[str, Any]]:
        """Per source node: its replication connection's counters."""
        manager = self.vbucket_states.manager if hasattr(self, "vbucket_states") else None
        return manager.stats()["sources"] if manager is not None else {}

    # ------------------------------------------------------------------ connections

    def output_pressure(self) -> None:
        """A connection reached its output cap (or holds a big frame still arriving):
        check the server-wide bound now."""
        self.output_event.set()

    def register_dcp_name(self, conn: Connection) -> None:
        assert conn.dcp_name is not None
        old = self._by_name.get(conn.dcp_name)
        if old is not None and old is not conn and not old.closed:
            log.info("dcp name %s reused: closing older connection id=%d", conn.dcp_name, old.id)
            old.close("replaced by a new connection with the same name")
        self._by_name[conn.dcp_name] = conn

    def connection_closed(self, conn: Connection) -> None:
        self.connections.discard(conn)
        self.backfills.connection_closed(conn.id)
        if conn.dcp_name and self._by_name.get(conn.dcp_name) is conn:
            del self._by_name[conn.dcp_name]


@contextlib.asynccontextmanager
async def open_server(
    config: ServerConfig | None = None, **kwargs: Any
) -> AsyncIterator[DcpServer]:
    """``async with open_server(cfg) as server:`` — for tests and embedding."""
    server = DcpServer(config, **kwargs)
    async with server:
        yield server
