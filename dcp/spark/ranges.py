"""One vbucket range being read: snapshot assembly and the exactness decisions.

Rules of this module:
- Pure: no sockets, no clock. The executor (``executor.py``) adds received items to
  ``RangeRead.rows`` (the snapshot being received, ``changes.Rows``) and calls
  ``marker`` / ``item_done`` at the moments that need a decision; everything a decision
  produces goes to the shared output ``Chunk``, and ``done`` tells the executor to stop
  the server-side stream.
- A snapshot is accepted only when complete (an item at its end, or the next marker), so
  a retry from ``c`` (the last accepted snapshot end) neither repeats nor skips. Every
  prefix of a HISTORY snapshot is a real state, so its items may be accepted at any time.
- The range is handed out once, when read to its end, as one change set: the newest
  version of every key, tagged ``[start + 1, end]`` (``changes.newest_per_key``).
- A snapshot that runs past the planned end without HISTORY is buffered whole and then
  checked (``check_merged``): if every change past the end is a first revision
  (rev_seqno 1), nothing inside the range was replaced and the part up to the end is
  exact; otherwise the range was merged: ``MergedSnapshotError``, or (policy ``reread``)
  the merged snapshot is handed out whole.
"""

from __future__ import annotations

import logging

from dcp.protocol.opcodes import SnapshotMarkerFlag

from .batch_plan import VbRange
from .changes import Chunk, Rows
from .errors import MergedSnapshotError

__all__ = ["BUFFER_BYTES", "RangeRead"]

log = logging.getLogger("dcp.spark")

#: Wire bytes one vbucket range may buffer before it is handed out in parts.
BUFFER_BYTES = 512 * 1024 * 1024
_HISTORY = int(SnapshotMarkerFlag.HISTORY)


