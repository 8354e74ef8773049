"""Live DCP connections and their streams, from the ``dcp-streams`` STAT group.

Rules of this module:
- The server sends one JSON object per DCP connection (``conn:ID``) and per stream
  (``stream:ID:VB``); this module only joins them (a stream shows its connection's
  flow-control window, unacked bytes and noop state) and filters.
- Read-only, one STAT request per command (per node in a cluster: every node of the map
  at once, each row with its ``node``; a node that does not answer is a line
  ``unreachable: ...`` and exit status 3, ``topology.py``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from .output import Output
from .remote import Remote
from .topology import NodeAnswers, Topology, discover, each_node, finish

__all__ = ["cmd_connections", "cmd_streams"]


def parse_streams(
    pairs: list[tuple[str, str]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The ``dcp-streams`` group as connections and streams, each stream joined with its
    connection's flow-control and noop state."""
    conns: list[dict[str, Any]] = []
    streams: list[dict[str, Any]] = []
    for k, v in pairs:
        if k.startswith("conn:"):
            conns.append(json.loads(v))
        elif k.startswith("stream:"):
            streams.append(json.loads(v))
    conns.sort(key=lambda c: c["id"])
    by_id = {c["id"]: c for c in conns}
    for s in streams:
        c = by_id.get(s.get("connection_id"), {})
        s["flow_control"] = c.get("flow_control")
        s["window"] = c.get("window")
        s["unacked_bytes"] = c.get("unacked_bytes")
        s["noop_enabled"] = c.get("noop_enabled")
        s["noop_interval"] = c.get("noop_interval")
        s["noop_pending"] = c.get("noop_pending")
    streams.sort(key=lambda s: (s["connection"], s["vbucket"]))
    return conns, streams


@dataclass
class _Fetched:
    conns: list[dict[str, Any]]
    streams: list[dict[str, Any]]
    topo: Topology
    #: in a cluster: what each node answered (None on a single node)
    answers: NodeAnswers | None = None

    def node_cell(self) -> list[str]:
        return ["node"] if self.answers is not None else []

    def node_of(self, row: dict[str, Any]) -> list[Any]:
        return [row.get("node_name") or row["node"]] if self.answers is not None else []

    def on_nodes(self) -> str:
        return f" on {len(self.answers.results)} nodes" if self.answers is not None else ""

    def finish(self, out: Output) -> int:
        if self.answers is None:
            return 0
        if not out.json_mode:
            self.answers.print_unreachable(out, self.topo)
        return finish(self.answers, self.topo)

    def doc(self, key: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
        if self.answers is None:
            return {key: rows}
        return {key: rows, "unreachable": self.answers.unreachable_docs(self.topo)}


async def _fetch(args: argparse.Namespace) -> _Fetched:
    topo = await discover(args)
    if not topo.cluster:
        async with Remote.of(args) as r:
            (pairs,) = await r.stats("dcp-streams")
        return _Fetched(*parse_streams(pairs), topo)
    answers = await each_node(args, topo, lambda r: r.stats("dcp-streams"))
    conns: list[dict[str, Any]] = []
    streams: list[dict[str, Any]] = []
    for addr, (pairs,) in answers.results.items():
        c, s = parse_streams(pairs)
        node = topo.node_doc(addr)
        conns += [{**node, **row} for row in c]
        streams += [{**node, **row} for row in s]
    return _Fetched(conns, streams, topo, answers)


def _flow(c: dict[str, Any]) -> str:
    if not c.get("window"):
        return "off"
    return f"{c.get('unacked_bytes')}/{c.get('window')}"


def _noop(c: dict[str, Any]) -> str:
    if not c.get("noop_enabled"):
        return "off"
    return f"every {c.get('noop_interval', '?')}s" + (
        ", awaiting reply" if c.get("noop_pending") else ""
    )


async def cmd_connections(args: argparse.Namespace, out: Output) -> int:
    got = await _fetch(args)
    conns, streams = got.conns, got.streams
    if args.name:
        conns = [c for c in conns if c["name"] == args.name]
    for c in conns:
        c["stream_list"] = [
            s["vbucket"]
            for s in streams
            if s.get("connection_id") == c["id"] and s.get("node") == c.get("node")
        ]
    if out.json_mode:
        out.json(got.doc("connections", conns))
        return got.finish(out)
    out.table(
        f"{len(conns)} DCP connections{got.on_nodes()}",
        [
            *got.node_cell(),
            "id",
            "name",
            "peer",
            "agent",
            "streams",
            "unacked/window",
            "flow",
            "noop",
            "bytes out",
            "paused",
        ],
        [
            [
                *got.node_of(c),
                c["id"],
                c["name"],
                c["peer"],
                c["agent"] or "-",
                c["streams"],
                _flow(c),
                c["flow_control"],
                _noop(c),
                c["bytes_out"],
                c["paused"],
            ]
            for c in conns
        ],
        numeric=["id", "streams", "bytes out"],
    )
    return got.finish(out)


async def cmd_streams(args: argparse.Namespace, out: Output) -> int:
    got = await _fetch(args)
    streams = got.streams
    if args.vb is not None:
        streams = [s for s in streams if s["vbucket"] in args.vb]
    if args.name:
        streams = [s for s in streams if s["connection"] == args.name]
    if out.json_mode:
        out.json(got.doc("streams", streams))
        return got.finish(out)
    out.table(
        f"{len(streams)} DCP streams{got.on_nodes()}",
        [
            *got.node_cell(),
            "connection",
            "vb",
            "phase",
            "start..end",
            "last sent",
            "high",
            "lag",
            "items sent",
            "backfills",
            "cursor drops",
            "unacked/window",
            "noop",
        ],
        [
            [
                *got.node_of(s),
                s["connection"],
                s["vbucket"],
                s["state"],
                f"{s['start_seqno']}..{_end(s['end_seqno'])}",
                s["last_sent_seqno"],
                s["high_seqno"],
                s["lag"],
                s["items_sent"],
                s["backfills"],
                s["cursor_drops"],
                _flow(s),
                _noop(s),
            ]
            for s in streams
        ],
        numeric=["vb", "last sent", "high", "lag", "items sent", "backfills", "cursor drops"],
    )
    return got.finish(out)


def _end(seqno: int) -> str:
    return "∞" if seqno >= (1 << 64) - 1 else str(seqno)
