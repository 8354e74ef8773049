"""ServerView: the read-only face of a running server that STAT and metrics read.

Rules of this module:
- Protocols only, no code: ``ServerView`` lists exactly what ``stats.py`` and
  ``metrics.py`` read (the bucket, the counters, the settings, the connections'
  statistics and streams, a few derived figures), all read-only. ``DcpServer`` satisfies
  it structurally; a test may pass any object that does. Nothing that reads through it
  can start, stop, flush or reconfigure anything.
- A member is added here only when a reader needs it, so this file is the list of what
  reporting depends on.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .active_stream import ActiveStream
    from .config import ServerConfig
    from .engine import Bucket
    from .metrics import ServerMetrics

__all__ = ["ClusterView", "ConnectionView", "DurabilityView", "ServerView"]


class ConnectionView(Protocol):
    """What reporting reads of one connection."""

    @property
    def id(self) -> int: ...

    @property
    def dcp_name(self) -> str | None: ...

    @property
    def streams(self) -> Mapping[int, ActiveStream]: ...

    def statistics(self) -> dict[str, Any]: ...


class ClusterView(Protocol):
    """What reporting reads of the cluster side (cluster/serving.py)."""

    def stat_pairs(self) -> list[tuple[str, Any]]: ...


class DurabilityView(Protocol):
    """What reporting reads of the durability monitor (durability.py)."""

    def is_active(self, vb: int) -> bool: ...

    def majority_seqno(self, vb: int) -> int: ...

    def majority_persisted_seqno(self, vb: int) -> int: ...

    def stable_seqno(self, vb: int) -> int: ...


class ServerView(Protocol):
    """What reporting reads of the server (see the module rules)."""

    @property
    def bucket(self) -> Bucket: ...

    @property
    def config(self) -> ServerConfig: ...

    @property
    def metrics(self) -> ServerMetrics: ...

    @property
    def connections(self) -> Collection[ConnectionView]: ...

    @property
    def storage_error(self) -> str | None: ...

    @property
    def cluster(self) -> ClusterView: ...

    @property
    def durability(self) -> DurabilityView: ...

    def uptime(self) -> float: ...

    def output_bytes(self) -> int:
        """Output all connections hold (queued answers and buffers being sent)."""
        ...

    def streams(self) -> list[ActiveStream]: ...

    def streams_of(self, vbid: int) -> list[ActiveStream]: ...

    def replication_of(self, vbid: int) -> dict[str, Any]:
        """How replica ``vbid`` is fed: ``source``, ``stream``, ``source_seqno`` ({} when
        it has no source)."""
        ...

    def replication_sources(self) -> dict[str, dict[str, Any]]:
        """Per source node address: its replication connection's counters."""
        ...
