"""Where a query's vbuckets live: the bootstrap list, the cluster config, and the
planner's connections to the nodes that hold them active.

Rules of this module:
- **Single server**: a config naming one server, or (one bootstrap address) a server
  that does not know GET_CLUSTER_CONFIG. Everything goes to the bootstrap address that
  answered (never to the config's ``serverList`` text, which may be ``0.0.0.0``),
  exactly as before clusters: one kept connection, GET_ALL_VB_SEQNOS without a state, no
  config refresh.
- **Cluster** (a config naming more than one server): routed by
  ``dcp.protocol.cluster_config.ClusterConfig``. A vbucket is planned and read on the
  node that holds its active copy; a node's address is its ``serverList`` entry.
- The config comes from the first address of the bootstrap list that answers, then the
  others in order (then the servers of the current config); none answering is one
  ``NoNodeAnswered`` naming every address tried and what each said. A config replaces
  the current one only when newer (``newer_than``); a malformed one is ignored with a
  logged warning, the old map kept.
- ``Topology.refresh`` is rate-limited (one fetch per ``MIN_REFRESH`` seconds; a config
  carried by a NOT_MY_VBUCKET answer is used at once when newer) and never raises for a
  node that does not answer, so a stale node that answers NOT_MY_VBUCKET forever costs
  a fetch per interval, not a busy loop. The callers own the retries and the deadline
  (option retryTimeout).
- Blocking sockets only (``wire.WireClient``), like the rest of the connector; only
  ``dcp.protocol`` and the connector's own modules are imported.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable, Iterable, Sequence

from dcp.protocol import Status, StatusError
from dcp.protocol.cluster_config import Address, ClusterConfig, ConfigError, format_address
from dcp.protocol.errors import AccessDenied, AuthenticationError

from .errors import RangeUnavailableError
from .options import SourceConfig
from .wire import ConnectionLost, WireClient

__all__ = [
    "CONFIG_TIMEOUT",
    "MIN_REFRESH",
    "MapChanged",
    "NoNodeAnswered",
    "NodeView",
    "Topology",
    "fetch_config",
]

log = logging.getLogger("dcp.spark")

#: At most one config fetch per this many seconds (a NOT_MY_VBUCKET config is free).
MIN_REFRESH = 0.1
#: Socket timeout of a config fetch on a connection of its own (a frozen node must not
#: hold a refresh for the query's whole ``timeout``).
CONFIG_TIMEOUT = 5.0
_ACTIVE = 1  # vbucket state "active" (GET_ALL_VB_SEQNOS extras)

Pool = dict[Address, WireClient]


class NoNodeAnswered(ConnectionLost):
    """No address of the bootstrap list gave a config (retriable while the deadline
    lasts). ``refused``: every one refused the connection (nothing listens there)."""

    def __init__(self, addresses: Sequence[Address], errors: Sequence[BaseException]) -> None:
        self.addresses = list(addresses)
        self.errors = list(errors)
        self.refused = bool(errors) and all(_refused(e) for e in errors)
        tried = "; ".join(
            f"{format_address(a)}: {e}" for a, e in zip(self.addresses, self.errors, strict=True)
        )
        super().__init__(f"no node of {len(self.addresses)} answered with a config ({tried})")


class MapChanged(ConnectionLost):
    """What a node said does not match the map (a vbucket it should hold active, it does
    not; a vbucket without an active): retried after a config refresh."""


class NodeLost(ConnectionLost):
    """The connection to one node of a cluster failed (``address``)."""

    def __init__(self, address: Address, exc: BaseException) -> None:
        self.address = address
        super().__init__(f"{format_address(address)}: {exc}")


def _refused(exc: BaseException) -> bool:
    cause = exc.__cause__
    return isinstance(cause, OSError) and cause.errno == errno.ECONNREFUSED


def _parse(raw: bytes, where: Address) -> ClusterConfig | None:
    if not raw.strip():  # a stand-in server that answers every request with SUCCESS
        log.debug("%s answered GET_CLUSTER_CONFIG without a config", format_address(where))
        return None
    try:
        return ClusterConfig.from_json(raw)
    except ConfigError as exc:
        log.warning("ignoring the cluster config from %s: %s", format_address(where), exc)
        return None


def fetch_config(
    cfg: SourceConfig,
    addresses: Sequence[Address],
    pool: Pool | None = None,
    *,
    malformed_ok: bool = False,
    accept: Callable[[ClusterConfig], bool] = lambda _c: True,
) -> tuple[Address, ClusterConfig | None]:
    """Ask ``addresses`` in order for the bucket config; the first acceptable answer wins.

    Returns the address that answered and its config; None for a server that does not
    know GET_CLUSTER_CONFIG (or, with ``malformed_ok``, sent something that is not a
    config: a single server of another kind). ``pool`` keeps the connections (the
    planner's); without it each is closed after use. ``accept`` may pass over a config
    (an older one than the caller has) to ask the next address.

    Raises ``NoNodeAnswered`` naming each address and what went wrong there; a single
    address's own ``ConnectionLost`` as it is (its message and cause say it all).
    Authentication and TLS failures are raised at once (never retried).
    """
    errors: list[BaseException] = []
    tried: list[Address] = []
    for addr in addresses:
        tried.append(addr)
        client = pool.get(addr) if pool is not None else None
        try:
            if client is None or client.closed:
                client = WireClient.for_config(cfg, address=addr)
                if pool is None:
                    client.timeout = min(client.timeout, CONFIG_TIMEOUT)
                client.connect()
                if pool is not None:
                    pool[addr] = client
            raw = client.cluster_config()
        except ConnectionLost as exc:
            errors.append(exc)
            if pool is not None:
                pool.pop(addr, None)
            continue
        except (AuthenticationError, AccessDenied):
            raise  # the same credentials fail on every node
        except StatusError as exc:  # ETMPFAIL: a cluster node without a map yet
            errors.append(exc)
            continue
        finally:
            if pool is None and client is not None:
                client.close()
        if raw is None:
            return addr, None
        config = _parse(raw, addr)
        if config is None:
            if malformed_ok:
                return addr, None
            errors.append(ConfigError("malformed config (see the warning)"))
            continue
        if accept(config):
            return addr, config
        errors.append(ConfigError(f"config rev {config.rev} is not newer than ours"))
    if len(tried) == 1 and isinstance(errors[0], ConnectionLost):
        raise errors[0]
    raise NoNodeAnswered(tried, errors)


class Topology:
    """The current view of where vbuckets live (see the module rules)."""

    def __init__(self, cfg: SourceConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.config: ClusterConfig | None = None
        self.cluster = False  # route by ``config`` (else: everything to ``address``)
        #: a single server's address: the bootstrap address that answered
        self.address: Address = cfg.addresses[0]
        self.loaded = False
        self.fetches = 0  #: config fetches made (rate limit; tests)
        self._clock = clock
        self._fetched_at = -1e18

    def describe(self) -> str:
        if not self.cluster and (self.loaded or len(self.cfg.addresses) == 1):
            return f"the DCP server at {format_address(self.address)}"
        listed = ", ".join(map(format_address, self.cfg.addresses))
        return f"the DCP cluster (bootstrap list {listed})"

    def load(self, pool: Pool | None = None) -> None:
        """The first config: decides single server or cluster. Raises ``ConnectionLost``
        (``NoNodeAnswered``) when nothing answers."""
        addrs = self.cfg.addresses
        self._fetched_at = self._clock()
        self.fetches += 1
        addr, config = fetch_config(self.cfg, addrs, pool, malformed_ok=len(addrs) == 1)
        if config is None and len(addrs) > 1:
            raise RangeUnavailableError(
                f"option host lists {len(addrs)} addresses, but {format_address(addr)} is "
                f"not a cluster node (it does not answer GET_CLUSTER_CONFIG): give one "
                f"address to read a single server"
            )
        # A lone server (one server, rev 1: no cluster) is read at the address that
        # answered, never at its serverList text (it may advertise 0.0.0.0); a cluster's
        # map, even of one node, is followed: nodes may join it during the query.
        self.config = config.seen_from(addr) if config is not None else None
        self.cluster = config is not None and not config.is_lone()
        self.address = addr
        self.loaded = True

    def offer(self, body: bytes | None) -> bool:
        """A config carried by a NOT_MY_VBUCKET answer: taken when it parses and is
        newer. (A single server's answer carries an error text: ignored quietly.)"""
        if not body or not self.cluster or not body.lstrip().startswith(b"{"):
            return False
        try:
            new = ClusterConfig.from_json(body)
        except ConfigError as exc:
            log.warning("ignoring the config in a NOT_MY_VBUCKET answer: %s", exc)
            return False
        if new.newer_than(self.config):
            self.config = new
            return True
        return False

    def refresh(self, body: bytes | None = None, pool: Pool | None = None) -> bool:
        """After trouble on a cluster: ``body``'s config when newer, else (at most once per
        ``MIN_REFRESH``) a fetch from the bootstrap list and the known servers. Never
        raises for nodes that do not answer (the map stays). True if the map changed."""
        if self.offer(body):
            return True
        now = self._clock()
        if now - self._fetched_at < MIN_REFRESH:
            return False
        if not self.loaded:
            try:
                self.load(pool)
            except ConnectionLost as exc:
                log.info("cluster config refresh: %s", exc)
                return False
            return True
        if not self.cluster:
            return False
        self._fetched_at = now
        self.fetches += 1
        known = self.config.servers if self.config is not None else ()
        addrs = list(dict.fromkeys([*self.cfg.addresses, *known]))
        try:
            _, new = fetch_config(self.cfg, addrs, pool, accept=self._newer)
        except ConnectionLost as exc:
            log.info("cluster config refresh: %s", exc)
            return False
        if new is not None and new.newer_than(self.config):
            log.info("cluster map rev %d (was %s)", new.rev, self.config and self.config.rev)
            self.config = new
            return True
        return False

    def _newer(self, config: ClusterConfig) -> bool:
        return config.newer_than(self.config)

    def owner(self, vb: int) -> Address | None:
        """The node holding ``vb`` active by the map (None: single server, or no active)."""
        c = self.config
        if not self.cluster or c is None or vb >= c.num_vbuckets:
            return None
        return c.active(vb)


class NodeView:
    """The planner's connections (one per node, kept between refreshes) and the high
    seqnos and failover logs it plans with, each from the node holding the vbucket."""

    def __init__(self, cfg: SourceConfig, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.topology = Topology(cfg, clock=clock)
        self.clients: Pool = {}
        self._seen: dict[Address, tuple[int, int]] = {}  # address -> (id(client), generation)
        self.connected_once = False

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        self.clients.clear()

    def _client(self, addr: Address) -> tuple[WireClient, int]:
        """The kept connection to ``addr`` (opened when needed) and its generation, which
        changes with every new connection (failover logs and boundaries are fetched
        again after a reconnect: a restart is when they change)."""
        c = self.clients.get(addr)
        if c is None or c.closed:
            c = WireClient.for_config(self.cfg, address=addr).connect()
            self.clients[addr] = c
        self.connected_once = True
        ident, gen = self._seen.get(addr, (0, 0))
        if ident != id(c):
            gen += 1
            self._seen[addr] = (id(c), gen)
        return c, gen

    def client(self, addr: Address) -> WireClient:
        """The kept connection to ``addr`` (for requests of other modules: stable.py)."""
        return self._client(addr)[0]

    def describe(self) -> str:
        return self.topology.describe()

    def high_seqnos(
        self, wanted: Iterable[int] | None
    ) -> tuple[dict[int, int], dict[int, tuple[Address, int]]]:
        """High seqno per vbucket (of ``wanted``, default every one), and per vbucket the
        node it came from with that connection's generation."""
        topo = self.topology
        if not topo.loaded:
            topo.load(self.clients)
            self.connected_once = True  # a node answered: later refusals are outages
        if not topo.cluster:
            addr = topo.address
            client, gen = self._client(addr)
            every = client.get_all_vb_seqnos()
            return every, dict.fromkeys(every, (addr, gen))
        config = topo.config
        assert config is not None
        vbs = range(config.num_vbuckets) if wanted is None else sorted(wanted)
        vbs = [vb for vb in vbs if vb < config.num_vbuckets]
        missing = config.without_active(vbs)
        if missing:
            raise MapChanged(
                f"vbuckets {missing[:16]} have no active node in the cluster map (rev "
                f"{config.rev}); waiting for a failover"
            )
        highs: dict[int, int] = {}
        owners: dict[int, tuple[Address, int]] = {}
        for node, node_vbs in config.actives_by_node(vbs).items():
            try:
                client, gen = self._client(node)
                got = client.get_all_vb_seqnos(_ACTIVE)
            except ConnectionLost as exc:
                self.clients.pop(node, None)
                raise NodeLost(node, exc) from exc
            wrong = [vb for vb in node_vbs if vb not in got]
            if wrong:
                raise MapChanged(
                    f"{format_address(node)} does not hold vbuckets {wrong[:16]} active, "
                    f"as the cluster map (rev {config.rev}) says"
                )
            for vb in node_vbs:
                highs[vb] = got[vb]
                owners[vb] = (node, gen)
        return highs, owners

    def failover_logs(
        self, vbuckets: Sequence[int], owners: dict[int, tuple[Address, int]]
    ) -> dict[int, list[tuple[int, int]]]:
        """The failover log of each of ``vbuckets``, from the node its high seqno came from
        (one pipelined call per node)."""
        by_node: dict[Address, list[int]] = {}
        for vb in vbuckets:
            by_node.setdefault(owners[vb][0], []).append(vb)
        out: dict[int, list[tuple[int, int]]] = {}
        for node, vbs in by_node.items():
            try:
                client, _ = self._client(node)
                out.update(client.failover_logs(vbs))
            except ConnectionLost as exc:
                self.clients.pop(node, None)
                raise NodeLost(node, exc) from exc
            except StatusError as exc:
                if not self.topology.cluster or exc.status != Status.NOT_MY_VBUCKET:
                    raise
                self.topology.offer(exc.value)
                raise MapChanged(f"{format_address(node)}: {exc}") from exc
        return out

    def trouble(self, exc: ConnectionLost) -> None:
        """After a failed refresh: a single server's connection is dropped (reopened on
        the next try, like before clusters); on a cluster, the failed node's, and the map
        is refreshed (rate-limited) so the next try asks the vbuckets' new owners."""
        topo = self.topology
        if not topo.cluster:
            self.close()
            return
        if isinstance(exc, NodeLost):
            c = self.clients.pop(exc.address, None)
            if c is not None:
                c.close()
        if topo.refresh(pool=self.clients) and topo.config is not None:
            keep = {*topo.config.servers, *self.cfg.addresses}
            for addr in [a for a in self.clients if a not in keep]:
                self.clients.pop(addr).close()

    def owners(self, vbuckets: Iterable[int]) -> dict[int, Address] | None:
        """Where each vbucket is read (None: a single server, read at the bootstrap
        address)."""
        topo = self.topology
        if not topo.cluster or topo.config is None:
            if topo.address == (self.cfg.host, self.cfg.port):
                return None
            return dict.fromkeys(vbuckets, topo.address)  # a later address of the list
        c = topo.config
        fallback = c.servers[0]
        return {vb: (topo.owner(vb) or fallback) for vb in vbuckets}
