"""ClusterView: what the orchestrator reads of etcd, as one consistent value; StatusBoard:
what it reports back (the ``status`` key that dcpctl reads).

Rules of this module:
- Pure: a view is parsed from one ``Snapshot`` of the cluster prefix (one etcd range
  read, so the map, the roster and the live nodes are of the same moment), and the
  board only builds the ``status`` document; writing it is the orchestrator's business.
- A malformed map is a ``ValueError`` (the orchestrator acts on nothing then, and says
  so). A malformed ``autofailover`` record reads as the count having reached its
  maximum: refusing a failover is the safe side of not knowing how many happened. A
  malformed member record is skipped (that node cannot be addressed), logged by the
  caller through ``problems``.
- ``down`` lists the map's servers whose ``nodes/<name>`` key is absent: members the map
  still counts on. A failed-over node is no longer a map server, so it is not "down".
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .membership import NodeRecord, cluster_prefix
from .store import Entry, Snapshot
from .vbmap import VBucketMap

__all__ = ["ClusterView", "StatusBoard"]


@dataclass(frozen=True)
class ClusterView:
    cluster: str
    vbmap: VBucketMap | None
    map_revision: int
    #: members (the roster): name -> advertised address
    members: dict[str, str]
    #: names whose ``nodes/<name>`` key exists (alive: their lease holds)
    live: frozenset[str]
    #: the ``autofailover`` record: (count, failed_over names, its mod revision)
    auto_count: int
    auto_failed_over: tuple[str, ...]
    auto_revision: int
    #: pending requests by kind ("rebalance", "failover")
    requests: dict[str, Entry] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    #: members' lease TTLs (s), from their records
    lease_ttls: dict[str, int] = field(default_factory=dict)

    @classmethod
    def parse(
        cls,
        cluster: str,
        snap: Snapshot,
        *,
        max_count: int,
        map_of: Callable[[Entry], VBucketMap] | None = None,
    ) -> ClusterView:
        """``map_of`` decodes the map entry (a caller's cache: the orchestrator's)."""
        p = cluster_prefix(cluster)
        got = snap.entries.get(p + "map")
        if got is None:
            vbmap = None
        else:
            vbmap = map_of(got) if map_of is not None else VBucketMap.from_json(got.value)
        members: dict[str, str] = {}
        ttls: dict[str, int] = {}
        live: set[str] = set()
        requests: dict[str, Entry] = {}
        problems: list[str] = []
        for key, entry in snap.entries.items():
            rest = key[len(p) :]
            kind, _, name = rest.partition("/")
            if kind == "members" and name:
                try:
                    record = NodeRecord.from_json(entry.value)
                    members[name], ttls[name] = record.address, max(0, record.lease_ttl)
                except (ValueError, TypeError, KeyError) as exc:
                    problems.append(f"{key} is malformed ({exc!r})")
            elif kind == "nodes" and name:
                live.add(name)
            elif kind == "requests" and name in ("rebalance", "failover"):
                requests[name] = entry
        count, auto_rev = 0, 0
        failed: tuple[str, ...] = ()
        auto = snap.entries.get(p + "autofailover")
        if auto is not None:
            auto_rev = auto.mod_revision
            try:
                doc = json.loads(auto.value) if auto.value else {}
                count = int(doc.get("count", 0))
                failed = tuple(str(n) for n in doc.get("failed_over", []))
            except (ValueError, TypeError, AttributeError) as exc:
                problems.append(f"{p}autofailover is malformed ({exc!r}): counted as the max")
                count = max_count
        return cls(
            cluster,
            vbmap,
            got.mod_revision if got is not None else 0,
            members,
            frozenset(live),
            count,
            failed,
            auto_rev,
            requests,
            tuple(problems),
            ttls,
        )

    @property
    def live_members(self) -> set[str]:
        """Members whose lease holds (a node key without a roster entry is not one yet:
        it has not finished joining)."""
        return {n for n in self.live if n in self.members}

    def down(self) -> list[str]:
        if self.vbmap is None:
            return []
        return sorted(n for n in self.vbmap.servers if n not in self.live)

    def address(self, name: str | None) -> str | None:
        return self.members.get(name) if name is not None else None

    def lease_ttl(self, name: str) -> int:
        """The member's lease TTL (the default 5 s when its record is unknown)."""
        return self.lease_ttls.get(name, 5)


def _idle(kind: str) -> dict[str, Any]:
    if kind == "rebalance":
        return {
            "id": None,
            "state": "idle",
            "total": 0,
            "done": 0,
            "message": "",
            "started": None,
            "finished": None,
        }
    return {"id": None, "node": None, "state": "idle", "message": "", "auto": False}


class StatusBoard:
    """The ``status`` document (its keys are fixed: dcpctl and tests read them)."""

    def __init__(self, orchestrator: str, term: int, max_count: int) -> None:
        self.orchestrator = orchestrator
        self.term = term
        self.max_count = max_count
        self.rebalance = _idle("rebalance")
        self.failover = _idle("failover")
        self.down: dict[str, float] = {}
        self.unavailable: list[int] = []
        self.auto_count = 0
        self.dirty = True

    def set_rebalance(self, **fields: Any) -> None:
        self.rebalance.update(fields)
        self.dirty = True

    def set_failover(self, **fields: Any) -> None:
        """Replace the failover report (a new event, not an update of the last one)."""
        new = {**_idle("failover"), **fields}
        if new != self.failover:
            self.failover = new
            self.dirty = True

    def observe(self, down: dict[str, float], unavailable: list[int], auto_count: int) -> None:
        # while a node is down its seconds grow: written at the board's pace (dcpctl
        # shows how long it has been gone)
        if down or set(down) != set(self.down) or unavailable != self.unavailable:
            self.dirty = True
        if auto_count != self.auto_count:
            self.dirty = True
        self.down, self.unavailable, self.auto_count = down, unavailable, auto_count

    def document(self, now: float) -> dict[str, Any]:
        return {
            "orchestrator": self.orchestrator,
            "term": self.term,
            "updated": now,
            "down": {n: round(s, 3) for n, s in sorted(self.down.items())},
            "unavailable": list(self.unavailable),
            "rebalance": dict(self.rebalance),
            "failover": dict(self.failover),
            "autofailover": {"count": self.auto_count, "max": self.max_count},
        }
