"""One replication connection to one source node, kept up for as long as this node
replicates any vbucket from it.

Rules of this module:
- One ``SourceConnection`` per source node, named ``replication:<source>-><node>:default``
  (the name ns_server gives replication connections). ``run`` connects and handshakes
  (``link.py``), requests a stream per wanted vbucket from ``target.position`` and
  reads until the connection fails, then reconnects after a jittered exponential
  backoff, re-requesting every stream from its new position. It returns only after
  ``stop`` (or when cancelled).
- What the streams do is ``stream_table.py``'s; this module is the connection's life:
  one nursery per connection with three tasks (reader, writer, retry opener). One task
  failing ends the connection; every stream's partial snapshot is then dropped, so
  the replica stays at its last whole snapshots.
- A protocol error of the session (``RemoteProtocolError``) is the source's fault and
  ends the connection like a lost link; an unexpected exception is logged with its
  traceback and also only costs a reconnect: replication never takes the node down.
- ``stop`` lets queued frames go out first (a takeover's last ack must reach the source).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable

import trio

from ...protocol.errors import RemoteProtocolError
from ...protocol.opcodes import VBucketState
from .link import Link, LinkLost, SourceSettings
from .make_items import make_session
from .replica_stream import backoff_delay
from .stream_table import StreamTable
from .target import ReplicaTarget

__all__ = ["SourceConnection"]

log = logging.getLogger("dcp.replication")


class SourceConnection:
    """See the module rules. ``on_state(vb, state)``: a takeover stream changed the
    vbucket's state here; ``on_idle()``: nothing is left to stream or finish."""

    def __init__(
        self,
        source: str,
        target: ReplicaTarget,
        settings: SourceSettings,
        *,
        on_state: Callable[[int, VBucketState], None],
        on_idle: Callable[[], None],
    ) -> None:
        self.source = source
        self.settings = settings
        self.name = f"replication:{source}->{target.node_name}:default"
        self.table = StreamTable(self.name, target, settings, on_state=on_state, on_idle=on_idle)
        self.connected = False
        self.started = False
        self.last_error: str | None = None
        self._scope = trio.CancelScope()
        self._stopping = False

    # ------------------------------------------------------------------ the manager's calls

    def want(self, vb: int, takeover: bool) -> None:
        self.table.want(vb, takeover)

    def drop(self, vb: int) -> None:
        self.table.drop(vb)

    def idle(self) -> bool:
        return self.table.idle()

    def vbuckets(self) -> list[int]:
        return sorted(self.table.streams)

    def stream_state(self, vb: int) -> str | None:
        st = self.table.streams.get(vb)
        return None if st is None else st.state

    def source_seqno(self, vb: int) -> int:
        st = self.table.streams.get(vb)
        return 0 if st is None else st.source_seqno

    def flushed(self) -> None:
        """A flush moved persisted seqnos: ack the vbuckets whose did (acks.py)."""
        link = self.table.link
        if link is not None and self.connected:
            self.table.acks.flushed(link, self.table.streams)

    @property
    def counters(self) -> dict[str, int]:
        return self.table.counters

    def stop(self) -> None:
        self._stopping = True
        link = self.table.link
        if link is None:
            self._scope.cancel()
        else:
            link.close_when_flushed()

    # ------------------------------------------------------------------ connection loop

    async def run(self) -> None:
        self.started = True
        cfg = self.settings
        failures = 0
        with self._scope:
            while not self._stopping:
                if failures:
                    self.counters["reconnects"] += 1
                    await trio.sleep(backoff_delay(failures, cfg.backoff_initial, cfg.backoff_max))
                try:
                    await self._connect_and_stream()
                except (LinkLost, RemoteProtocolError) as exc:
                    failures = 1 if self.connected else failures + 1
                    if str(exc) != self.last_error:
                        log.warning("%s: %s; reconnecting", self.name, exc)
                    self.last_error = str(exc)
                except Exception as exc:  # a bug must not take the node down: reconnect
                    failures = 1 if self.connected else failures + 1
                    if repr(exc) != self.last_error:  # once, not at every retry
                        log.exception("%s: unexpected error; reconnecting", self.name)
                    self.last_error = repr(exc)
                else:
                    failures = 0
                finally:
                    self.connected = False
                    self.table.disconnected()
                    if self.table.idle():
                        self.table.on_idle()

    async def _connect_and_stream(self) -> None:
        """One connection's life: returns after ``stop``, raises when it fails."""
        cfg = self.settings
        session = make_session(cfg.window)
        link = await Link.connect(cfg.open_stream, self.source, session, cfg.connect_timeout)
        error: BaseException | None = None
        try:
            try:
                with trio.fail_after(cfg.connect_timeout):
                    await link.handshake(
                        self.name,
                        window=cfg.window,
                        noop_interval=cfg.noop_interval,
                        auth=cfg.auth,
                        consumer_name=cfg.consumer_name,
                    )
            except trio.TooSlowError:
                raise LinkLost(f"handshake timed out after {cfg.connect_timeout:g}s") from None
            self.connected = True
            if self.last_error is not None:
                log.info("%s: connected", self.name)
                self.last_error = None
            async with trio.open_nursery() as nursery:

                async def guarded(fn: Callable[[], Awaitable[None]]) -> None:
                    nonlocal error
                    try:
                        await fn()
                    except Exception as exc:
                        error = error or exc
                    nursery.cancel_scope.cancel()  # one task ending ends the connection

                self.table.connected(link, nursery)
                nursery.start_soon(guarded, link.writer)
                nursery.start_soon(guarded, self._reader)
                nursery.start_soon(guarded, self._opener)
        finally:
            self.table.link = None
            await link.aclose()
        if error is not None:
            raise error

    async def _reader(self) -> None:
        link = self.table.link
        assert link is not None
        size = self.settings.receive_size
        while True:
            self.handle(link, await link.receive(size))

    def handle(self, link: Link, data: bytes | bytearray) -> None:
        """One received chunk: its events, then the acks it made due (at most one per
        vbucket, acks.py), then the session's noop replies and buffer acks."""
        table = self.table
        table.counters["bytes_received"] += len(data)
        handlers = table.handlers
        session = link.session
        for e in session.receive_data(data):
            handlers[type(e)](e)
        table.acks.send(link, table.streams)
        link.send(session.data_to_send())

    async def _opener(self) -> None:
        """Re-request streams whose backoff is over."""
        table = self.table
        while True:
            nxt = table.serve_due(trio.current_time())
            table.due_wake = trio.Event()
            # serve_due took a moment: the next due time may already have passed
            with trio.move_on_after(
                math.inf if nxt is None else max(0.0, nxt - trio.current_time())
            ):
                await table.due_wake.wait()
