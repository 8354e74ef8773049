"""The connections of ``KvClient``: one ``KvConnection`` per node, the bootstrap, and the
cluster map kept current.

Rules of this module:
- A node's connection is opened when first needed (TCP, TLS naming that node's host,
  HELLO, SASL: the same for every node) and reopened after it failed. Opening it is a
  task of the client, shared by every caller that needs that node, and bounded by the
  client's ``timeout`` only: a caller that gives up waiting leaves it running, so a node
  slow to let a connection in (loaded, or TLS with SCRAM) is never cut off and retried
  from scratch over and over. ``connector`` (the caller's replacement
  for the TCP connect) pins the client to the one server it reaches: no map is asked
  for or followed (a connector cannot reach other nodes), exactly the client of one
  server that ``KvClient`` was before clusters.
- Bootstrap: the config (GET_CLUSTER_CONFIG) comes from the first bootstrap address that
  answers, then the others in order; a round where none answers is retried with backoff
  until ``timeout``, then ``RetryTimeoutError("connect")`` whose ``last_error`` is a
  ``NoNodeAnsweredError`` naming each address and what it said. A node that does not
  know the command (UNKNOWN_COMMAND, or any other refusal but a temporary one) is a
  single server: ``KvRouter.made_up``. A cluster node without a map yet answers ETMPFAIL
  and counts as not answering. Refused credentials and TLS failures are not retried.
- ``refresh`` asks the reachable nodes for the config (open connections first, then the
  map's nodes, then the bootstrap list) until one gives a newer map (a node that has not
  read the new map yet answers the old one), at most one fetch at a time and not more often
  than ``REFRESH_INTERVAL``: callers that come while a fetch runs wait for its outcome,
  callers that come too soon get "no change" and back off. So a stale node that answers
  NOT_MY_VBUCKET forever costs one small request per interval, never a busy loop.
- A node that stops answering says nothing: in cluster mode the map is also polled every
  ``POLL_INTERVAL`` and refreshed at once when an operation timed out on a silent node,
  so later operations follow a failover; and ``watch`` gives up the GET/plain SET
  batches a node has left unanswered for ``PATIENCE`` once the map moved their
  vbuckets, so those are re-sent within their deadline. A single server is never
  polled or watched.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable

import trio

from dcp.protocol import codec
from dcp.protocol.cluster_config import Address, ClusterConfig, ConfigError, format_address
from dcp.protocol.errors import StatusError, for_status
from dcp.protocol.opcodes import HelloFeature, Opcode, Status

from .errors import (
    ClientClosedError,
    ConnectionLostError,
    NoNodeAnsweredError,
    RetryTimeoutError,
    TransientError,
)
from .kv_connection import KvConnection, Op
from .kv_router import KvRouter
from .security import Security, check_plain

__all__ = ["KV_FEATURES", "PATIENCE", "REFRESH_INTERVAL", "KvNodes"]

log = logging.getLogger(__name__)

Connector = Callable[[], Awaitable[trio.abc.Stream]]
KV_FEATURES = [
    HelloFeature.XERROR,
    HelloFeature.JSON,
    HelloFeature.MUTATION_SEQNO,
    HelloFeature.ALT_REQUEST_SUPPORT,
    HelloFeature.SYNC_REPLICATION,
]
#: The shortest time between two config fetches (module rules).
REFRESH_INTERVAL = 0.1
#: How long a node may keep a batch unanswered (or a connection unopened) before the
#: client checks whether the map still puts those vbuckets there (``watch``).
PATIENCE = 1.0
#: How often a client in cluster mode asks for the map without a reason (``poll``).
POLL_INTERVAL = 2.5
#: The longest one node may take to answer a refresh before the next one is asked.
ASK_TIMEOUT = 1.0
#: Statuses that mean "ask again later", not "this server has no config to give".
_LATER = frozenset((Status.ETMPFAIL, Status.EBUSY, Status.ENOMEM))
#: What ``watch`` may give up on a silent node and re-send elsewhere (a plain SET is the
#: same key and value again; HELLO and config requests belong to their connection).
_REROUTABLE = frozenset((Opcode.GET, Opcode.SET))


@dataclasses.dataclass(eq=False)
class _Attempt:
    """One opening of a node's connection, shared by every caller that needs it."""

    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    conn: KvConnection | None = None
    error: Exception | None = None


