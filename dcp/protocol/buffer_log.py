"""Flow control of a DCP producer connection (kv_engine's ``BufferLog``), as plain accounting.

Rules of this module:
- One ``BufferLog`` per connection, owned by its ``ServerSession`` (``server_session.py``):
  the window comes from the ``connection_buffer_size`` control key, acks from
  DCP_BUFFER_ACKNOWLEDGEMENT frames. No I/O: the writer asks ``can_send()`` before each
  message and ``record(n)`` after it.
- Like kv_engine, a message may be sent whenever outstanding < window, so one message can
  overshoot the window (a single item can exceed it entirely): a client must cope.
- Noops and responses are never counted; only producer->client DCP requests are.
- The client side of the same accounting is ``flow_control.FlowControl``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["BufferLog", "BufferLogState", "BufferLogStatistics"]


class BufferLogState(Enum):
    DISABLED = "disabled"
    SPACE_AVAILABLE = "space_available"
    FULL = "full"


@dataclass(frozen=True, slots=True)
class BufferLogStatistics:
    state: BufferLogState
    window: int
    outstanding: int
    acked_total: int
    sent_total: int


class BufferLog:
    __slots__ = ("acked_total", "outstanding", "sent_total", "window")

    def __init__(self, window: int = 0) -> None:
        self.window = window  # 0 = flow control disabled
        self.outstanding = 0
        self.acked_total = 0
        self.sent_total = 0

    def set_window(self, window: int) -> None:
        self.window = window

    @property
    def state(self) -> BufferLogState:
        if not self.window:
            return BufferLogState.DISABLED
        return (
            BufferLogState.FULL
            if self.outstanding >= self.window
            else (BufferLogState.SPACE_AVAILABLE)
        )

    def can_send(self) -> bool:
        return not self.window or self.outstanding < self.window

    def record(self, nbytes: int) -> None:
        self.outstanding += nbytes
        self.sent_total += nbytes

    def ack(self, nbytes: int) -> None:
        """Apply a buffer ack. Acking more than outstanding clamps at zero (a confused
        client must not be able to buy itself an unbounded window)."""
        self.acked_total += nbytes
        self.outstanding = max(0, self.outstanding - nbytes)

    def statistics(self) -> BufferLogStatistics:
        return BufferLogStatistics(
            self.state, self.window, self.outstanding, self.acked_total, self.sent_total
        )
