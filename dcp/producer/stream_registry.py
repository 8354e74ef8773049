"""StreamRegistry: every open stream by vbucket, and who to wake when a vbucket changes.

Rules of this module:
- ``StreamRegistry`` owns the streams-by-vbucket index and the dirty set. The bucket's
  listener only records a changed vbucket (``mark_dirty``, an ``add`` on the set: the
  engine's write path pays no more); ``wake_dirty`` marks their streams ready once per
  batch of requests (the connection's reader calls it after each received chunk) and
  tells persistence that items are queued.
- A stream is added when its stream request is accepted (``add`` also records its
  connection on it: ``stream.conn``) and removed when it ends or its connection closes.
  The registry ends streams only when told to: ``end_streams`` after a real state change
  of their vbucket (STREAM_END StateChanged), whoever made it.
- ``run_housekeeping`` (the server's background nursery, until cancelled) wakes streams
  whose cursors the bucket dropped and frees retained checkpoints whose time is up.
- Synchronous but for the housekeeping loop; no sockets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from ..protocol.opcodes import StreamEndStatus
from .engine import Bucket

if TYPE_CHECKING:
    from .active_stream import ActiveStream
    from .connection import Connection

__all__ = ["StreamRegistry"]

_HOUSEKEEPING_PERIOD = 0.05
_RELEASE_EVERY = 20  # housekeeping ticks between releases of retained checkpoints (~1 s)


class StreamRegistry:
    """Streams by vbucket and the vbuckets with new items (see the module rules)."""

    def __init__(self, on_new_items: Callable[[], None]) -> None:
        self._by_vb: dict[int, set[ActiveStream]] = {}
        self._dirty: set[int] = set()
        self._on_new_items = on_new_items
        self._later: set[ActiveStream] = set()
        #: the bucket listener: vbucket ``vbid`` got new items (or state)
        self.mark_dirty: Callable[[int], None] = self._dirty.add

    def add(self, conn: Connection, stream: ActiveStream) -> None:
        stream.conn = conn
        self._by_vb.setdefault(stream.vbid, set()).add(stream)

    def remove(self, stream: ActiveStream) -> None:
        s = self._by_vb.get(stream.vbid)
        if s is not None:
            s.discard(stream)

    def of(self, vbid: int) -> list[ActiveStream]:
        """The streams of vbucket ``vbid``."""
        return list(self._by_vb.get(vbid, ()))

    def end_streams(
        self, vbid: int, reason: StreamEndStatus, keep: ActiveStream | None = None
    ) -> int:
        """End every live stream of vbucket ``vbid`` but ``keep`` with STREAM_END
        ``reason``: the end is the next frame each sends (whatever it had queued is
        dropped), and its connection's writer is woken to send it. Returns how many.

        Called after every real state change of the vbucket (kv_engine ends its producer
        streams with StateChanged then): a client must not go on reading a copy that
        stopped being the one it asked for. ``keep`` is a takeover stream changing its
        own vbucket's state (takeover.py)."""
        n = 0
        for stream in list(self._by_vb.get(vbid, ())):
            if stream is keep or stream.is_dead or stream.end_status is not None:
                continue
            stream.set_end(reason)
            if stream.conn is not None:
                stream.conn.mark_ready(stream)
            n += 1
        return n

    def all(self) -> list[ActiveStream]:
        return [s for ss in self._by_vb.values() for s in ss]

    def wake_dirty(self) -> None:
        """Mark streams of vbuckets that got new items ready (once per request batch)."""
        dirty = self._dirty
        if dirty:
            by_vb = self._by_vb
            for vb in dirty:
                for s in by_vb.get(vb, ()):
                    s.conn.mark_ready(s)
            dirty.clear()
            self._on_new_items()

    def wake_later(self, stream: ActiveStream) -> None:
        """Mark ``stream`` ready at the next housekeeping tick (a takeover waiting for its
        vbucket's state to reach the disk polls this way)."""
        self._later.add(stream)

    async def run_housekeeping(self, bucket: Bucket, retain_seconds: float) -> None:
        """Wake streams whose cursors were dropped, so they switch to backfill promptly,
        and free retained checkpoints whose time is up (about once a second).

        The walk over every stream runs only after the bucket dropped a cursor: walking
        16 x 1024 idle streams every 50 ms cost 0.12 CPU-s per second
        (docs/benchmarks.md)."""
        seen = -1
        ticks = 0
        while True:
            await trio.sleep(_HOUSEKEEPING_PERIOD)
            ticks += 1
            if self._later:
                later, self._later = self._later, set()
                for stream in later:
                    if stream.conn is not None and not stream.is_dead:
                        stream.conn.mark_ready(stream)
            if retain_seconds and ticks % _RELEASE_EVERY == 0:
                bucket.release_retained()
            dropped = bucket.cursors_dropped
            if dropped == seen:
                continue
            seen = dropped
            for stream in self.all():
                cursor = stream.cursor
                if cursor is not None and cursor.dropped:
                    stream.conn.mark_ready(stream)
