"""Backfills: disk reads for streams that start (or fall) behind what memory holds.

Rules of this module:
- ``Backfills`` owns the backfill limiters: one server-wide, ``backfill_disk_readers``
  wide (disk reads at once, held around each chunk's read only, so every connection's
  scans take turns in FIFO order and a huge scan never starves another), and one per
  connection, ``max_concurrent_backfills`` wide (scans a connection holds at once, so
  one stream's items are sent while another's are read). A read from the page cache
  is CPU-bound Python holding the GIL: more reads at once only trade the GIL and cost
  server CPU, which is why the server-wide default is 1 (config.py).
- ``start`` is the ``ActiveStream``'s ``on_backfill`` callback; it runs ``run`` for
  the stream in the nursery the server gave (its background nursery), so a
  backfill never outlives the server and never blocks the connection that asked.
- A scan reads in chunks in ``trio.to_thread.run_sync``; the stream is fed on the trio
  thread between awaits (``push_backfill_*``) and its connection is told to send
  (``mark_ready``). A storage error ends the stream with BACKFILL_FAIL; it never
  escapes into the nursery.
- Only a change-stream stream (``stream.history``) is sent the superseded versions a
  history window keeps; every other stream's scan gives each key's newest version in
  the disk snapshot (``every_version=False``), the DCP "each key once" snapshot.
- Disk items are charged ``layout.MUTATION_FRAME_OVERHEAD`` + key + value bytes, as
  ``stream_frames`` counts them out and as flow control counts their frames.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import trio

from ..protocol.layout import MUTATION_FRAME_OVERHEAD
from ..protocol.opcodes import StreamEndStatus
from .config import ServerConfig
from .engine import LmdbStorage, StorageError
from .metrics import ServerMetrics

if TYPE_CHECKING:
    from .active_stream import ActiveStream

__all__ = ["Backfills"]

log = logging.getLogger("dcp.backfill")
_BACKFILL_CHUNK = 4096
#: seconds between two checks of a backfill waiting for its stream's writer (a stream
#: that stops does not wake its backfill itself)
_RECHECK = 0.05


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
        self.nbytes = MUTATION_FRAME_OVERHEAD * len(items) + sum(
            len(it.key) + len(it.value) for it in items
        )


class Backfills:
    """The server's disk backfills (see the module rules)."""

    def __init__(
        self,
        storage: LmdbStorage,
        config: ServerConfig,
        metrics: ServerMetrics,
        nursery: trio.Nursery,
    ) -> None:
        self.storage = storage
        self.config = config
        self.metrics = metrics
        self._nursery = nursery
        self._disk = trio.CapacityLimiter(config.backfill_disk_readers)
        self._slots: dict[int, trio.CapacityLimiter] = {}
        #: backfills waiting for the writer (``_wait_sent``) and whether ``_recheck`` runs
        self._waiting: set[trio.Event] = set()
        self._rechecking = False

    def start(self, stream: ActiveStream) -> None:
        """Backfill ``stream`` from ``stream.backfill_from`` (its ``on_backfill``)."""
        self._nursery.start_soon(self.run, stream)

    def slots(self, conn_id: int) -> trio.CapacityLimiter:
        """Connection ``conn_id``'s own backfill limiter (created on first use)."""
        lim = self._slots.get(conn_id)
        if lim is None:
            lim = trio.CapacityLimiter(self.config.max_concurrent_backfills)
            self._slots[conn_id] = lim
        return lim

    def connection_closed(self, conn_id: int) -> None:
        self._slots.pop(conn_id, None)

    async def _wait_sent(self, stream: ActiveStream) -> None:
        """Until the writer took some of ``stream``'s buffered bytes, or the next recheck.

        One task (``_recheck``) wakes every waiter now and then, rather than a timeout
        per wait: a cancel scope per wait was a visible part of the event loop's work per
        backfilled vbucket.
        """
        sent = trio.Event()
        stream.on_backfill_sent = sent.set
        self._waiting.add(sent)
        if not self._rechecking:
            self._rechecking = True
            self._nursery.start_soon(self._recheck)
        try:
            await sent.wait()
        finally:
            self._waiting.discard(sent)
            stream.on_backfill_sent = None

    async def _recheck(self) -> None:
        """Wake every ``_wait_sent`` each ``_RECHECK`` seconds while there are any."""
        try:
            while self._waiting:
                await trio.sleep(_RECHECK)
                for sent in list(self._waiting):
                    sent.set()
        finally:
            self._rechecking = False

    async def run(self, stream: ActiveStream) -> None:
        """Read ``(stream.backfill_from, P]`` from disk as one disk snapshot, in chunks.

        Memory is bounded per connection, whatever its number of streams: a stream holds
        one of its connection's ``max_concurrent_backfills`` slots from the start of its
        scan until the writer has drained what the scan buffered, and a scan pauses at
        ``backfill_buffer_bytes`` (chunks are sized to the room left). The server-wide
        limiter is held only around each disk read, so a stalled client never holds up
        other clients' backfills, and a long scan queues again behind the others after
        every chunk.
        """
        conn = stream.conn
        storage = self.storage
        limit = self.config.backfill_buffer_bytes
        disk = self._disk
        from_seqno = stream.backfill_from
        assert from_seqno is not None
        self.metrics.backfills_started += 1
        scan = None
        sent = 0

        def stopped() -> bool:
            return stream.end_status is not None or stream.is_dead

        async def buffered_below(level: int) -> None:
            """Until the writer has taken the stream's buffered disk bytes below ``level``
            (woken by the stream as bytes go out; re-checked now and then for stops)."""
            while stream.backfill_bytes > level and not stopped():
                await self._wait_sent(stream)

        frames = not stream.options.no_value  # ready frames; else items encoded per stream
        upto = stream.end_seqno
        opaque = stream.opaque
        every_version = stream.history

        def read(scan: Any, want: int) -> Any:
            if frames:
                return scan.read_frames(want, upto, opaque)
            return _ItemsChunk(scan.read(want), upto)

        def open_and_read(want: int) -> tuple[Any, Any]:
            # one thread hop for a small vbucket: open, first chunk (often all of it)
            # only change-stream clients (stream.history) get superseded versions
            sc = storage.open_backfill(stream.vbid, from_seqno, every_version=every_version)
            try:
                return sc, read(sc, want)
            except BaseException:
                sc.close()
                raise

        try:
            async with self.slots(conn.id):
                if stopped():
                    return
                avg = 256  # bytes per item, refined from each chunk
                want = max(16, min(_BACKFILL_CHUNK, max(limit - stream.backfill_bytes, avg) // avg))
                # the disk limiter is held for the thread's run (to_thread's own limiter)
                scan, chunk = await trio.to_thread.run_sync(open_and_read, want, limiter=disk)
                end = scan.end_seqno
                stream.history = bool(stream.history and scan.history)
                log.debug(
                    "backfill start name=%s vb=%d from=%d disk_end=%d",
                    stream.name,
                    stream.vbid,
                    from_seqno,
                    end,
                )
                first = True
                while not stopped():
                    if first:
                        first = False
                        # A first record past ``upto`` still opens the marker: a cut inside
                        # a deduplicated snapshot must be visible (push_backfill_marker).
                        start = chunk.first or chunk.beyond
                        if start:
                            stream.push_backfill_marker(
                                start, end, may_contain_duplicates=scan.may_contain_duplicates
                            )
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
                    chunk = await trio.to_thread.run_sync(read, scan, want, limiter=disk)
                    if stopped():
                        break
                if stopped():
                    return
                stream.push_backfill_done(end)
                conn.mark_ready(stream)
                log.debug(
                    "backfill end name=%s vb=%d items=%d disk_end=%d",
                    stream.name,
                    stream.vbid,
                    sent,
                    end,
                )
                self.metrics.backfills_completed += 1
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
