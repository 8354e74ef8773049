"""Client settings: every argument of ``DcpClient`` validated once, up front.

Rules of this module:
- Tier-1 errors only: anything wrong raises a ``UsageError`` subclass here, in the
  constructor, before any task or socket exists.
- The result is plain data (``ClientSettings``, ``ConnectionConfig``); no I/O.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass

import trio

from .errors import UsageError
from .offset import Offset, StartFrom
from .offset_store import OffsetStore
from .rollback import RollbackPolicy
from .security import Credentials, Security

__all__ = ["ClientSettings", "ConnectionConfig", "settings"]

Connector = Callable[[], Awaitable[trio.abc.Stream]]


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


@dataclass(slots=True)
class ClientSettings:
    connection: ConnectionConfig
    connector: Connector
    vbuckets: list[int] | None
    start: StartFrom
    offsets: dict[int, Offset]


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
) -> ClientSettings:
    """Validate ``DcpClient``'s arguments (raises ``UsageError``). ``security``
    (``security.resolve``): TLS wraps whatever ``connector`` opens."""
    if connector is None:
        if not isinstance(host, str) or not host:
            raise UsageError(f"host must be a non-empty string, not {host!r}")
        if type(port) is not int or not 0 < port < 65536:
            raise UsageError(f"port must be an int in 1..65535, not {port!r}")
        connector = functools.partial(trio.open_tcp_stream, host, port)
    if security is not None and security.tls is not None:
        connector = functools.partial(security.connect, connector)
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
    )
    return ClientSettings(conn, connector, vbs, start_from, explicit)


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