class RangeRead:
    """The read of ``(rng.start, rng.end]`` of one vbucket.

    Connection states (kept here, driven by the executor): ``new`` -> ``requested``
    (stream request sent) -> ``open`` (accepted) -> ``closing`` (DCP_CLOSE_STREAM sent,
    waiting for its STREAM_END) -> ``done``; ``retry`` while waiting out a back-off;
    ``moved`` when handed to another node of a cluster (the reader there requests it again).
    """

    __slots__ = (
        "acc",
        "attempts",
        "branch",
        "c",
        "done",
        "end",
        "extend",
        "failing_since",
        "first",
        "flags",
        "nbytes",
        "on_merged",
        "opaque",
        "out",
        "partial",
        "rng",
        "rows",
        "snap_end",
        "snap_start",
        "state",
        "stop",
        "verify",
    )

    def __init__(self, rng: VbRange, out: Chunk, on_merged: str = "fail") -> None:
        self.rng = rng
        self.out = out
        self.on_merged = on_merged
        self.end = rng.end
        self.branch = rng.end_uuid  # the rows' vb_uuid (learnt at stream open when 0)
        self.c = rng.start  # everything up to here is accepted (a snapshot end)
        self.first = rng.start + 1  # snapshot start of the next part handed out
        self.extend = False  # handing out a merged snapshot whole, past the planned end
        self.opaque = 0
        self.state = "new"
        self.snap_start = 0
        self.snap_end = 0  # 0 = no marker yet on this stream
        self.stop = 0  # items at or past this seqno need a decision (``item_done``)
        self.verify = False  # the current snapshot runs past the planned end
        self.flags = 0
        self.rows = Rows()  # the snapshot being received
        self.acc = Rows()  # accepted snapshots of this range
        self.nbytes = 0
        self.partial = False  # part of the range was handed out early (too big)
        self.done = False
        self.attempts = 0
        self.failing_since: float | None = None

    def restart(self) -> None:
        """A new stream request from ``c``: forget the snapshot being received."""
        self.snap_start = self.snap_end = self.flags = self.stop = 0
        self.verify = False
        self.drop_pending()

    def drop_pending(self) -> None:
        self.rows.clear()

    def count_pending(self) -> None:
        """After each received chunk: hand out a too-big snapshot early."""
        rows = self.rows
        if rows.nbytes > BUFFER_BYTES:
            self.item_done(rows.last_seqno())

    # ------------------------------------------------------------------ decisions

    def accept(self) -> None:
        """What was received is complete (a whole snapshot, or a HISTORY prefix)."""
        rows = self.rows
        if len(rows):
            self.c = max(self.c, rows.last_seqno())
            self.acc.extend(rows)
            self.nbytes += rows.nbytes
            self.rows = Rows()
            if self.nbytes > BUFFER_BYTES:
                self.partial = True
                self.hand_out(self.c)

    def hand_out(self, snap_end: int) -> None:
        rng = self.rng
        self.out.add(rng.vbucket, self.first, snap_end, self.acc, self.branch, rng.gen)
        self.acc = Rows()
        self.nbytes = 0
        self.first = snap_end + 1

    def finish(self) -> None:
        """The range is read: hand it out as one change set."""
        if not self.extend:
            self.c = max(self.c, self.end)
        self.hand_out(self.c)
        self.done = True
        self.failing_since = None

    def rollback(self, seqno: int, uuid: int) -> None:
        """The server's history no longer holds the range: one rollback row instead (of
        the next generation: it undoes rows delivered before, on branch ``uuid``)."""
        self.acc = Rows()
        self.drop_pending()
        self.out.add_rollback(self.rng.vbucket, seqno, uuid, self.rng.gen + 1)
        self.done = True

    def snapshot_done(self) -> None:
        """The current snapshot is complete: accept it, advance to its end."""
        if self.verify and not self.extend:
            self.verify = False
            self.check_merged()
            return
        self.accept()
        if self.snap_end:
            self.c = max(self.c, self.snap_end if self.extend else min(self.snap_end, self.end))
        if self.c >= self.end:
            self.finish()

    def marker(self, start: int, end: int, flags: int) -> None:
        if self.snap_end:
            self.snapshot_done()  # the previous snapshot's tail was deduplicated away
            if self.done:
                return
        if start > self.end and not self.extend:
            self.finish()  # the range ended before this snapshot (its tail deduplicated)
            return
        self.snap_start, self.snap_end, self.flags = start, end, flags
        # A snapshot that runs past the planned end without HISTORY: read it whole, then
        # decide in ``check_merged`` whether the part up to the end is the original.
        self.verify = end > self.end and not flags & _HISTORY and not self.extend
        self.stop = end if self.extend or self.verify else min(end, self.end)

    def check_merged(self) -> None:
        """The snapshot ran past the planned end and is now complete. A later change can
        only have replaced (deduplicated) a version inside the range if it is a revision
        of an existing document (rev_seqno > 1): when every change past the end is a
        first revision, the part up to the end is exactly the original range; otherwise
        the range was merged."""
        rows = self.rows
        tail = rows.split_after(self.end)
        if all(rev == 1 for rev in tail.column(5)):
            self.accept()
            self.finish()
            return
        rows.extend(tail)  # merged: the snapshot stays whole
        rng = self.rng
        if self.on_merged != "reread":
            raise MergedSnapshotError(
                rng.vbucket, rng.start, rng.end, self.snap_start, self.snap_end, self.flags
            )
        # The rows are tagged as every change set is, from where the range (or its part
        # not yet handed out) began: ``first``, not the server's snapshot start, which is
        # only where the disk happened to hold the first surviving version.
        log.warning(
            "vbucket %d: range (%d, %d] was merged into the server's snapshot [%d, %d] "
            "since it was planned; handing it out whole as rows tagged snapshot_start=%d, "
            "snapshot_end=%d (rows past seqno %d included)",
            rng.vbucket,
            rng.start,
            rng.end,
            self.snap_start,
            self.snap_end,
            self.first,
            self.snap_end,
            rng.end,
        )
        self.extend = True
        self.snapshot_done()

    def item_done(self, seqno: int) -> None:
        """After an item (or seqno-advanced) at or past ``stop``, or when the snapshot
        buffer grew too big."""
        if self.verify:
            if seqno >= self.snap_end:
                self.snapshot_done()
            return  # a snapshot being checked is buffered whole, whatever its size
        if seqno > self.end and not self.extend:  # a HISTORY snapshot runs past the range
            rows = self.rows
            if len(rows) and rows.last_seqno() == seqno:
                rows.drop_last()
            self.accept()
            self.finish()
        elif seqno >= self.snap_end:
            self.snapshot_done()
        elif seqno >= self.stop:  # a HISTORY snapshot, cut at the planned end
            self.accept()
            self.finish()
        elif self.flags & _HISTORY:
            self.accept()  # every prefix of a history snapshot is a real state
        elif self.rows.nbytes > BUFFER_BYTES:
            self.partial = True  # a snapshot bigger than the buffer: handed out in parts
            self.accept()
