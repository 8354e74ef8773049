"""STAT groups, with Couchbase's key names where they exist.

Rules of this module: read-only views of server state as ``(key, value)`` pairs. An
unknown group raises ``KeyError`` (-> KEY_ENOENT), a bad argument ``ValueError``
(-> EINVAL). ``dcpctl`` and tests read these; cbstats-style tools can too.

Groups: ``""`` (general), ``vbucket``, ``vbucket-seqno [vb]``, ``failovers [vb]``,
``checkpoint [vb]``, ``dcp``, ``dcp-streams`` (one JSON value per stream, for tools).

``checkpoint [vb]`` keys (all prefixed ``vb_N:``): the manager's summary (``num_checkpoints``,
``num_items``, ``mem_usage``...), ``high_seqno`` / ``persisted_seqno``, one
``ckpt:ID:FIELD`` set per checkpoint (state, start_seqno, last_seqno, num_items,
num_slots, mem_usage, num_cursors), ``cursor:NAME:FIELD`` per cursor (checkpoint_id,
offset, last_seqno, lag, dropped) and ``stream:NAME:FIELD`` per stream of the vbucket
that lost its cursor (cursor_drops, cursor_dropped, state, last_sent_seqno, lag).
Cursor and stream names may contain ``:``; the field is always after the last one.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .server import DcpServer

__all__ = ["stat_pairs"]


def _vbuckets(server: DcpServer, arg: str) -> range | list[int]:
    n = server.bucket.num_vbuckets
    if not arg:
        return range(n)
    try:
        vb = int(arg)
    except ValueError as exc:
        raise ValueError(f"vbucket id {arg!r} is not a number") from exc
    if not 0 <= vb < n:
        raise ValueError(f"vbucket {vb} does not exist (0..{n - 1})")
    return [vb]


def _general(server: DcpServer) -> list[tuple[str, Any]]:
    b = server.bucket
    conns = server.connections
    return [
        ("version", "0.1.0"),
        ("uptime", int(server.uptime())),
        ("curr_connections", len(conns)),
        ("ep_dcp_count", sum(1 for c in conns if c.dcp_name)),
        ("ep_num_vbuckets", b.num_vbuckets),
        ("ep_checkpoint_memory", b.checkpoint_memory()),
        ("ep_checkpoint_memory_quota", b.checkpoint_memory_quota),
        ("ep_checkpoint_memory_retained", b.checkpoint_retained()),
        ("ep_queue_size", b.flusher.pending_items()),
        ("ep_storage_error", server.storage_error or ""),
        ("ep_rollbacks_answered", server.metrics.rollbacks),
        ("ep_cursors_dropped", b.cursors_dropped),
    ]


def _vbucket_seqno(server: DcpServer, arg: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for vb in _vbuckets(server, arg):
        for k, v in server.bucket.vbucket(vb).stats_seqno().items():
            out.append((f"vb_{vb}:{k}", v))
    return out


def _failovers(server: DcpServer, arg: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for vb in _vbuckets(server, arg):
        entries = list(server.bucket.vbucket(vb).failover_log.entries)
        out.append((f"vb_{vb}:num_entries", len(entries)))
        for i, (uuid, seqno) in enumerate(entries):
            out.append((f"vb_{vb}:{i}:id", uuid))
            out.append((f"vb_{vb}:{i}:seq", seqno))
    return out


def _checkpoint(server: DcpServer, arg: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    streams_by_vb: dict[int, list[Any]] = {}
    for s in server.streams():
        streams_by_vb.setdefault(s.vbid, []).append(s)
    for vb in _vbuckets(server, arg):
        v = server.bucket.vbucket(vb)
        mgr = v.checkpoints
        p = f"vb_{vb}:"
        out.extend((p + k, val) for k, val in mgr.stats().items())
        high = v.high_seqno
        out.append((p + "high_seqno", high))
        out.append((p + "persisted_seqno", v.persisted_seqno))
        for ck in mgr.checkpoints:
            c = f"{p}ckpt:{ck.id}:"
            out.append((c + "state", "closed" if ck.closed else "open"))
            out.append((c + "start_seqno", ck.start_seqno))
            out.append((c + "last_seqno", ck.last_seqno))
            out.append((c + "num_items", ck.num_items))
            out.append((c + "num_slots", len(ck.items)))
            out.append((c + "mem_usage", ck.mem))
            out.append((c + "num_cursors", ck.num_cursors))
        for cur in mgr.cursors:
            c = f"{p}cursor:{cur.name}:"
            out.append((c + "offset", cur.position[1]))
            out.append((c + "lag", max(0, high - cur.last_seqno)))
        for s in streams_by_vb.get(vb, ()):
            dropped_now = bool(s.cursor is not None and s.cursor.dropped)
            if not (s.cursor_drops or dropped_now):
                continue
            c = f"{p}stream:{s.name}:"
            out.append((c + "cursor_drops", s.cursor_drops))
            out.append((c + "cursor_dropped", "true" if dropped_now else "false"))
            out.append((c + "state", s.state.value))
            out.append((c + "last_sent_seqno", s.last_sent_seqno))
            out.append((c + "lag", max(0, high - s.last_sent_seqno)))
    return out


def _vbucket(server: DcpServer, arg: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for vb in _vbuckets(server, arg):
        out.append((f"vb_{vb}", server.bucket.vbucket(vb).state.name.lower()))
    return out


def _dcp(server: DcpServer) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    producers = [c for c in server.connections if c.dcp_name]
    out.append(("ep_dcp_count", len(producers)))
    out.append(("ep_dcp_producer_count", len(producers)))
    out.append(("ep_dcp_total_bytes", server.metrics.bytes_out))
    out.append(("ep_dcp_stream_count", sum(len(c.streams) for c in producers)))
    for c in producers:
        prefix = f"eq_dcpq:{c.dcp_name}"
        for k, v in c.statistics().items():
            out.append((f"{prefix}:{k}", v))
        for s in c.streams.values():
            for k, v in s.statistics().items():
                out.append((f"{prefix}:stream_{s.vbid}_{k}", v))
    return out


def _dcp_streams(server: DcpServer) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for c in server.connections:
        if not c.dcp_name:
            continue
        conn_stats = c.statistics()
        out.append((f"conn:{c.id}", json.dumps(conn_stats, sort_keys=True)))
        for s in c.streams.values():
            st = s.statistics()
            st["connection"] = c.dcp_name
            st["connection_id"] = c.id
            st["high_seqno"] = s.vbucket.high_seqno
            st["lag"] = max(0, s.vbucket.high_seqno - s.last_sent_seqno)
            out.append((f"stream:{c.id}:{s.vbid}", json.dumps(st, sort_keys=True)))
    return out


def stat_pairs(server: DcpServer, group: str) -> list[tuple[str, Any]]:
    name, _, arg = group.partition(" ")
    arg = arg.strip()
    if name == "":
        return _general(server)
    if name == "vbucket-seqno":
        return _vbucket_seqno(server, arg)
    if name == "failovers":
        return _failovers(server, arg)
    if name == "checkpoint":
        return _checkpoint(server, arg)
    if name == "vbucket":
        return _vbucket(server, arg)
    if name == "dcp":
        return _dcp(server)
    if name == "dcp-streams":
        return _dcp_streams(server)
    raise KeyError(name)
