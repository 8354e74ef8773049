"""Long-running server loops: flusher, backfill, expiry pager, compaction, housekeeping.

Rules of this module:
- Each loop is started in the server's background nursery and runs until cancelled.
- Storage writes (flush, compaction) hold ``server._storage_lock`` so there is exactly one
  writer. A write and the engine bookkeeping that follows it are shielded from
  cancellation together: a batch is either written *and* completed, or neither.
- Blocking LMDB work runs in ``trio.to_thread.run_sync`` in bounded chunks; the engine's
  in-memory state is touched only between awaits, on the trio thread.
- Storage failures never crash the server: writes get ETMPFAIL meanwhile
  (``server.storage_error``), the flusher retries with backoff, items stay queued.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import trio

from ..protocol.opcodes import StreamEndStatus

if TYPE_CHECKING:
    from .active_stream import ActiveStream
    from .server import DcpServer

__all__ = ["flush_once", "run_backfill", "run_compaction", "run_expiry", "run_flusher",
           "run_housekeeping"]

log = logging.getLogger("dcp.tasks")
_BACKFILL_CHUNK = 4096


class _ItemsChunk:
    """``BackfillScan.read``'s items in the shape of a ``BackfillChunk`` (streams that
    strip values encode each frame themselves)."""

    __slots__ = ("beyond", "count", "first", "last", "nbytes", "segments")

    def __init__(self, items: list[Any], upto: int) -> None:
        # ``last`` is the scan's position (it may have read past ``upto``); only items up
        # to ``upto`` are sent, and ``first`` starts the marker either way.
        self.first = items[0].seqno if items else 0
        self.last = items[-1].seqno if items else 0
        self.beyond = 0
        if items and self.last > upto:
            items = [it for it in items if it.seqno <= upto]
        self.segments = [items] if items else []
        self.count = len(items)
        self.nbytes = 55 * len(items) + sum(len(it.key) + len(it.value) for it in items)


async def flush_once(server: DcpServer, *, respect_pause: bool = False) -> bool:
    """Write one batch. Returns False when nothing was queued (or, with ``respect_pause``,
    when persistence is paused: checked under the storage lock, so a pause takes effect
    even for a flusher that was already waiting for the lock).

    Raises:
        StorageError: the batch could not be written (it stays queued).
    """
    from .engine import StorageError

    bucket = server.bucket
    flusher = bucket.flusher
    with trio.CancelScope(shield=True):
        async with server._storage_lock:
            if respect_pause and server.persistence_paused:
                return False
            batch = flusher.collect(server.config.flush_batch_items)
            if batch is None:
                return False
            try:
                await trio.to_thread.run_sync(bucket.storage.write_batch, batch)
            except StorageError as exc:
                flusher.failed(batch, exc)
                raise
            advanced = flusher.complete(batch)
            # a capped batch left items behind: the flusher must not pause before them
            server.flush_backlog = batch.num_items >= server.config.flush_batch_items
    server.metrics.flushes += 1
    if server.storage_error:
        log.info("storage recovered: flushing again")
        server.storage_error = None
    if advanced:
        for conn in list(server.connections):
            if conn.has_pending_durable():
                conn.wake()
    return True


async def run_flusher(server: DcpServer) -> None:
    from .engine import StorageError

    backoff = 0.05
    interval = server.config.flush_interval
    while True:
        if server.persistence_paused:
            server._flush_event = trio.Event()
            await server._flush_event.wait()
            continue
        # A durable write that arrives from here on is not in this batch: it must cut
        # the pause below short (want_flush sets the event).
        server._durable_event = trio.Event()
        try:
            progressed = await flush_once(server, respect_pause=True)
        except StorageError as exc:
            if server.storage_error != str(exc):
                log.error("flusher error: %s (writes get ETMPFAIL until it clears)", exc)
            server.storage_error = str(exc)
            server.metrics.flush_errors += 1
            await trio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)
            continue
        backoff = 0.05
        if not progressed:
            server._flush_event = trio.Event()
            with trio.move_on_after(0.5):
                await server._flush_event.wait()
        elif interval and not server.flush_backlog and not any(
                conn.has_pending_durable() for conn in server.connections):
            # Persist by time under a trickle of writes: one fsync'd transaction per
            # interval rather than per request batch (each costs the event loop GIL time).
            # Never with a backlog left or a durable write still waiting (it may be of a
            # vbucket a capped batch did not reach).
            with trio.move_on_after(interval):
                await server._durable_event.wait()


async def run_backfill(server: DcpServer, stream: ActiveStream) -> None:
    """Read ``(stream.backfill_from, P]`` from disk as one disk snapshot, in chunks.

    Memory is bounded per connection, whatever its number of streams: a stream holds one
    of its connection's ``max_concurrent_backfills`` slots from the start of its scan until
    the writer has drained what the scan buffered, and a scan pauses at
    ``backfill_buffer_bytes`` (chunks are sized to the room left). The server-wide limiter
    is held only around each disk read, so a stalled client never holds up other
    clients' backfills.
    """
    from .engine import StorageError

    conn = stream.conn  # type: ignore[attr-defined]
    storage = server.bucket.storage
    limit = server.config.backfill_buffer_bytes
    from_seqno = stream.backfill_from
    assert from_seqno is not None
    server.metrics.backfills_started += 1
    scan = None
    sent = 0

    def stopped() -> bool:
        return stream.end_status is not None or stream.is_dead

    async def buffered_below(level: int) -> None:
        """Until the writer has taken the stream's buffered disk bytes below ``level``
        (woken by the stream as bytes go out; re-checked now and then for stops)."""
        while stream.backfill_bytes > level and not stopped():
            sent = trio.Event()
            stream.on_backfill_sent = sent.set
            try:
                with trio.move_on_after(0.05):
                    await sent.wait()
            finally:
                stream.on_backfill_sent = None

    frames = not stream.options.no_value  # ready frames; else items encoded per stream
    upto = stream.end_seqno
    opaque = stream.opaque

    def read(scan: Any, want: int) -> Any:
        if frames:
            return scan.read_frames(want, upto, opaque)
        return _ItemsChunk(scan.read(want), upto)

    def open_and_read(want: int) -> tuple[Any, Any]:
        # one thread hop for a small vbucket: open, first chunk (often all of it)
        sc = storage.open_backfill(stream.vbid, from_seqno)
        try:
            return sc, read(sc, want)
        except BaseException:
            sc.close()
            raise

    try:
        async with server.backfill_slots(conn):
            if stopped():
                return
            avg = 256  # bytes per item, refined from each chunk
            want = max(16, min(_BACKFILL_CHUNK, max(limit - stream.backfill_bytes, avg) // avg))
            async with server._backfill_limiter:
                scan, chunk = await trio.to_thread.run_sync(open_and_read, want)
            end = scan.end_seqno
            stream.history = bool(stream.history and scan.history)
            log.debug("backfill start name=%s vb=%d from=%d disk_end=%d", stream.name,
                      stream.vbid, from_seqno, end)
            first = True
            while not stopped():
                if first:
                    first = False
                    # A first record past ``upto`` still opens the marker: a cut inside a
                    # deduplicated snapshot must be visible (push_backfill_marker).
                    start = chunk.first or chunk.beyond
                    if start:
                        stream.push_backfill_marker(
                            start, end, may_contain_duplicates=scan.may_contain_duplicates)
                if not chunk.count:
                    break
                avg = max(64, chunk.nbytes // chunk.count)
                stream.push_backfill_chunk(chunk)
                sent += chunk.count
                conn.mark_ready(stream)
                if scan.done or chunk.last >= stream.end_seqno:
                    break
                await buffered_below(limit - 1)
                room = max(limit - stream.backfill_bytes, avg)
                want = max(16, min(_BACKFILL_CHUNK, room // avg))
                async with server._backfill_limiter:
                    chunk = await trio.to_thread.run_sync(read, scan, want)
                if stopped():
                    break
            if stopped():
                return
            stream.push_backfill_done(end)
            conn.mark_ready(stream)
            log.debug("backfill end name=%s vb=%d items=%d disk_end=%d", stream.name,
                      stream.vbid, sent, end)
            server.metrics.backfills_completed += 1
            scan.close()
            scan = None
            # Keep the slot until the writer took what we buffered (bounded memory).
            await buffered_below(0)
    except StorageError as exc:
        log.error("backfill failed name=%s vb=%d: %s", stream.name, stream.vbid, exc)
        stream.set_end(StreamEndStatus.BACKFILL_FAIL)
        conn.mark_ready(stream)
    finally:
        if scan is not None:
            scan.close()


async def run_expiry(server: DcpServer) -> None:
    while True:
        await trio.sleep(server.config.expiry_interval)
        n = server.bucket.expire(server.clock())
        if n:
            log.info("expiry pager expired=%d", n)
            server.wake_dirty()


async def run_compaction(server: DcpServer) -> None:
    """Purge tombstones older than the purge age (raises purge seqnos)."""
    while True:
        await trio.sleep(server.config.compaction_interval)
        await compact_now(server)


async def compact_now(server: DcpServer) -> int:
    from .engine import StorageError

    bucket = server.bucket
    try:
        with trio.CancelScope(shield=True):
            async with server._storage_lock:
                job = bucket.storage.prepare_compaction(bucket, server.clock())
                result = await trio.to_thread.run_sync(bucket.storage.run_compaction, job)
                purged = bucket.storage.complete_compaction(bucket, job, result)
    except StorageError as exc:
        log.error("compaction failed: %s", exc)
        return 0
    if purged:
        log.info("compaction purged=%d tombstones", purged)
    return purged


async def run_housekeeping(server: DcpServer) -> None:
    """Wake streams whose cursors were dropped, so they switch to backfill promptly, and
    free retained checkpoints whose time is up (about once a second).

    The walk over every stream runs only after the bucket dropped a cursor: walking
    16 x 1024 idle streams every 50 ms cost 0.12 CPU-s per second (docs/benchmarks.md)."""
    seen = -1
    ticks = 0
    retain = server.config.checkpoint_retain_seconds
    while True:
        await trio.sleep(0.05)
        ticks += 1
        if retain and ticks % 20 == 0:
            server.bucket.release_retained()
        dropped = server.bucket.cursors_dropped
        if dropped == seen:
            continue
        seen = dropped
        for stream in server.streams():
            cursor = stream.cursor
            if cursor is not None and cursor.dropped:
                stream.conn.mark_ready(stream)  # type: ignore[attr-defined]
