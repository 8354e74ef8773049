"""Client settings: every argument of ``DcpClient`` validated once, up front.

Rules of this module:
- Tier-1 errors only: anything wrong raises a ``UsageError`` subclass here, in the
  constructor, before any task or socket exists.
- The result is plain data (``ClientSettings``, ``ConnectionConfig``); no I/O.
- ``host`` is one address or a bootstrap list (``"h1:p1,h2:p2"``, pairs): parsed here by
  ``dcp.protocol.cluster_config.parse_addresses``; ``connect_to(address)`` opens any node
  of a cluster the way ``connector`` opens the first (TLS naming that node's host).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import trio

from dcp.protocol.cluster_config import Address, ConfigError, parse_addresses

from .errors import UsageError
from .offset import Offset, StartFrom
from .offset_store import OffsetStore
from .rollback import RollbackPolicy
from .security import Credentials, Security

__all__ = ["ClientSettings", "ClusterSettings", "ConnectionConfig", "bootstrap", "settings"]

Connector = Callable[[], Awaitable[trio.abc.Stream]]
#: Opens a connection to one node of a cluster.
NodeConnector = Callable[[Address], Awaitable[trio.abc.Stream]]


@dataclass(slots=True)
class ConnectionConfig:
    name: str
    agent: str
    buffer_size: int
    ack_ratio: float
    noop_interval: float | None
    include_delete_times: bool
    include_expirations: bool
    stream_flags: int
    raw: bool
    rollback_policy: RollbackPolicy
    retry_timeout: float
    receive_size: int
    max_queue_bytes: int
    max_body_size: int
    #: authenticate after HELLO as this user (None: do not authenticate)
    credentials: Credentials | None = None
    #: send DCP_CONTROL ``stable_only=true`` at every handshake (refused: an error)
    stable_only: bool = False


@dataclass(slots=True)
class ClusterSettings:
    """How the client follows a cluster (``cluster.py``, ``routing.py``)."""

    #: the bootstrap list (empty with a custom ``connector``: a single node only)
    addresses: list[Address]
    #: opens one node (None with a custom ``connector``)
    connect_to: NodeConnector | None
    #: None: decide from the first config (``routing.is_cluster``); False: never ask
    #: for a config, stream from the one address; True: always route by the config
    mode: bool | None = None
    prefer_replica: bool = False
    max_replica_lag: int = 1000
    config_poll_interval: float = 2.5


@dataclass(slots=True)
class ClientSettings:
    connection: ConnectionConfig
    connector: Connector
    vbuckets: list[int] | None
    start: StartFrom
    offsets: dict[int, Offset]
    cluster: ClusterSettings = dataclasses.field(
        default_factory=lambda: ClusterSettings([], None, False)
    )


def bootstrap(host: Any, port: int, connector: Connector | None) -> list[Address]:
    """The bootstrap list of ``host``/``port`` (empty with a custom ``connector``)."""
    if connector is not None:
        return []
    if type(port) is not int or not 0 < port < 65536:
        raise UsageError(f"port must be an int in 1..65535, not {port!r}")
    if isinstance(host, str) and not host.strip():
        raise UsageError(f"host must be a non-empty string, not {host!r}")
    try:
        return parse_addresses(host, port)
    except (ConfigError, TypeError) as exc:
        raise UsageError(f"host: {exc}") from None


def settings(
    *,
    host: str,
    port: int,
    vbuckets: Iterable[int] | None,
    start: StartFrom | str,
    offsets: Mapping[int, Offset] | None,
    offset_store: OffsetStore | None,
    name: str | None,
    raw: bool,
    rollback_policy: RollbackPolicy | str,
    buffer_size: int,
    ack_ratio: float,
    noop_interval: float | None,
    connect_timeout: float,
    retry_timeout: float,
    include_delete_times: bool,
    include_expirations: bool,
    stream_flags: int,
    receive_size: int,
    max_queue_bytes: int,
    max_body_size: int,
    connector: Connector | None,
    security: Security | None = None,
    cluster: bool | None = None,
    prefer_replica: bool = False,
    max_replica_lag: int = 1000,
    config_poll_interval: float = 2.5,
    stable_only: bool = False,
) -> ClientSettings:
    """Validate ``DcpClient``'s arguments (raises ``UsageError``). ``security``
    (``security.resolve``): TLS wraps whatever ``connector`` opens."""
    addresses = bootstrap(host, port, connector)
    connect_to: NodeConnector | None = None
    if connector is None:
        connect_to = functools.partial(_connect_node, security)
        connector = functools.partial(connect_to, addresses[0])
    elif security is not None and security.tls is not None:
        connector = functools.partial(security.connect, connector)
    if cluster not in (None, True, False):
        raise UsageError(f"cluster must be None, True or False, not {cluster!r}")
    if cluster is False and len(addresses) > 1:
        raise UsageError("cluster=False streams from one address; a list was given")
    if cluster and connect_to is None:
        raise UsageError("cluster=True needs host addresses, not a connector")
    if stable_only not in (True, False):
        raise UsageError(f"stable_only must be True or False, not {stable_only!r}")
    if stable_only and prefer_replica:
        # the stable seqno is known only where the vbucket is active (a replica's is 0)
        raise UsageError("stable_only=True streams from actives only: drop prefer_replica")
    if type(max_replica_lag) is not int or max_replica_lag < 0:
        raise UsageError(f"max_replica_lag must be an int >= 0, not {max_replica_lag!r}")
    if not 0.1 <= config_poll_interval <= 3600:
        raise UsageError(f"config_poll_interval must be 0.1..3600 s, not {config_poll_interval!r}")
    routing = ClusterSettings(
        addresses,
        connect_to,
        False if connect_to is None else cluster,
        bool(prefer_replica),
        max_replica_lag,
        float(config_poll_interval),
    )
    vbs = _check_vbuckets(vbuckets)
    try:
        start_from = StartFrom(start)
    except ValueError:
        raise UsageError(f"start must be a StartFrom, not {start!r}") from None
    explicit = _check_offsets(offsets, vbs)
    try:
        policy = RollbackPolicy(rollback_policy)
    except ValueError:
        raise UsageError(
            f"rollback_policy must be a RollbackPolicy, not {rollback_policy!r}"
        ) from None
    if offset_store is not None and not isinstance(offset_store, OffsetStore):
        raise UsageError(f"offset_store must be an OffsetStore, not {offset_store!r}")
    if type(buffer_size) is not int or not 0 <= buffer_size <= 0xFFFFFFFF:
        raise UsageError(f"buffer_size must be an int in 0..2**32-1, not {buffer_size!r}")
    if not 0 < ack_ratio <= 1:
        raise UsageError(f"ack_ratio must be in (0, 1], not {ack_ratio!r}")
    if noop_interval is not None and not 0.1 <= noop_interval <= 10800:
        raise UsageError(f"noop_interval must be None or 0.1..10800 s, not {noop_interval!r}")
    for what, v in (("connect_timeout", connect_timeout), ("retry_timeout", retry_timeout)):
        if not v > 0:
            raise UsageError(f"{what} must be > 0, not {v!r}")
    if receive_size < 4096 or max_queue_bytes < 1:
        raise UsageError("receive_size must be >= 4096 and max_queue_bytes >= 1")
    if name is None:
        name = f"dcp-consumer:{os.getpid()}:{os.urandom(4).hex()}"
    if not 0 < len(name.encode()) <= 200:
        raise UsageError("name must be 1..200 bytes")
    conn = ConnectionConfig(
        name=name,
        agent="dcp-consumer/0.1",
        buffer_size=buffer_size,
        ack_ratio=ack_ratio,
        noop_interval=noop_interval,
        include_delete_times=include_delete_times,
        include_expirations=include_expirations,
        stream_flags=int(stream_flags),
        raw=raw,
        rollback_policy=policy,
        retry_timeout=retry_timeout,
        receive_size=receive_size,
        max_queue_bytes=max_queue_bytes,
        max_body_size=max_body_size,
        credentials=security.credentials if security is not None else None,
        stable_only=bool(stable_only),
    )
    return ClientSettings(conn, connector, vbs, start_from, explicit, routing)


async def _connect_node(security: Security | None, addr: Address) -> trio.abc.Stream:
    """A connection to ``addr`` (in TLS naming that host when TLS is on)."""
    connector = functools.partial(trio.open_tcp_stream, addr[0], addr[1])
    if security is None or security.tls is None:
        return await connector()
    return await dataclasses.replace(security, server_hostname=addr[0]).connect(connector)


def _check_vbuckets(vbuckets: Iterable[int] | None) -> list[int] | None:
    if vbuckets is None:
        return None
    try:
        vbs = list(vbuckets)
    except TypeError:
        raise UsageError(f"vbuckets must be an iterable of ints, not {vbuckets!r}") from None
    for vb in vbs:
        if type(vb) is not int or not 0 <= vb <= 0xFFFF:
            raise UsageError(f"vbucket ids must be ints in 0..65535, not {vb!r}")
    if len(set(vbs)) != len(vbs):
        raise UsageError("vbuckets contains duplicates")
    if not vbs:
        raise UsageError("vbuckets is empty")
    return sorted(vbs)


def _check_offsets(
    offsets: Mapping[int, Offset] | None, vbuckets: list[int] | None
) -> dict[int, Offset]:
    if offsets is None:
        return {}
    if not isinstance(offsets, Mapping):
        raise UsageError(f"offsets must be a mapping vbucket -> Offset, not {offsets!r}")
    out = {}
    for vb, off in offsets.items():
        if not isinstance(off, Offset):
            raise UsageError(f"offsets[{vb!r}] must be an Offset, not {off!r}")
        if off.vbucket != vb:
            raise UsageError(f"offsets[{vb!r}] is an offset of vbucket {off.vbucket}")
        if vbuckets is not None and vb not in vbuckets:
            raise UsageError(f"offset given for vbucket {vb}, which is not streamed")
        out[vb] = off
    return out
