"""One node of a cluster as a ``DcpClient`` sees it: the DCP connection that streams the
vbuckets the map routes there, and short control requests (config, seqnos) to any node.

Rules of this module:
- A ``NodeLink`` is one connection's life: connect, handshake, stream its vbuckets
  (``add``/``remove`` while it runs), end. It never reconnects by itself: when the
  connection is lost the runner (``cluster.py``) is told (``link_ended``) and routes the
  vbuckets again, maybe to the same node, with per-vbucket backoff. A link the runner
  closes (``close``: none of its vbuckets streams there any more) reports nothing.
- The link's connection is registered with the supervisor while it lives, so the
  application's hand-off acknowledges a batch's bytes on the connection that sent it
  (flow control is per connection), and a lost connection's queued batches are purged.
- ``control_call`` opens a KV-only connection (HELLO and SASL, no DCP_OPEN, so it never
  replaces a DCP connection of the client's name), runs one request and closes it; a live
  link's connection answers the same requests without a new connection (``ask``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import trio

from dcp.protocol.cluster_config import Address, format_address

from .connection import DcpConnection
from .errors import TransientError

if TYPE_CHECKING:  # the runner owns its links
    from .cluster import ClusterRunner
    from .supervisor import Supervisor

__all__ = ["NodeLink", "control_call"]

T = TypeVar("T")


async def control_call(
    sup: Supervisor, addr: Address, fn: Callable[[DcpConnection], Awaitable[T]]
) -> T:
    """``fn(conn)`` on a fresh KV-only connection to ``addr`` (see the module rules);
    the whole exchange is bounded by the client's ``connect_timeout``."""
    connect_to = sup.routing.connect_to
    assert connect_to is not None  # cluster mode needs addresses
    with trio.fail_after(sup.connect_timeout):
        stream = await connect_to(addr)
        # its own counters: control requests are not the client's streaming statistics
        conn = DcpConnection(stream, sup.cfg, sup.delivery, sup.commit_fn, {}, defaultdict(int))
        try:
            async with trio.open_nursery() as nursery:
                await conn.run(nursery)
                try:
                    await conn.handshake(dcp=False)
                    return await fn(conn)
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            await conn.aclose()


class NodeLink:
    """The connection to one node and the vbuckets routed to it (module rules)."""

    def __init__(self, runner: ClusterRunner, addr: Address) -> None:
        self.runner = runner
        self.addr = addr
        self.name = format_address(addr)
        self.vbs: set[int] = set()
        self.conn: DcpConnection | None = None
        self.ready = False  #: handshaken and streaming
        self.closing = False
        self._scope = trio.CancelScope()

    def add(self, vb: int) -> None:
        self.vbs.add(vb)
        if self.ready and self.conn is not None:
            self.conn.add_vbucket(vb)

    def remove(self, vb: int) -> None:
        self.vbs.discard(vb)
        if self.ready and self.conn is not None:
            self.conn.drop_vbucket(vb)

    def close(self) -> None:
        self.closing = True
        self._scope.cancel()

    async def ask(self, fn: Callable[[DcpConnection], Awaitable[T]]) -> T:
        """``fn`` on this link's connection when it is up, else on a control connection."""
        conn = self.conn
        if self.ready and conn is not None and conn.error is None:
            with trio.fail_after(self.runner.sup.connect_timeout):
                return await fn(conn)
        return await control_call(self.runner.sup, self.addr, fn)

    def pending_requests(self) -> int:
        """Requests asked on this link's connection and not answered yet."""
        conn = self.conn
        return conn.pending_requests if conn is not None else 0

    def statistics(self) -> dict[str, object]:
        conn = self.conn
        return {
            "vbuckets": len(self.vbs),
            "connected": self.ready and conn is not None and conn.error is None,
            "flow_control": conn.fc.statistics() if conn is not None else None,
        }

    async def run(self) -> None:
        error: BaseException | None = None
        with self._scope:
            try:
                await self._stream()
            except Exception as exc:
                error = exc
        if not self.closing:
            self.runner.link_ended(self, error)

    async def _stream(self) -> None:
        sup = self.runner.sup
        connect_to = sup.routing.connect_to
        assert connect_to is not None
        with trio.fail_after(sup.connect_timeout):
            stream = await connect_to(self.addr)
        sup.stats["connects"] += 1
        conn = DcpConnection(stream, sup.cfg, sup.delivery, sup.commit_fn, sup.retries, sup.stats)
        conn.on_move = self.runner.moved
        self.conn = conn
        sup.register(conn)
        try:
            async with trio.open_nursery() as nursery:
                await conn.run(nursery)
                try:
                    with trio.fail_after(sup.connect_timeout):
                        await conn.handshake()
                    assert sup.session is not None  # the runner resolved the positions
                    conn.start_streams(sup.session, self.vbs)
                    self.ready = True
                    await conn.finished.wait()
                except trio.TooSlowError:
                    conn.fail(TransientError(f"handshake with {self.name} timed out"))
                except Exception as exc:
                    conn.fail(exc)
                nursery.cancel_scope.cancel()
        finally:
            self.ready = False
            sup.unregister(conn)
            if conn.error is not None or self.closing:
                sup.delivery.purge_connection(conn.fc)
            await conn.aclose()
        if conn.error is not None:
            raise conn.error
