"""Where a cluster-aware ``DcpClient`` streams each vbucket from, and when it asks again.

Rules of this module:
- Pure decisions, no I/O and no trio: the cluster runner (``cluster.py``) gives the
  current ``ClusterConfig``, the seqnos it last read and the clock; this module answers.
- Cluster or single node (``is_cluster``): one bootstrap address whose config names one
  server and is not a cluster's map (rev 1, what a lone node answers) is a single node,
  streamed over the connection the client opened, exactly as before clusters existed.
  Anything else routes by the config: the address of a node is its ``serverList`` entry
  (a lone server's config reached through a list is first re-addressed to the node that
  answered, ``ClusterConfig.seen_from``: it may advertise 0.0.0.0).
- A vbucket streams from its active (``pick``); with ``prefer_replica`` from a replica
  that qualifies: its high seqno is within ``max_lag`` of the active's *and* at least the
  client's own resume point (``resume``: the seqno, or snapshot end, the next stream
  request asks from). A replica below the resume point would answer ROLLBACK to its high
  seqno although nothing was lost: the active still has those seqnos. The replica
  already streaming is kept while it qualifies (a refresh never hops between copies);
  otherwise the most current qualifying replica, else the active. Positions are valid on
  every copy (a replica's failover log is its active's), so a move is a new stream
  request with the same resume fields, never a restart.
- Refreshes are rate-limited (``RefreshGate``): one fetch at a time and at most one per
  ``min_interval``, so a node that answers NOT_MY_VBUCKET forever cannot make a busy
  loop; per-vbucket retries back off exponentially (``backoff``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from dcp.protocol.cluster_config import Address, ClusterConfig, ConfigError

__all__ = ["RefreshGate", "assign", "backoff", "is_cluster", "newer_config", "pick"]

log = logging.getLogger(__name__)

#: first and largest delay between two attempts of one vbucket (seconds)
MIN_BACKOFF = 0.05
MAX_BACKOFF = 2.0


def is_cluster(bootstrap: list[Address], config: ClusterConfig | None) -> bool:
    """Whether to route by ``config`` (see the module rules). ``config`` None: the node
    does not know the command (an old or fake server): a single node."""
    if len(bootstrap) > 1:
        return True
    if config is None:
        return False
    return len(config.servers) > 1 or config.rev > 1


def newer_config(current: ClusterConfig | None, data: bytes | str) -> ClusterConfig | None:
    """The config in ``data`` if it parses and is newer than ``current``, else None.

    A malformed config is logged and ignored: the caller keeps the map it had."""
    try:
        cfg = ClusterConfig.from_json(data)
    except ConfigError as exc:
        log.warning(
            "ignoring a malformed cluster config (keeping rev %s): %s",
            None if current is None else current.rev,
            exc,
        )
        return None
    if current is not None and cfg.num_vbuckets != current.num_vbuckets:
        log.warning(
            "ignoring a cluster config of %d vbuckets (the map has %d)",
            cfg.num_vbuckets,
            current.num_vbuckets,
        )
        return None
    return cfg if cfg.newer_than(current) else None


def pick(
    config: ClusterConfig,
    vb: int,
    *,
    current: Address | None = None,
    prefer_replica: bool = False,
    max_lag: int = 1000,
    active_high: Mapping[int, int] | None = None,
    replica_high: Mapping[Address, Mapping[int, int]] | None = None,
    resume: int = 0,
) -> Address | None:
    """The node ``vb`` should stream from (None: the map names no active now: wait).

    ``active_high``: vb -> the active's high seqno; ``replica_high``: node -> vb -> its
    replica's high seqno (GET_ALL_VB_SEQNOS with the replica state). A replica whose
    seqnos are unknown is not used. ``resume``: the highest seqno the next stream request
    of ``vb`` names (its start, or its snapshot end when larger): a replica must have it."""
    active = config.active(vb)
    if active is None:
        return None
    if not prefer_replica or active_high is None or vb not in active_high:
        return active
    replica_high = replica_high or {}
    floor = max(active_high[vb] - max_lag, resume)
    best: Address | None = None
    best_high = -1
    for node in config.replicas(vb):
        high = replica_high.get(node, {}).get(vb)
        if high is None or high < floor:
            continue
        if node == current:
            return node  # still good: stay (no hopping between copies)
        if high > best_high:
            best, best_high = node, high
    return best if best is not None else active


def assign(
    config: ClusterConfig,
    vbuckets: Iterable[int],
    *,
    current: Mapping[int, Address] | None = None,
    prefer_replica: bool = False,
    max_lag: int = 1000,
    active_high: Mapping[int, int] | None = None,
    replica_high: Mapping[Address, Mapping[int, int]] | None = None,
    resume: Mapping[int, int] | None = None,
) -> dict[int, Address | None]:
    """``pick`` for every vbucket of ``vbuckets`` (``resume``: vb -> its resume point)."""
    current = current or {}
    resume = resume or {}
    return {
        vb: pick(
            config,
            vb,
            current=current.get(vb),
            prefer_replica=prefer_replica,
            max_lag=max_lag,
            active_high=active_high,
            replica_high=replica_high,
            resume=resume.get(vb, 0),
        )
        for vb in vbuckets
    }


def backoff(attempts: int) -> float:
    """Seconds before attempt ``attempts + 1`` of one vbucket (50 ms doubling to 2 s)."""
    return min(MIN_BACKOFF * 2 ** max(attempts - 1, 0), MAX_BACKOFF)


class RefreshGate:
    """When the next config fetch may start (see the module rules)."""

    def __init__(self, min_interval: float = 0.1) -> None:
        self.min_interval = min_interval
        self.last_start: float | None = None
        self.in_flight = False
        self.fetches = 0

    def wait_time(self, now: float) -> float:
        """Seconds until a fetch may start (0: now); infinite while one is in flight."""
        if self.in_flight:
            return float("inf")
        if self.last_start is None:
            return 0.0
        return max(0.0, self.last_start + self.min_interval - now)

    def start(self, now: float) -> None:
        assert not self.in_flight, "one config fetch at a time"
        self.in_flight = True
        self.last_start = now
        self.fetches += 1

    def done(self) -> None:
        self.in_flight = False
