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
- Cluster or single node: with one address, the first connection asks GET_CLUSTER_CONFIG
  after its handshake; a single node's answer (or UNKNOWN_COMMAND from an older server)
  keeps everything above, on that connection. A cluster's answer, or a bootstrap list
  (asked node by node, in order, until one answers: ``NoNodeAnsweredError`` naming every
  address otherwise), hands over to ``cluster.ClusterRunner`` (one connection per node).
  Every live connection is registered (``register``), so a batch's buffer ack goes to the
  connection whose window its bytes occupy.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from dcp.protocol.cluster_config import Address, ClusterConfig, ConfigError, format_address
from dcp.protocol.errors import RemoteProtocolError, StatusError

from .batches import CommitFn
from .cluster import ClusterRunner
from .config import ClusterSettings, ConnectionConfig
from .connection import DcpConnection
from .delivery import Delivery
from .errors import NoNodeAnsweredError, RetryTimeoutError, TransientError, UsageError
from .node_link import control_call
from .offset import FailoverLog, Offset, StartFrom
from .positions import Session
from .routing import is_cluster, newer_config

log = logging.getLogger(__name__)

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
        routing: ClusterSettings | None = None,
    ) -> None:
        self.cfg = cfg
        self.routing = routing or ClusterSettings([], None, False)
        #: live connections by ``id`` of their flow control (``conn_for``)
        self._conns: dict[int, DcpConnection] = {}
        #: the config that showed a cluster (set by the first connection's probe)
        self.cluster_config: ClusterConfig | None = None
        self._probed = self.routing.mode is False
        self.runner: ClusterRunner | None = None
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
            r = self.routing
            config: ClusterConfig | None
            if r.mode or len(r.addresses) > 1:
                config = await self._bootstrap()
            else:
                await self._connect_loop()
                config = self.cluster_config
            if config is None:
                return
            self.runner = ClusterRunner(self, config)
            await self.runner.run()
            self.delivery.finish()
        except Exception as exc:  # ends the client (and a bug still tells the application)
            self.delivery.fail(exc)

    # ------------------------------------------------------------------ shared by modes

    def transient(self, exc: BaseException) -> bool:
        return is_transient(exc)

    def register(self, conn: DcpConnection) -> None:
        self._conns[id(conn.fc)] = conn

    def unregister(self, conn: DcpConnection) -> None:
        if self._conns.get(id(conn.fc)) is conn:
            del self._conns[id(conn.fc)]

    def conn_for(self, fc: object) -> DcpConnection | None:
        """The live connection whose flow control is ``fc`` (None once it is gone)."""
        conn = self._conns.get(id(fc))
        return conn if conn is not None and conn.fc is fc else None

    def connections(self) -> list[DcpConnection]:
        return list(self._conns.values())

    # ------------------------------------------------------------------ bootstrap

    async def _bootstrap(self) -> ClusterConfig:
        """The first config from the bootstrap list (see the module rules), retried with
        backoff until ``retry_timeout``."""
        backoff = self.MIN_BACKOFF
        since = trio.current_time()
        attempts = 0
        while True:
            attempts += 1
            try:
                return await self._first_config()
            except NoNodeAnsweredError as exc:
                now = trio.current_time()
                if now - since >= self.retry_timeout:
                    err = RetryTimeoutError(
                        "connect", attempts=attempts, elapsed=now - since, last_error=exc
                    )
                    raise err from exc
                self.stats["reconnects"] += 1
                await trio.sleep(backoff)
                backoff = min(backoff * 2, self.MAX_BACKOFF)

    async def _first_config(self) -> ClusterConfig:
        addrs = self.routing.addresses
        errors: list[BaseException] = []
        for addr in addrs:
            try:
                return await control_call(self, addr, _config_from(addr))
            except Exception as exc:
                if not is_transient(exc) and not isinstance(exc, ConfigError):
                    raise
                errors.append(exc)
        raise NoNodeAnsweredError([format_address(a) for a in addrs], errors)

    async def _connect_loop(self) -> None:
        backoff = self.MIN_BACKOFF
        failing_since: float | None = None
        attempts = 0
        while True:
            conn_holder: list[DcpConnection] = []
            try:
                await self._one_connection(conn_holder)
                if self.cluster_config is None:
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
        self.register(conn)
        try:
            async with trio.open_nursery() as nursery:
                await conn.run(nursery)
                try:
                    with trio.fail_after(self.connect_timeout):
                        await conn.handshake()
                        if not self._probed and await self._probe(conn):
                            nursery.cancel_scope.cancel()
                            return
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
            self.unregister(conn)
            if self.conn is conn:
                self.conn = None
            if conn.error is not None:
                self.delivery.purge_connection(conn.fc)
            await conn.aclose()
        if conn.error is not None:
            raise conn.error

    async def _probe(self, conn: DcpConnection) -> bool:
        """Ask the first node for its config; True: it is a cluster (``cluster_config``)."""
        data = await conn.get_cluster_config()
        self._probed = True
        config = None if data is None else newer_config(None, data)
        if not is_cluster(self.routing.addresses, config):
            return False
        self.cluster_config = config
        return True

    def needs_seqnos(self) -> bool:
        return self.vbuckets is None or self.start is StartFrom.NOW or self.to_latest

    async def _resolve(self, conn: DcpConnection) -> None:
        """First connection: fix every vbucket's start position (and end, to_latest)."""
        high: dict[int, int] = {}
        if self.needs_seqnos():
            high = dict(await conn.get_all_vb_seqnos())
        vbs = self.vbuckets if self.vbuckets is not None else sorted(high)
        await self.resolve(vbs, high, conn.get_failover_logs)

    async def resolve(
        self,
        vbs: list[int],
        high: dict[int, int],
        get_logs: Callable[[list[int]], Awaitable[dict[int, FailoverLog]]] | None,
        end_logs: dict[int, FailoverLog] | None = None,
    ) -> None:
        """Start positions of ``vbs`` from the high seqnos ``high`` (and the failover
        logs ``get_logs`` fetches, for ``StartFrom.NOW``). ``end_logs``: to_latest in a
        cluster, the failover logs read with ``high`` (``VbPosition.end_log``)."""
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
                assert get_logs is not None  # NOW needs the seqnos, hence the logs
                logs = await get_logs(now_vbs)
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
                if end_logs is not None and vb in end_logs:
                    p.end_log = end_logs[vb]
        self.session = session
        self.started.set()


def _config_from(addr: Address) -> Callable[[DcpConnection], Awaitable[ClusterConfig]]:
    """The request ``_config_of`` for ``addr`` (a named function: typed, unlike a lambda)."""

    async def ask(conn: DcpConnection) -> ClusterConfig:
        return await _config_of(conn, addr)

    return ask


async def _config_of(conn: DcpConnection, addr: Address) -> ClusterConfig:
    """The node's config; a node that does not know the command is a single node serving
    every vbucket it reports (``ConfigError`` for a malformed config: try the next)."""
    data = await conn.get_cluster_config()
    if data is not None:
        config = newer_config(None, data)
        if config is None:
            raise ConfigError(f"{format_address(addr)} sent a malformed cluster config")
        return config.seen_from(addr)
    vbs = [vb for vb, _ in await conn.get_all_vb_seqnos()]
    n = 1
    while n <= max(vbs, default=0):
        n *= 2
    return ClusterConfig.single(addr, n)
