"""DcpServer: the engine behind a trio TCP listener (KV and DCP on one port).

Rules of this module:
- ``DcpServer.run`` owns every task through nurseries: the background nursery (flusher,
  expiry, compaction, housekeeping, backfills) outlives the connection nursery, so a
  graceful stop can end streams, close connections, then flush and mark a clean shutdown.
- The engine is touched only from the trio thread, except the blocking storage calls
  that the engine marks as such (``write_batch``, backfill scans), which run in worker
  threads. Every storage write goes through the flusher loop, one at a time.
- Connections are accepted by ``limits.accept_connections`` (``max_connections``, accept
  back-off) and their total output is bounded by ``limits.guard_output``
  (``total_output_cap``); both run in this server's nurseries.
- Sockets never reach the engine; the engine never sees trio. Wake-ups are batched: the
  engine listener only records dirty vbuckets, and ``wake_dirty`` marks their streams
  ready once per batch of requests.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from ..protocol.opcodes import StreamEndStatus
from .active_stream import ActiveStream
from .config import ServerConfig
from .connection import Connection
from .limits import accept_connections, guard_output
from .metrics import ServerMetrics, serve_metrics
from .tasks import run_backfill, run_compaction, run_expiry, run_flusher, run_housekeeping

__all__ = ["DcpServer", "ServerConfig", "open_server"]

log = logging.getLogger("dcp.server")


def _random_uuid() -> int:
    return secrets.randbits(64) or 1


class DcpServer:
    """A running server. Use ``async with DcpServer(config) as server`` or ``run()``."""

    def __init__(self, config: ServerConfig | None = None, *,
                 clock: Callable[[], float] = time.time,
                 uuid_source: Callable[[], int] = _random_uuid) -> None:
        self.config = (config or ServerConfig()).validate()
        self.clock = clock
        self.uuid_source = uuid_source
        self.bucket: Any = None
        self.port = 0
        self.metrics_port = 0
        self.metrics = ServerMetrics()
        self.connections: set[Connection] = set()
        self.storage_error: str | None = None
        self.clean_shutdown = True
        #: Operators (and tests) can hold the flusher, e.g. to drain a disk; writes still
        #: land in memory and durable writes wait.
        self.persistence_paused = False
        self._by_name: dict[str, Connection] = {}
        self._streams_by_vb: dict[int, set[ActiveStream]] = {}
        self._dirty: set[int] = set()
        self._flush_event = trio.Event()
        self._durable_event = trio.Event()  # set by want_flush (tasks.run_flusher)
        self.flush_backlog = False  # the last flush was capped: more is waiting
        self._storage_lock = trio.Lock()
        self._backfill_limiter = trio.CapacityLimiter(self.config.max_concurrent_backfills)
        self._conn_backfill_slots: dict[int, trio.CapacityLimiter] = {}
        #: set when a connection reaches its output cap (``limits.guard_output`` waits)
        self.output_event = trio.Event()
        self._shutdown = trio.Event()
        self._stopped = trio.Event()
        self._bg: trio.Nursery | None = None
        self._accept_scope = trio.CancelScope()
        self._started_at = time.monotonic()
        self._exit_stack: contextlib.AsyncExitStack | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def history_enabled(self) -> bool:
        return bool(self.config.history_seconds or self.config.history_bytes)

    def uptime(self) -> float:
        return time.monotonic() - self._started_at

    def _engine_config(self) -> Any:
        from .engine import EngineConfig

        c = self.config
        return EngineConfig(
            num_vbuckets=c.num_vbuckets, max_value_size=c.max_item_size,
            checkpoint_max_items=c.checkpoint_max_items,
            checkpoint_memory_quota=c.checkpoint_memory_quota,
            checkpoint_retain_seconds=c.checkpoint_retain_seconds,
            history_seconds=c.history_seconds, history_bytes=c.history_bytes,
            tombstone_purge_age=c.tombstone_purge_age, map_size=c.map_size,
        )

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Open the data directory, listen, serve until ``request_shutdown``."""
        from .engine import Bucket

        Path(self.config.data_dir).mkdir(parents=True, exist_ok=True)
        self.bucket = await trio.to_thread.run_sync(functools.partial(
            Bucket.open, self.config.data_dir, self._engine_config(), clock=self.clock,
            uuid_source=self.uuid_source))
        self.bucket.add_listener(self._dirty.add)
        try:
            async with trio.open_nursery() as bg:
                self._bg = bg
                bg.start_soon(run_flusher, self)
                bg.start_soon(run_expiry, self)
                bg.start_soon(run_compaction, self)
                bg.start_soon(run_housekeeping, self)
                bg.start_soon(guard_output, self)
                if self.config.metrics_port:
                    await bg.start(serve_metrics, self, self.config.metrics_port)
                async with trio.open_nursery() as conns:
                    listeners = await trio.open_tcp_listeners(self.config.port,
                                                              host=self.config.host)
                    self.port = listeners[0].socket.getsockname()[1]
                    conns.start_soon(self._accept, listeners, conns)
                    log.info("listening host=%s port=%d data_dir=%s vbuckets=%d",
                             self.config.host, self.port, Path(self.config.data_dir).resolve(),
                             self.bucket.num_vbuckets)
                    task_status.started(self)
                    await self._shutdown.wait()
                    await self._stop_connections()
                    conns.cancel_scope.cancel()
                if self.clean_shutdown:
                    with trio.CancelScope(shield=True):
                        await self._final_flush()
                bg.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                if self.bucket is not None:
                    await trio.to_thread.run_sync(
                        functools.partial(self.bucket.close, clean=self.clean_shutdown))
            log.info("stopped clean=%s", self.clean_shutdown)
            self._stopped.set()

    async def _accept(self, listeners: list[trio.SocketListener], conns: trio.Nursery) -> None:
        with self._accept_scope:
            await accept_connections(self, listeners, conns)

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
        stack = contextlib.AsyncExitStack()
        nursery = await stack.enter_async_context(trio.open_nursery())
        await nursery.start(self.run)
        self._exit_stack = stack
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.request_shutdown()
        assert self._exit_stack is not None
        await self._exit_stack.aclose()

    # ------------------------------------------------------------------ flushing

    async def flush_all(self) -> None:
        """Persist everything queued (used at shutdown and by tests)."""
        from .tasks import flush_once

        while await flush_once(self):
            pass

    async def _final_flush(self) -> None:
        """Persist everything acknowledged before stopping.

        A full LMDB *map* (``StorageFullError``) must not turn a graceful stop into data
        loss: grow the map (a sparse file: growing costs no disk) until the queue fits,
        and say so. A full disk (``DiskFullError``, ENOSPC) or an I/O error (EIO) is not
        a full map: growing cannot help and would only reserve address space the disk
        does not have, so the flush gives up at once. Whatever the cause, an incomplete
        flush leaves the shutdown unclean (``clean_shutdown`` False), which
        ``dcp-server`` reports with a non-zero exit code (docs/operations.md)."""
        from .engine import StorageError, StorageFullError

        storage = self.bucket.storage
        for _ in range(8):
            try:
                await self.flush_all()
                return
            except StorageFullError:
                new_size = storage.map_size * 2
                log.warning("LMDB map full at shutdown: growing it to %d bytes to persist "
                            "%d acknowledged items", new_size,
                            self.bucket.flusher.pending_items())
                try:
                    await trio.to_thread.run_sync(storage.grow_map, new_size)
                except StorageError as exc:
                    log.error("cannot grow the map: %s", exc)
                    break
            except StorageError as exc:
                log.error("final flush failed: %s", exc)
                break
        log.error("shutdown could not persist everything: %d acknowledged items (up to) are "
                  "lost; the next start treats this stop as a crash",
                  self.bucket.flusher.pending_items())
        self.clean_shutdown = False

    def want_flush(self) -> None:
        """A durable write waits for persistence: flush now, skipping ``flush_interval``."""
        self._flush_event.set()
        self._durable_event.set()

    def pause_persistence(self) -> None:
        self.persistence_paused = True

    def resume_persistence(self) -> None:
        self.persistence_paused = False
        self._flush_event.set()

    def output_pressure(self) -> None:
        """A connection reached its output cap: check the server-wide bound now."""
        self.output_event.set()

    def output_bytes(self) -> int:
        """Output all connections hold (queued answers and buffers being sent)."""
        return sum(c.unsent_bytes for c in self.connections)

    def persisted_seqno(self, vbid: int) -> int:
        return self.bucket.vbucket(vbid).persisted_seqno

    def write_refusal(self) -> str:
        """Why writes must be refused right now ("" = accept)."""
        if self.storage_error:
            return f"temporary failure: storage cannot persist ({self.storage_error})"
        quota = self.bucket.checkpoint_memory_quota
        # Slow streams lose their cursors at the quota; what is left above it is pinned by
        # unpersisted items. Refuse only well past it, so bursts don't bounce.
        if self.bucket.checkpoint_memory() > max(2 * quota, quota + (64 << 20)):
            return "temporary failure: checkpoint memory over quota, persistence behind"
        return ""

    # ------------------------------------------------------------------ streams

    def register_dcp_name(self, conn: Connection) -> None:
        assert conn.dcp_name is not None
        old = self._by_name.get(conn.dcp_name)
        if old is not None and old is not conn and not old.closed:
            log.info("dcp name %s reused: closing older connection id=%d", conn.dcp_name, old.id)
            old.close("replaced by a new connection with the same name")
        self._by_name[conn.dcp_name] = conn

    def backfill_slots(self, conn: Connection) -> trio.CapacityLimiter:
        """The connection's own backfill limiter (see ``tasks.run_backfill``)."""
        lim = self._conn_backfill_slots.get(conn.id)
        if lim is None:
            lim = trio.CapacityLimiter(self.config.max_concurrent_backfills)
            self._conn_backfill_slots[conn.id] = lim
        return lim

    def connection_closed(self, conn: Connection) -> None:
        self.connections.discard(conn)
        self._conn_backfill_slots.pop(conn.id, None)
        if conn.dcp_name and self._by_name.get(conn.dcp_name) is conn:
            del self._by_name[conn.dcp_name]

    def register_stream(self, conn: Connection, stream: ActiveStream) -> None:
        stream.conn = conn  # type: ignore[attr-defined]
        self._streams_by_vb.setdefault(stream.vbid, set()).add(stream)

    def unregister_stream(self, stream: ActiveStream) -> None:
        s = self._streams_by_vb.get(stream.vbid)
        if s is not None:
            s.discard(stream)

    def streams_of(self, vbid: int) -> list[ActiveStream]:
        return list(self._streams_by_vb.get(vbid, ()))

    def streams(self) -> list[ActiveStream]:
        return [s for ss in self._streams_by_vb.values() for s in ss]

    def wake_dirty(self) -> None:
        """Mark streams of vbuckets that got new items ready (once per request batch)."""
        dirty = self._dirty
        if dirty:
            by_vb = self._streams_by_vb
            for vb in dirty:
                for s in by_vb.get(vb, ()):
                    s.conn.mark_ready(s)  # type: ignore[attr-defined]
            dirty.clear()
            self._flush_event.set()

    def start_backfill(self, stream: ActiveStream) -> None:
        assert self._bg is not None
        self._bg.start_soon(run_backfill, self, stream)


@contextlib.asynccontextmanager
async def open_server(config: ServerConfig | None = None, **kwargs: Any):  # type: ignore[no-untyped-def]
    """``async with open_server(cfg) as server:`` — for tests and embedding."""
    server = DcpServer(config, **kwargs)
    async with server:
        yield server
