"""StableGate: holds a stable-only stream's snapshots until no single failure can undo them.

Rules of this module:
- One gate per ``ActiveStream`` whose connection turned on the ``stable_only`` control
  (a stream without it has no gate: its only cost is one ``is not None`` per marker).
  The stream asks ``holds(seqno)`` before a snapshot marker (memory or disk) or the end
  of a disk snapshot leaves; True means "not yet": the stream puts the entry back and
  reports nothing ready, so its queued items stay queued and nothing more is read from
  the checkpoint while it waits (bounded memory).
- The stable seqno is the server's ``DurabilityMonitor.stable_seqno(vb)``
  (durability.py): the highest seqno a majority of the vbucket's copies hold, or on a
  single node the persisted seqno. The stream reaches the monitor through its
  connection (``stream.conn.server.durability``), recorded when the stream was added.
- At most one ``wait_stable`` is registered per gate at a time (not one per ``fill``
  call): the monitor's callbacks are one-shot, and it may call one early (a topology or
  state change), so the callback clears the flag and marks the stream ready; the next
  ``fill`` checks again and waits again if it must. Synchronous; nothing here awaits.
- A stream that goes away (``ActiveStream.release``) ``cancel``s the callback: the
  monitor would otherwise keep it, and through it the stream, its queued snapshot and
  its connection, until the vbucket's stable seqno reaches the seqno it waited for,
  which may be never (persistence stopped, replicas gone).
"""

from __future__ import annotations

from typing import Any

__all__ = ["StableGate"]


class StableGate:
    """The stable-seqno check of one stream (see the module rules)."""

    __slots__ = ("_stream", "waiting")

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        #: a ``wait_stable`` callback is registered and has not fired yet
        self.waiting = False

    def holds(self, seqno: int) -> bool:
        """True while ``seqno`` is above the vbucket's stable seqno; the stream is then
        marked ready again once it may have moved."""
        stream = self._stream
        durability = stream.conn.server.durability
        if seqno <= durability.stable_seqno(stream.vbid):
            return False
        if not self.waiting:
            self.waiting = True
            durability.wait_stable(stream.vbid, seqno, self._woken)
        return True

    def cancel(self) -> None:
        """The stream is gone: take the registered callback back, if any."""
        if self.waiting:
            self.waiting = False
            stream = self._stream
            stream.conn.server.durability.cancel_wait(stream.vbid, self._woken)

    def _woken(self) -> None:
        self.waiting = False
        stream = self._stream
        conn = stream.conn
        if conn is not None and not conn.closed and not stream.is_dead:
            conn.mark_ready(stream)
