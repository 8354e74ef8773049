"""What ``dcpctl cluster`` shows: a cluster's etcd keys turned into rows and documents.

Rules of this module:
- Pure: no I/O, no clock (``now`` is passed in). ``cluster_cmd.py`` reads etcd and talks
  to nodes; this module only interprets what was read, so every view is testable from
  keys written by hand in the documented shapes (docs/cluster.md, "What etcd holds").
- The keys under ``/dcp/<cluster>/`` are written by the nodes (``meta``, ``nodes/``,
  ``members/``), the election (``orchestrator``), the orchestrator (``map``, ``status``,
  ``autofailover``) and dcpctl (``requests/``). A value this module cannot decode is
  shown as unknown (``None``) and reported in ``problems``, never a traceback: the tool
  people reach for when the cluster is in trouble must not fail on the trouble.
- Liveness is ``nodes/<name>`` (present under the node's lease); ``status`` is the
  orchestrator's view at ``status.updated`` and is aged by ``now`` where it matters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..producer.cluster.membership import cluster_prefix
from ..producer.cluster.store import Snapshot
from ..producer.cluster.vbmap import VBucketMap
from .args import ranges_text

__all__ = [
    "REQUEST_FAILOVER",
    "REQUEST_REBALANCE",
    "ClusterView",
    "chain_groups",
    "lag_report",
    "map_doc",
    "node_rows",
    "parse_view",
]

REQUEST_REBALANCE = "requests/rebalance"
REQUEST_FAILOVER = "requests/failover"


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None


@dataclass
class ClusterView:
    """One consistent read of a cluster's keys (a single etcd range read)."""

    name: str
    revision: int
    meta: dict[str, Any] | None = None
    members: dict[str, str | None] = field(default_factory=dict)  # name -> address
    live: dict[str, str | None] = field(default_factory=dict)  # name -> address
    vbmap: VBucketMap | None = None
    map_revision: int = 0
    orchestrator: str | None = None
    term: int = 0
    status: dict[str, Any] = field(default_factory=dict)
    autofailover: dict[str, Any] = field(default_factory=dict)
    requests: dict[str, dict[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def nodes(self) -> list[str]:
        """Every node the cluster knows of: members, live nodes and map servers."""
        named = set(self.members) | set(self.live)
        if self.vbmap is not None:
            named |= set(self.vbmap.servers)
        return sorted(named)

    def address(self, name: str) -> str | None:
        return self.live.get(name) or self.members.get(name)

    def status_part(self, part: str) -> dict[str, Any]:
        got = self.status.get(part)
        return got if isinstance(got, dict) else {}


def _record_address(raw: bytes) -> str | None:
    doc = _json(raw)
    addr = doc.get("address") if isinstance(doc, dict) else None
    return addr if isinstance(addr, str) else None


def parse_view(name: str, snap: Snapshot) -> ClusterView:
    """The cluster ``name`` as ``snap`` (a read of its whole prefix) holds it."""
    prefix = cluster_prefix(name)
    view = ClusterView(name, snap.revision)
    for key, entry in sorted(snap.entries.items()):
        rel = key[len(prefix) :]
        head, _, rest = rel.partition("/")
        if rel == "meta":
            doc = _json(entry.value)
            view.meta = doc if isinstance(doc, dict) else {}
        elif head in ("nodes", "members") and rest:
            addr = _record_address(entry.value)
            if addr is None:
                view.problems.append(f"{rel}: not a node record")
            (view.live if head == "nodes" else view.members)[rest] = addr
        elif rel == "map":
            try:
                view.vbmap = VBucketMap.from_json(entry.value)
                view.map_revision = entry.mod_revision
            except ValueError as exc:
                view.problems.append(f"map (revision {entry.mod_revision}): {exc}")
        elif rel == "orchestrator":
            doc = _json(entry.value)
            node = doc.get("node") if isinstance(doc, dict) else None
            view.orchestrator = node if isinstance(node, str) else None
            view.term = entry.create_revision
        elif rel in ("status", "autofailover") or head == "requests":
            doc = _json(entry.value)
            if not isinstance(doc, dict):
                view.problems.append(f"{rel}: not a JSON object")
                continue
            if rel == "status":
                view.status = doc
            elif rel == "autofailover":
                view.autofailover = doc
            else:
                view.requests[rel] = doc
    return view


def _down_for(view: ClusterView, name: str, now: float) -> float | None:
    """Seconds since ``name``'s lease went, by the orchestrator's last status (aged)."""
    down = view.status.get("down")
    if not isinstance(down, dict) or not isinstance(down.get(name), int | float):
        return None
    updated = view.status.get("updated")
    age = max(0.0, now - updated) if isinstance(updated, int | float) else 0.0
    return round(float(down[name]) + age, 1)


def node_rows(view: ClusterView, now: float) -> list[dict[str, Any]]:
    """One row per node: address, up/down, its copies in the map, orchestrator mark."""
    counts = view.vbmap.counts() if view.vbmap is not None else {}
    rows = []
    for name in view.nodes():
        up = name in view.live
        actives, replicas = counts.get(name, (0, 0)) if view.vbmap is not None else (None, None)
        rows.append(
            {
                "node": name,
                "address": view.address(name),
                "state": "up" if up else "down",
                "member": name in view.members,
                "actives": actives,
                "replicas": replicas,
                "orchestrator": name == view.orchestrator,
                "down_for": None if up else _down_for(view, name, now),
            }
        )
    return rows


def chain_groups(chains: list[tuple[str | None, ...]]) -> list[dict[str, Any]]:
    """Vbuckets grouped by identical chain: ``[{"chain": "n1,n2", "vbuckets": "0-3,9"}]``
    (``-`` where a copy has no node), most vbuckets first."""
    groups: dict[str, list[int]] = {}
    for vb, chain in enumerate(chains):
        groups.setdefault(",".join(n or "-" for n in chain), []).append(vb)
    ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    return [{"chain": c, "count": len(v), "vbuckets": ranges_text(v)} for c, v in ordered]


def map_doc(view: ClusterView) -> dict[str, Any]:
    """The map compactly: per node counts (and after the move in flight), the vbuckets
    with no active copy, and the vbuckets moving, grouped by their move."""
    m = view.vbmap
    assert m is not None
    counts = m.counts()
    moving = m.moving()
    after: dict[str, tuple[int, int]] = {}
    if m.forward is not None:
        after = VBucketMap(m.num_vbuckets, m.num_replicas, m.servers, m.forward).counts()
    nodes = []
    for name in sorted(set(m.servers) | set(view.members)):
        a, r = counts.get(name, (0, 0))
        row: dict[str, Any] = {"node": name, "state": "up" if name in view.live else "down"}
        row.update(actives=a, replicas=r)
        if moving:
            row.update(
                actives_after=after.get(name, (0, 0))[0], replicas_after=after.get(name, (0, 0))[1]
            )
        nodes.append(row)
    moves: dict[tuple[str, str], list[int]] = {}
    for vb in moving:
        fwd = m.forward_names(vb) or ()
        key = (",".join(n or "-" for n in m.names(vb)), ",".join(n or "-" for n in fwd))
        moves.setdefault(key, []).append(vb)
    unavailable = m.unavailable()
    return {
        "cluster": view.name,
        "revision": view.map_revision,
        "num_vbuckets": m.num_vbuckets,
        "num_replicas": m.num_replicas,
        "nodes": nodes,
        "unavailable": ranges_text(unavailable),
        "unavailable_count": len(unavailable),
        "moving": ranges_text(moving),
        "moving_count": len(moving),
        "moves": [
            {"from": f, "to": t, "count": len(v), "vbuckets": ranges_text(v)}
            for (f, t), v in sorted(moves.items(), key=lambda kv: kv[1][0])
        ],
    }


def _fields(pairs: list[tuple[str, str]] | None, field_name: str | None) -> dict[int, Any]:
    """``vb_N:FIELD`` pairs as ``{N: {FIELD: value}}``, or only ``FIELD`` as ``{N: value}``."""
    out: dict[int, Any] = {}
    for k, v in pairs or []:
        head, sep, f = k.partition(":")
        if not sep or not head.startswith("vb_") or not head[3:].isdigit():
            continue
        value: Any = int(v) if v.lstrip("-").isdigit() else v
        if field_name is None:
            out.setdefault(int(head[3:]), {})[f] = value
        elif f == field_name:
            out[int(head[3:])] = value
    return out


def lag_report(
    view: ClusterView, answers: dict[str, tuple[list[Any] | None, list[Any]] | str]
) -> dict[str, Any]:
    """Replication lag per replica copy from each live node's STAT ``replication`` and
    ``vbucket-seqno`` (``answers[node]``: those two pair lists, or the error text when
    it did not answer). A copy's lag is its source's high seqno minus its own when the
    source answered (``measured: "source"``), else the replica's own figure (the highest
    snapshot end its source announced, ``"replica"``). Copies the map names that are not
    replicating are listed with ``stream: "not replicating"``."""
    by_address = {addr: n for n, addr in view.live.items() if addr}
    highs: dict[str, dict[int, Any]] = {}
    repl: dict[str, dict[int, Any]] = {}
    for node, got in answers.items():
        if isinstance(got, tuple):
            repl[node] = _fields(got[0], None)
            highs[node] = _fields(got[1], "high_seqno")
    copies: list[dict[str, Any]] = []
    seen: set[tuple[int, str]] = set()
    for node, per_vb in sorted(repl.items()):
        for vb, f in sorted(per_vb.items()):
            if not f.get("source"):
                continue
            source = by_address.get(f["source"], f["source"])
            own = f.get("high_seqno")
            src_high = highs.get(source, {}).get(vb)
            if isinstance(src_high, int) and isinstance(own, int):
                lag, measured = max(0, src_high - own), "source"
            else:
                lag, measured = f.get("lag"), "replica"
            seen.add((vb, node))
            copies.append(
                {
                    "vb": vb,
                    "node": node,
                    "source": source,
                    "stream": f.get("stream"),
                    "high_seqno": own,
                    "source_high_seqno": src_high,
                    "lag": lag,
                    "measured": measured,
                }
            )
    if view.vbmap is not None:
        for vb in range(view.vbmap.num_vbuckets):
            for node in view.vbmap.replicas(vb):
                if node in repl and (vb, node) not in seen:
                    copies.append(
                        {
                            "vb": vb,
                            "node": node,
                            "source": view.vbmap.active(vb),
                            "stream": "not replicating",
                            "high_seqno": None,
                            "source_high_seqno": None,
                            "lag": None,
                            "measured": None,
                        }
                    )
    nodes = []
    for node in view.nodes():
        mine = [c for c in copies if c["node"] == node]
        lags = [c["lag"] for c in mine if isinstance(c["lag"], int)]
        answer = answers.get(node)
        state = (
            "down" if node not in view.live else "unreachable" if isinstance(answer, str) else "up"
        )
        nodes.append(
            {
                "node": node,
                "state": state,
                "error": answer if isinstance(answer, str) else None,
                "replicas": len(mine) if state == "up" else None,
                "caught_up": sum(1 for x in lags if x == 0) if state == "up" else None,
                "behind": sum(1 for x in lags if x > 0) if state == "up" else None,
                "not_replicating": sum(1 for c in mine if c["lag"] is None)
                if state == "up"
                else None,
                "max_lag": max(lags, default=0) if state == "up" else None,
                "total_lag": sum(lags) if state == "up" else None,
            }
        )
    return {"cluster": view.name, "nodes": nodes, "copies": sorted(copies, key=_lag_order)}


def _lag_order(c: dict[str, Any]) -> tuple[int, int, int, str]:
    """Worst first: not replicating, then by lag descending, then by vbucket."""
    lag = c["lag"]
    return (0 if lag is None else 1, -(lag or 0), c["vb"], c["node"])
