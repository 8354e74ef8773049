"""Live DCP connections and their streams, from the ``dcp-streams`` STAT group.

Rules of this module:
- The server sends one JSON object per DCP connection (``conn:ID``) and per stream
  (``stream:ID:VB``); this module only joins them (a stream shows its connection's
  flow-control window, unacked bytes and noop state) and filters.
- Read-only, one STAT request per command.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .output import Output
from .remote import Remote

__all__ = ["cmd_connections", "cmd_streams"]


async def _fetch(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    async with Remote.of(args) as r:
        (pairs,) = await r.stats("dcp-streams")
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
    conns, streams = await _fetch(args)
    if args.name:
        conns = [c for c in conns if c["name"] == args.name]
    for c in conns:
        c["stream_list"] = [s["vbucket"] for s in streams if s.get("connection_id") == c["id"]]
    if out.json_mode:
        out.json({"connections": conns})
        return 0
    out.table(
        f"{len(conns)} DCP connections",
        [
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
    return 0


async def cmd_streams(args: argparse.Namespace, out: Output) -> int:
    _conns, streams = await _fetch(args)
    if args.vb is not None:
        streams = [s for s in streams if s["vbucket"] in args.vb]
    if args.name:
        streams = [s for s in streams if s["connection"] == args.name]
    if out.json_mode:
        out.json({"streams": streams})
        return 0
    out.table(
        f"{len(streams)} DCP streams",
        [
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
    return 0


def _end(seqno: int) -> str:
    return "∞" if seqno >= (1 << 64) - 1 else str(seqno)
