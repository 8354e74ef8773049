"""The task behind a ``DcpClient``: connect, handshake, resolve start positions, stream,
reconnect.

Rules of this module:
- One ``Supervisor`` per client, one ``run`` task in the client's nursery. It owns the
  current ``DcpConnection`` (``conn``) and, once the first connection has resolved every
  vbucket's start position, the ``positions.Session`` (``session``); the client reads
  both and never replaces them.
- A transient failure (``is_transient``) is retried with exponential backoff (50 ms ..
  5 s); ``RetryTimeoutError`` is raised to the application only after ``retry_timeout``
  seconds without progress (a connection that streamed something resets the clock).
  Anything else, and ``finish`` when every ``to_latest`` stream reached its end, go to
  the application through the delivery queue, after what was queued before them.
- Start positions, per vbucket, in order of preference: an explicit offset, the offset
  store's, then ``StartFrom`` (the high seqno for ``NOW``, 0 for ``BEGINNING``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from dcp.protocol.errors import RemoteProtocolError, StatusError

from .batches import CommitFn
from .config import ConnectionConfig
from .connection import DcpConnection
from .delivery import Delivery
from .errors import RetryTimeoutError, TransientError, UsageError
from .offset import Offset, StartFrom
from .positions import Session

__all__ = ["Supervisor", "is_transient"]

Connector = Callable[[], Awaitable[trio.abc.Stream]]


def is_transient(exc: BaseException) -> bool:
    """Whether reconnecting may help (a lost or refused connection, a retriable status)."""
    if isinstance(exc, StatusError):
        return exc.retriable
    return isinstance(
        exc,
        (
            TransientError,
            OSError,
            trio.TooSlowError,
            trio.BrokenResourceError,
            trio.ClosedResourceError,
            RemoteProtocolError,
        ),
    )


class Supervisor:
    """Connections of one client (see the module rules)."""

    MIN_BACKOFF = 0.05
    MAX_BACKOFF = 5.0

    def __init__(
        self,
        cfg: ConnectionConfig,
        connector: Connector,
        delivery: Delivery,
        stats: dict[str, int],
        commit_fn: CommitFn,
        *,
        vbuckets: list[int] | None,
        start: StartFrom,
        explicit: dict[int, Offset],
        to_latest: bool,
        connect_timeout: float,
        retry_timeout: float,
    ) -> None:
        self.cfg = cfg
        self.connector = connector
        self.delivery = delivery
        self.stats = stats
        self.commit_fn = commit_fn
        self.vbuckets = vbuckets
        self.start = start
        self.explicit = explicit
        self.to_latest = to_latest
        self.connect_timeout = connect_timeout
        self.retry_timeout = retry_timeout
        self.saved: dict[int, Offset] = {}  #: the offset store's positions (set before run)
        self.session: Session | None = None
        self.conn: DcpConnection | None = None
        #: vb -> (first failure time, attempts) of refused stream requests, across connections
        self.retries: dict[int, tuple[float, int]] = {}
        self.started = trio.Event()  #: set once every vbucket has a resolved start position

    async def run(self) -> None:
        try:
            await self._connect_loop()
        except Exception as exc:  # a bug: still tell the application
            self.delivery.fail(exc)

    async def _connect_loop(self) -> None:
        backoff = self.MIN_BACKOFF
        failing_since: float | None = None
        attempts = 0
        while True:
            conn_holder: list[DcpConnection] = []
            try:
                await self._one_connection(conn_holder)
                self.delivery.finish()
                return
            except Exception as exc:
                if not is_transient(exc):
                    self.delivery.fail(exc)
                    return
                if conn_holder and conn_holder[0].made_progress:
                    failing_since = None
                    attempts = 0
                    backoff = self.MIN_BACKOFF
                now = trio.current_time()
                if failing_since is None:
                    failing_since = now
                attempts += 1
                if now - failing_since >= self.retry_timeout:
                    err = RetryTimeoutError(
                        "connect", attempts=attempts, elapsed=now - failing_since, last_error=exc
                    )
                    err.__cause__ = exc
                    self.delivery.fail(err)
                    return
                self.stats["reconnects"] += 1
                await trio.sleep(backoff)
                backoff = min(backoff * 2, self.MAX_BACKOFF)

    async def _one_connection(self, holder: list[DcpConnection]) -> None:
        with trio.fail_after(self.connect_timeout):
            stream = await self.connector()
        self.stats["connects"] += 1
        conn = DcpConnection(
            stream, self.cfg, self.delivery, self.commit_fn, self.retries, self.stats
        )
        holder.append(conn)
        self.conn = conn
        try:
            async with trio.open_nursery() as nursery:
                await conn.run(nursery)
                try:
                    with trio.fail_after(self.connect_timeout):
                        await conn.handshake()
                        if self.session is None:
                            await self._resolve(conn)
                    assert self.session is not None
                    conn.start_streams(self.session)
                    await conn.finished.wait()
                except trio.TooSlowError:
                    conn.fail(TransientError("handshake timed out"))
                except Exception as exc:
                    conn.fail(exc)
                nursery.cancel_scope.cancel()
        finally:
            if self.conn is conn:
                self.conn = None
            if conn.error is not None:
                self.delivery.purge_connection(conn.fc)
            await conn.aclose()
        if conn.error is not None:
            raise conn.error

    async def _resolve(self, conn: DcpConnection) -> None:
        """First connection: fix every vbucket's start position (and end, to_latest)."""
        need_seqnos = self.vbuckets is None or self.start is StartFrom.NOW or self.to_latest
        high: dict[int, int] = {}
        if need_seqnos:
            high = dict(await conn.get_all_vb_seqnos())
        vbs = self.vbuckets if self.vbuckets is not None else sorted(high)
        if not vbs:
            raise UsageError("the server reported no vbuckets to stream")
        offsets: dict[int, Offset] = {}
        for vb in vbs:
            if vb in self.explicit:
                offsets[vb] = self.explicit[vb]
            elif vb in self.saved:
                offsets[vb] = self.saved[vb]
        if self.start is StartFrom.NOW:
            now_vbs = [vb for vb in vbs if vb not in offsets]
            if now_vbs:
                logs = await conn.get_failover_logs(now_vbs)
                for vb in now_vbs:
                    h = high.get(vb, 0)
                    log = logs[vb]
                    offsets[vb] = Offset(vb, log[0][0] if log else 0, h, h, h, log)
        for vb in vbs:
            if vb not in offsets:
                offsets[vb] = Offset.beginning(vb)
        session = Session(offsets)
        if self.to_latest:
            for vb, p in session.positions.items():
                p.end_seqno = high.get(vb, 0)
        self.session = session
        self.started.set()
