"""The per-stream record of a ``ClientSession`` (shared by ``session.py`` and ``decode.py``).

Rules of this module:
- State only, no behaviour: the session makes the transitions (REQUESTED --OK-->
  STREAMING --STREAM_END--> forgotten; REQUESTED --any other answer--> forgotten) and
  opens/completes snapshots; the decoder reads ``open``/``end`` and adds to ``held``.
"""

from __future__ import annotations

__all__ = ["REQUESTED", "STREAMING", "SessionStream"]

REQUESTED = 0
STREAMING = 1


class SessionStream:
    """One stream request of a session and, once accepted, its open snapshot."""

    __slots__ = ("end", "end_seqno", "held", "opaque", "open", "state", "vbucket")

    def __init__(self, opaque: int, vbucket: int, end_seqno: int) -> None:
        self.opaque = opaque
        self.vbucket = vbucket
        self.end_seqno = end_seqno
        self.state = REQUESTED
        self.open = False  # a marker arrived and its snapshot is not complete yet
        self.end = 0  # the open snapshot's end (clamped to end_seqno)
        self.held = 0  # wire bytes of the open snapshot held by flow control