class KvNodes:
    """The client's node connections and its router (see the module rules)."""

    def __init__(
        self,
        router: KvRouter,
        *,
        timeout: float,
        connector: Connector | None,
        security: Security,
        agent: str,
    ) -> None:
        self.router = router
        self.timeout = timeout
        self._connector = connector
        self._security = security
        self._agent = agent
        self._conns: dict[Address, KvConnection] = {}
        self._opening: dict[Address, _Attempt] = {}
        self.nursery: trio.Nursery | None = None  # set by the client while it runs
        self.closed = False
        self._fetching: trio.Event | None = None
        self._last_fetch = -1e9

    # ------------------------------------------------------------------ connections

    def ready(self, addr: Address) -> KvConnection | None:
        """``addr``'s connection if it is open (no waiting: the hot path)."""
        conn = self._conns.get(addr)
        return conn if conn is not None and conn.error is None else None

    async def connection(self, addr: Address) -> KvConnection:
        """The open connection to ``addr``, opening it (one attempt for concurrent
        callers). The attempt runs as a task of the client, not of the caller: a caller
        that stops waiting (its deadline, or ``kv_execute`` looking at the map) leaves it
        running, so a node slow to let a connection in is still reached (module rules)."""
        conn = self._conns.get(addr)
        if conn is not None and conn.error is None:
            return conn
        if self.closed or self.nursery is None:
            raise ClientClosedError("use the client inside `async with`, before it is closed")
        attempt = self._opening.get(addr)
        if attempt is None:
            attempt = self._opening[addr] = _Attempt()
            self.nursery.start_soon(self._attempt, addr, attempt)
        await attempt.done.wait()
        if attempt.conn is None:
            raise attempt.error or ConnectionLostError(f"connecting to {format_address(addr)}")
        return attempt.conn

    async def _attempt(self, addr: Address, attempt: _Attempt) -> None:
        """Open ``addr``'s connection for every caller waiting on ``attempt``; bounded by
        the client's ``timeout`` (no operation could wait longer for it)."""
        try:
            with trio.fail_after(self.timeout):
                conn = await self._open(addr)
            self._conns[addr] = attempt.conn = conn
        except Exception as exc:  # the waiters raise it, the client's nursery must not
            attempt.error = exc
        finally:
            if self._opening.get(addr) is attempt:
                del self._opening[addr]
            attempt.done.set()

    async def _open(self, addr: Address) -> KvConnection:
        host, port = addr
        connect: Connector
        if self._connector is not None:
            connect = self._connector
        else:
            connect = functools.partial(trio.open_tcp_stream, host, port)
        security = self._security
        if security.tls is not None:
            node = dataclasses.replace(security, server_hostname=host)
            connect = functools.partial(node.connect, connect)
        check_plain(host, security.credentials, security.tls)
        stream = await connect()
        conn = KvConnection(stream)
        assert self.nursery is not None
        self.nursery.start_soon(conn.read_loop)
        try:
            await self._handshake(conn)
        except BaseException as exc:
            # a refused (re)login or a lost handshake: this connection and its reader
            # end here, or every failed attempt would leave both behind
            conn.fail(exc if isinstance(exc, Exception) else ConnectionLostError("cancelled"))
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(conn.stream)
            raise
        return conn

    async def _handshake(self, conn: KvConnection) -> None:
        """HELLO, then SASL when the client has credentials."""
        hello = codec.hello(self._agent, [int(x) for x in KV_FEATURES])
        (f,) = await conn.roundtrip([Op(Opcode.HELLO, b"", 0, hello, True)])
        if f is None:
            raise conn.error or ConnectionLostError("HELLO got no answer")
        if isinstance(f, tuple):  # success with an empty value: no features
            conn.features = set()
        elif f.status == Status.SUCCESS:
            conn.features = set(codec.parse_hello_features(bytes(f.value)))
        if self._security.credentials is not None:
            await conn.authenticate(self._security.credentials)

    def close(self, why: BaseException) -> None:
        self.closed = True
        for conn in self._conns.values():
            conn.fail(why)

    # ------------------------------------------------------------------ configs

    async def ask_config(self, addr: Address) -> ClusterConfig:
        """``addr``'s config (module rules); raises the error of a node that could not
        answer (a lost connection, or ``TemporaryFailure`` while it has no map)."""
        conn = await self.connection(addr)
        req = codec.request(Opcode.GET_CLUSTER_CONFIG)
        (f,) = await conn.roundtrip([Op(Opcode.GET_CLUSTER_CONFIG, b"", 0, req, True)])
        if f is None:
            raise conn.error or ConnectionLostError("no answer to GET_CLUSTER_CONFIG")
        if isinstance(f, tuple) or (f.status == Status.SUCCESS and not f.value):
            return self.router.made_up(addr)
        if f.status in _LATER:
            raise for_status(f.status, bytes(f.value), f"GET_CLUSTER_CONFIG on {addr[0]}")
        if f.status != Status.SUCCESS:  # UNKNOWN_COMMAND: a server without cluster maps
            return self.router.made_up(addr)
        try:
            return ClusterConfig.from_json(bytes(f.value)).seen_from(addr)
        except ConfigError as exc:
            log.warning(
                "ignoring a malformed cluster config from %s: %s", format_address(addr), exc
            )
            return self.router.made_up(addr)

    async def bootstrap(self) -> None:
        """Fetch the first config and adopt it (module rules)."""
        addrs = self.router.bootstrap
        names = [format_address(a) for a in addrs]
        start = trio.current_time()
        attempts = 0
        backoff = 0.05
        while True:
            attempts += 1
            errors: list[BaseException] = []
            for addr in addrs:
                left = start + self.timeout - trio.current_time()
                # one silent node must not use up the time of the others
                each = left if len(addrs) == 1 else min(left, max(1.0, self.timeout / len(addrs)))
                try:
                    with trio.fail_after(max(each, 0.001)):
                        if self._connector is not None:  # pinned: a connector reaches one node
                            await self.connection(addr)
                            config = self.router.made_up(addr)
                        else:
                            config = await self.ask_config(addr)
                except (OSError, trio.TooSlowError, ConnectionLostError) as exc:
                    errors.append(exc)
                    continue
                except StatusError as exc:
                    if exc.status not in _LATER:
                        raise  # refused credentials: retrying cannot help
                    errors.append(exc)
                    continue
                self.router.check_first(config)
                self.router.adopt(config)
                return
            err = NoNodeAnsweredError(names, errors)
            elapsed = trio.current_time() - start
            if elapsed + backoff >= self.timeout:
                raise RetryTimeoutError(
                    "connect", attempts=attempts, elapsed=elapsed, last_error=err
                ) from err
            await trio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    def _candidates(self) -> list[Address]:
        # open connections first, the idlest first: a frozen node sits on unanswered
        # requests and would only answer after ASK_TIMEOUT, if at all
        conns = sorted(
            ((len(c.waiting), a) for a, c in self._conns.items() if c.error is None),
            key=lambda x: x[0],
        )
        healthy = [a for _, a in conns]
        return healthy + [a for a in self.router.addresses() if a not in healthy]

    async def poll(self) -> None:
        """In cluster mode, refresh the map every ``POLL_INTERVAL``: a node that stopped
        answering sends no NOT_MY_VBUCKET, yet the cluster fails it over and its
        vbuckets must be found elsewhere. A single server is never polled."""
        while not self.closed:
            await trio.sleep(POLL_INTERVAL)
            if self.router.single is None and self._connector is None:
                try:
                    await self.refresh(trio.current_time() + self.timeout)
                except ClientClosedError:
                    return

    async def watch(self) -> None:
        """In cluster mode, every ``PATIENCE`` / 2: a batch left unanswered for
        ``PATIENCE`` (a frozen node sends no NOT_MY_VBUCKET) makes the client refresh the
        map, and the batches of GET/plain SET whose vbuckets moved are given up
        (``KvConnection.forget``) so that ``kv_execute`` re-sends them by the new map
        within their deadline. A batch with an ADD or a CAS write is waited for: it may
        have been applied. One task per client; the hot path pays nothing for it."""
        while not self.closed:
            await trio.sleep(PATIENCE / 2)
            if self.router.single is not None:
                continue
            now = trio.current_time()
            for addr, conn in list(self._conns.items()):
                late = {
                    id(b): b for b, _ in list(conn.waiting.values()) if now - b.sent_at >= PATIENCE
                }
                for batch in late.values():
                    if (
                        not batch.event.is_set()
                        and all(op.safe_to_repeat and op.opcode in _REROUTABLE for op in batch.ops)
                        and await self.moved_away(addr, batch.ops, now + self.timeout)
                    ):
                        conn.forget(batch, self.silent(addr))

    async def moved_away(self, addr: Address, ops: list[Op], deadline: float) -> bool:
        """True when ``addr`` may be left: the refreshed map no longer puts every one of
        ``ops`` on it. The caller has checked that the requests may be re-sent."""
        try:
            await self.refresh(deadline)
        except ClientClosedError:
            return False
        node_of = self.router.node_of
        return any(node_of(op.vbucket) != addr for op in ops)

    def silent(self, addr: Address) -> TransientError:
        return TransientError(
            f"{format_address(addr)} did not answer for {PATIENCE:g} s and the map moved "
            "the vbucket elsewhere"
        )

    def refresh_soon(self) -> None:
        """Start a refresh without waiting for it (an operation timed out on a node that
        did not answer: the map may have moved its vbuckets)."""
        if self.nursery is not None and not self.closed and self.router.single is None:
            self.nursery.start_soon(self._refresh_quietly)

    async def _refresh_quietly(self) -> None:
        try:
            await self.refresh(trio.current_time() + self.timeout)
        except ClientClosedError:
            pass

    async def refresh(self, deadline: float) -> bool:
        """Fetch the config from any reachable node (rate-limited, module rules); True
        when a newer one was adopted."""
        if self._connector is not None or deadline <= trio.current_time():
            return False  # pinned (module rules), or no time left to ask
        fetching = self._fetching
        if fetching is not None:
            rev = self.router.config.rev if self.router.config else -1
            with trio.move_on_at(deadline):
                await fetching.wait()
            return (self.router.config.rev if self.router.config else -1) != rev
        if trio.current_time() - self._last_fetch < REFRESH_INTERVAL:
            return False
        self._fetching = fetching = trio.Event()
        try:
            for addr in self._candidates():
                left = deadline - trio.current_time()
                if left <= 0:
                    break
                try:
                    with trio.fail_after(min(left, ASK_TIMEOUT)):
                        config = await self.ask_config(addr)
                except ClientClosedError:
                    raise
                except (Exception, trio.TooSlowError):
                    continue  # that node cannot tell: ask the next one
                if self.router.adopt(config):
                    return True
                # not newer: that node may be the stale one; the next may know better
            return False
        finally:
            self._last_fetch = trio.current_time()
            self._fetching = None
            fetching.set()
