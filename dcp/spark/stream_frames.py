"""What each DCP frame of a range's stream means for the range: the handlers of the
executor's ``_Reader`` (``executor.py``), kept apart from its connection and retries.

Rules of this module:
- A mixin: the handlers act on ``RangeRead`` (``ranges.py``: the pure decisions) and ask
  the reader to close a stream, retry a range or move it to another node; they never
  touch the socket.
- Events for a stream in the wrong state (a late frame of a stream already closed,
  retried or moved to another node) are ignored.
- History checks: a ROLLBACK answer, or a failover log showing the planned end is no
  longer on the server's history, raises ``RollbackDetectedError``; with ``rewind`` the
  vbucket yields one rollback row (at a change-set boundary at or below the rollback
  seqno: ``batch_plan.rewind_point``) and nothing else. On a cluster the same checks
  decide a range re-requested on a vbucket's new owner: on its branch it is read on,
  off it the rollback policy applies, never silently.
- A retriable refusal (NOT_MY_VBUCKET, ETMPFAIL, ...) or stream end (STATE_CHANGED, ...)
  is retried, after the reader has looked where the vbucket lives now (``relocate``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from dcp.protocol import SEQNO_MAX, Status, StreamEndStatus
from dcp.protocol import events as ev

from .batch_plan import branch_uuid, rewind_point, rollback_seqno
from .errors import RangeUnavailableError, RollbackDetectedError
from .offsets import VbPosition
from .options import SourceConfig
from .ranges import RangeRead

__all__ = ["StreamFrames"]

log = logging.getLogger("dcp.spark")

_RETRIABLE_END = {
    StreamEndStatus.DISCONNECTED,
    StreamEndStatus.SLOW,
    StreamEndStatus.BACKFILL_FAIL,
    StreamEndStatus.STATE_CHANGED,
    StreamEndStatus.ROLLBACK,
}
_RETRIABLE_STATUS = {Status.NOT_MY_VBUCKET, Status.ETMPFAIL, Status.EBUSY, Status.ENOMEM}


class StreamFrames:
    """The frame handlers of a reader (see the module rules); the reader supplies the
    attributes and the four actions below."""

    cfg: SourceConfig
    by_opaque: dict[int, RangeRead]

    def close_stream(self, st: RangeRead) -> None:
        raise NotImplementedError

    def settle(self, st: RangeRead) -> None:
        raise NotImplementedError

    def schedule_retry(self, st: RangeRead, why: str) -> None:
        raise NotImplementedError

    def relocate(self, sts: Sequence[RangeRead], body: bytes | None = None) -> None:
        raise NotImplementedError

    def rolled_back(
        self,
        st: RangeRead,
        uuid: int,
        seqno: int,
        r: int,
        detail: str,
        flog: list[tuple[int, int]] | None = None,
    ) -> None:
        """Position ``(uuid, seqno)`` of this range is off the server's history."""
        rng = st.rng
        if self.cfg.on_rollback != "rewind":
            raise RollbackDetectedError(rng.vbucket, uuid, seqno, r, "reading", detail)
        at = rewind_point(rng.start, rng.prev, r)
        log.warning("vbucket %d: %s; emitting a rollback row to seqno %d", rng.vbucket, detail, at)
        st.rollback(at, branch_uuid(flog, at) if flog else 0)
        if st.state == "requested":  # the ROLLBACK answer: the server opened no stream
            st.state = "done"
        else:
            self.close_stream(st)

    # ------------------------------------------------------------------ control frames

    def _stream_opened(self, e: ev.StreamOpened) -> None:
        st = self.by_opaque.get(e.opaque)
        if st is None or st.state != "requested":
            return
        st.state = "open"
        rng = st.rng
        flog = list(e.failover_log)
        if not st.branch:
            st.branch = branch_uuid(flog, rng.end)
        if rng.end_uuid:
            r = rollback_seqno(VbPosition(rng.end_uuid, rng.end), flog, SEQNO_MAX)
            if r is not None:
                self.rolled_back(
                    st,
                    rng.end_uuid,
                    rng.end,
                    r,
                    (
                        f"the planned end (uuid {rng.end_uuid}, seqno {rng.end}) is no longer "
                        f"on the server's history (failover log {flog})"
                    ),
                    flog,
                )

    def _stream_rollback(self, e: ev.StreamRollback) -> None:
        st = self.by_opaque.get(e.opaque)
        if st is None or st.state != "requested":
            return
        self.rolled_back(
            st,
            st.rng.uuid,
            st.c,
            e.seqno,
            (
                f"the stream request at (uuid {st.rng.uuid}, seqno {st.c}) was answered "
                f"ROLLBACK to {e.seqno}"
            ),
        )

    def _stream_refused(self, e: ev.StreamRefused) -> None:
        st = self.by_opaque.get(e.opaque)
        if st is None or st.state != "requested":
            return
        status = e.status
        if status in _RETRIABLE_STATUS:
            self.schedule_retry(st, f"stream request answered status 0x{status:02x}")
            self.relocate([st], e.value if status == Status.NOT_MY_VBUCKET else None)
            return
        rng = st.rng
        raise RangeUnavailableError(
            f"vbucket {rng.vbucket}: the server refused the stream request for (seqno {st.c}, "
            f"{rng.end}] (uuid {rng.uuid}) with status 0x{status:02x}: "
            f"{e.value[:200].decode('utf-8', 'replace')}"
        )

    def _answer(self, e: ev.Answer) -> None:
        st = self.by_opaque.get(e.opaque)
        if st is not None and e.result.status and st.state == "closing":
            st.state = "done"  # no stream to close (it had already ended)

    def _stream_ended(self, e: ev.StreamEnded) -> None:
        st = self.by_opaque.get(e.opaque)
        if st is not None and st.state in ("open", "closing"):
            self.stream_end(st, e.reason)

    def stream_end(self, st: RangeRead, reason: int) -> None:
        if st.state == "closing":
            st.state = "done"
            return
        if reason in _RETRIABLE_END or reason == StreamEndStatus.OK:
            # An open-ended stream only ends when the server drops it: resume from the
            # last whole snapshot.
            self.schedule_retry(st, f"stream ended with reason {reason}")
            self.relocate([st])
            return
        raise RangeUnavailableError(
            f"vbucket {st.rng.vbucket}: stream ended with reason "
            f"{reason} at seqno {st.c} of (..., {st.end}]"
        )

    # ------------------------------------------------------------------ data events

    def _items(self, e: ev.Items | ev.ItemFrames, batch: Any = None) -> None:
        """A run of items as one record batch (``batch``: the run decoded by
        ``columns.from_runs`` with the rest of its chunk; else from the run's row tuples),
        added to the range in slices that end at the rows needing a decision (at or past
        ``stop``); rows after a decision that closed the stream are dropped. (The buffered
        bytes are counted per chunk, in ``_feed``.)"""
        st = self.by_opaque.get(e.opaque)
        if st is None or st.state != "open":
            return
        from numpy import searchsorted

        from .columns import from_frames, from_rows

        if batch is None:
            if isinstance(e, ev.ItemFrames):
                batch = from_frames(e.buf, e.starts)
            else:
                batch = from_rows(e.items)
        seqnos = batch.column(0).to_numpy()
        n = len(seqnos)
        per_row = e.nbytes / n if n else 0  # wire bytes: what the rows cost to buffer
        i = 0
        while i < n:
            j = max(i, int(searchsorted(seqnos, st.stop, "left")))
            k = j + 1 if j < n else n
            st.rows.add(batch.slice(i, k - i) if i or k < n else batch, int(per_row * (k - i)))
            i = k
            if j < n:
                st.item_done(int(seqnos[j]))
                self.settle(st)
                if st.state != "open":
                    return

    def _marker(self, e: ev.Marker) -> None:
        st = self.by_opaque.get(e.opaque)
        if st is not None and st.state == "open":
            st.marker(e.start, e.end, e.flags)
            self.settle(st)

    def _seqno_advanced(self, e: ev.SeqnoAdvanced) -> None:
        st = self.by_opaque.get(e.opaque)
        if st is not None and st.state == "open":
            st.item_done(e.seqno)
            self.settle(st)
