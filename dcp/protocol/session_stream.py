"""The per-stream record of a ``ClientSession`` (shared by ``session.py`` and ``decode.py``)
and the session's index of its STREAMING streams by vbucket.

Rules of this module:
- ``SessionStream`` is state only, no behaviour: the session makes the transitions
  (REQUESTED --OK--> STREAMING --STREAM_END--> forgotten; REQUESTED --any other
  answer--> forgotten) and opens/completes snapshots; the decoder reads ``open``/``end``
  and adds to ``held``.
- ``StreamingIndex`` maps a vbucket to the stream a scan of the session's ``streams``
  (by opaque, in insertion order) for the first STREAMING one of that vbucket would
  find, at the cost of a dict lookup. The session tells it of every acceptance and
  every removal from ``streams``; only when two streams of one vbucket meet (which a
  server refuses, but a session does not trust) does it scan.
"""

from __future__ import annotations

__all__ = ["REQUESTED", "STREAMING", "SessionStream", "StreamingIndex"]

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


class StreamingIndex(dict[int, SessionStream]):
    """vbucket -> its STREAMING stream (module rules); read it with ``get``."""

    def accepted(self, st: SessionStream, streams: dict[int, SessionStream]) -> None:
        """``st`` (in ``streams``) was accepted: it is STREAMING from now on."""
        st.state = STREAMING
        if self.setdefault(st.vbucket, st) is not st:
            self._rescan(st.vbucket, streams)

    def dropped(self, st: SessionStream, streams: dict[int, SessionStream]) -> None:
        """``st`` left ``streams`` (ended, forgotten, refused, replaced)."""
        if self.get(st.vbucket) is st:
            del self[st.vbucket]
            self._rescan(st.vbucket, streams)

    def _rescan(self, vbucket: int, streams: dict[int, SessionStream]) -> None:
        for other in streams.values():
            if other.vbucket == vbucket and other.state == STREAMING:
                self[vbucket] = other
                return
        self.pop(vbucket, None)
