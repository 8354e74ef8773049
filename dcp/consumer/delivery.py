"""The queue between the connection's reader task and the application.

Rules of this module:
- One producer (the current connection's reader) and one consumer (the application's
  iteration). The reader appends whole lists per received chunk (never one channel
  send per item); the application pops one entry at a time, so what it has been
  handed is exactly what it has seen.
- Entries: ``SnapshotBatch``, ``RollbackEvent``, or ``RawChunk`` (raw mode).
- Terminal states are delivered *after* everything queued before them: ``finish()``
  (all streams reached their end) ends iteration, ``fail(exc)`` raises ``exc``.
  ``close()`` (the client was closed) takes effect at once.
- Superseded batches are purged: those of a lost connection at once, those of an older
  stream generation of a vbucket when a new stream is requested for it (they would be
  delivered again anyway). Rollback events are never purged. The bytes of a purged batch
  become ackable on the connection that sent it, which may not be the one that purged
  (a vbucket moved between nodes) and may receive nothing more for a long time: so
  ``on_dropped`` (the client's) is told of each such connection's flow control, to send
  the ack that is due there at once.
- Size is bounded by flow control (the server stops at the window); with flow control
  off the reader waits in ``wait_below`` instead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import trio

from dcp.protocol.flow_control import FlowControl

from .batches import RollbackEvent, SnapshotBatch
from .errors import ClientClosedError

__all__ = ["CommitPoint", "Delivery", "Entry", "RawChunk"]


class CommitPoint:
    """Raw mode: marks where a snapshot completed inside the event stream (not yielded)."""

    __slots__ = ("batch",)

    def __init__(self, batch: SnapshotBatch) -> None:
        self.batch = batch


class RawChunk:
    """Raw mode: the events decoded from one received chunk, with their wire bytes."""

    __slots__ = ("events", "flow", "nbytes")

    def __init__(self, events: list[Any], nbytes: int, flow: FlowControl) -> None:
        self.events = events  # items, raw markers/stream ends, rollbacks, CommitPoints
        self.nbytes = nbytes
        self.flow = flow


#: What the queue holds.
Entry = SnapshotBatch | RollbackEvent | RawChunk


class Delivery:
    """The queue of ``Entry`` values from the connection's reader to the application."""

    def __init__(self) -> None:
        self._items: deque[Entry] = deque()
        self._wakeup = trio.Event()
        self._space = trio.Event()
        self._error: BaseException | None = None
        self._finished = False
        self._closed = False
        self.nbytes = 0  # wire bytes queued (for the reader's own bound without flow control)
        #: told of each flow control whose queued bytes ``purge`` made ackable
        self.on_dropped: Callable[[FlowControl], None] | None = None

    def __len__(self) -> int:
        return len(self._items)

    def put_many(self, entries: list[Entry]) -> None:
        if self._closed:
            return
        for e in entries:
            self.nbytes += getattr(e, "nbytes", 0)
        self._items.extend(entries)
        self._wakeup.set()

    def purge(self, gens: dict[int, int]) -> int:
        """Drop queued batches of vbucket ``vb`` from generations older than ``gens[vb]``."""
        if not self._items or not gens:
            return 0
        keep: deque[Entry] = deque()
        flows: dict[int, FlowControl] = {}
        dropped = 0
        get = gens.get
        for e in self._items:
            if type(e) is SnapshotBatch and e.gen < get(e.vbucket, -1):
                e.flow.dropped(e.nbytes)
                flows[id(e.flow)] = e.flow
                self.nbytes -= e.nbytes
                dropped += 1
            else:
                keep.append(e)
        if dropped:
            self._items = keep
            self._space.set()
            if self.on_dropped is not None:
                for fc in flows.values():
                    self.on_dropped(fc)
        return dropped

    def purge_connection(self, fc: FlowControl) -> int:
        """Drop queued batches received on a lost connection (they will be streamed again
        from the committed position, in order)."""
        before = len(self._items)
        self._items = deque(
            e for e in self._items if not (type(e) is SnapshotBatch and e.flow is fc)
        )
        dropped = before - len(self._items)
        if dropped:
            self.nbytes = sum(getattr(e, "nbytes", 0) for e in self._items)
            self._space.set()
        return dropped

    def purge_vbucket(self, vbucket: int) -> int:
        """Drop every queued batch of ``vbucket`` (its history was rolled back)."""
        return self.purge({vbucket: 1 << 62})

    def fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self._wakeup.set()

    def finish(self) -> None:
        self._finished = True
        self._wakeup.set()

    def close(self) -> None:
        self._closed = True
        self._items.clear()
        self._wakeup.set()
        self._space.set()

    @property
    def closed(self) -> bool:
        return self._closed

    def _pop(self) -> Entry:
        e = self._items.popleft()
        self.nbytes -= getattr(e, "nbytes", 0)
        if not self._items:
            self._space.set()
        return e

    def get_nowait(self) -> Entry | None:
        """The next entry, or ``None`` if nothing is queued (raises at terminal states)."""
        if self._items:
            return self._pop()
        self._raise_terminal()
        return None

    def _raise_terminal(self) -> None:
        if self._closed:
            raise ClientClosedError("the client is closed")
        if self._error is not None:
            raise self._error
        if self._finished:
            raise StopAsyncIteration

    async def get(self) -> Entry:
        """The next entry. Always checkpoints, and before popping: a cancelled ``get``
        never loses an entry."""
        if self._items:
            await trio.lowlevel.checkpoint()
        while not self._items:
            self._raise_terminal()
            self._wakeup = trio.Event()
            await self._wakeup.wait()
        return self._pop()

    async def wait_below(self, limit: int) -> None:
        while self.nbytes > limit and not self._closed:
            self._space = trio.Event()
            await self._space.wait()
