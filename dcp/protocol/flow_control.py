"""Flow control of a DCP consumer: which received bytes may be acknowledged, and when.

Rules of this module:
- One ``FlowControl`` per connection, owned by its ``ClientSession`` (``session.py``),
  which moves bytes between the places below as frames arrive; acks never cross
  connections (a new connection starts at 0 outstanding). Pure accounting, no I/O:
  methods return the number of bytes to put in one BUFFER_ACK (0 = nothing to send now).
- Every producer->client request except DCP_NOOP counts (its full wire size). Each byte
  is in exactly one of three places:
    * ``held``   - in a partial snapshot (not complete yet);
    * ``queued`` - in complete batches waiting for the application;
    * ``ackable``- handed to the application, discarded, or not snapshot data at all.
  Bytes move held -> queued when a snapshot completes and queued -> ackable when the
  batch is handed to the application. One BUFFER_ACK is sent when ``ackable`` reaches
  the threshold (``ack_ratio`` x window).
- Never stall: when nothing is queued (the application has taken everything) and
  held + ackable reaches the threshold, the held bytes of partial snapshots are released
  (made ackable) before the snapshot completes. So a snapshot larger than the window
  still completes; the price is that the SDK then buffers up to one snapshot per
  vbucket in memory, beyond the window. With the application not consuming, nothing is
  released and the server stops at the window: that is the back-pressure.
- Window 0 disables flow control (no acks; the reader then bounds its queue itself).
"""

from __future__ import annotations

__all__ = ["FlowControl"]


class FlowControl:
    __slots__ = (
        "ackable",
        "acked_total",
        "closed",
        "enabled",
        "held",
        "queued",
        "release",
        "threshold",
        "window",
    )

    def __init__(self, window: int, ack_ratio: float = 0.2) -> None:
        self.window = window
        self.enabled = window > 0
        self.threshold = max(1, int(window * ack_ratio)) if window > 0 else 0
        self.held = 0
        self.queued = 0
        self.ackable = 0
        self.acked_total = 0
        self.closed = False
        #: Called to release partial-snapshot bytes: must zero every stream's held count
        #: and return the total it zeroed (set by the connection that owns the streams).
        self.release = _release_nothing

    def _due(self) -> int:
        if not self.enabled or self.closed:
            return 0
        if self.queued == 0 and self.held and self.ackable + self.held >= self.threshold:
            freed = self.release()
            self.held -= freed
            self.ackable += freed
        if self.ackable >= self.threshold:
            n = self.ackable
            self.ackable = 0
            self.acked_total += n
            return n
        return 0

    def after_receive(self) -> int:
        """The reader finished a chunk; bytes to ack now."""
        return self._due()

    def handed(self, nbytes: int) -> int:
        """A batch of ``nbytes`` queued bytes reached the application; bytes to ack now."""
        if self.closed:
            return 0
        self.queued -= nbytes
        self.ackable += nbytes
        return self._due()

    def dropped(self, nbytes: int) -> None:
        """A queued batch was discarded without delivery (superseded by a new stream)."""
        if not self.closed:
            self.queued -= nbytes
            self.ackable += nbytes

    def due(self) -> int:
        """Bytes to ack now, e.g. after ``dropped``: nothing else may arrive on the
        connection to trigger the ack (its vbucket moved to another connection)."""
        return self._due()

    def statistics(self) -> dict[str, int]:
        return {
            "window": self.window,
            "threshold": self.threshold,
            "held": self.held,
            "queued": self.queued,
            "ackable": self.ackable,
            "acked_total": self.acked_total,
        }


def _release_nothing() -> int:
    return 0
