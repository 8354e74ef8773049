"""STAT groups, with Couchbase's key names where they exist.

Rules of this module: read-only views of server state as ``(key, value)`` pairs, read
through ``ServerView`` (server_view.py: exactly what this module needs, nothing that
changes anything). An
unknown group raises ``KeyError`` (-> KEY_ENOENT), a bad argument ``ValueError``
(-> EINVAL), both from ``stat_units`` itself, before any pair is produced. ``dcpctl`` and
tests read these; cbstats-style tools can too.

A group is produced lazily, in *units* (the pairs of one vbucket, one connection...):
``stat_units`` returns an iterator of lists, and the connection encodes and queues one
unit at a time, yielding to the event loop between them and pausing at its output cap
(``Connection.run_continuation``). A group over 1024 vbuckets is thus never built in
one go while other clients wait. A unit is built without yielding, so it is a
consistent view of its vbucket or connection; different units may be moments apart.

Groups: ``""`` (general), ``vbucket``, ``vbucket-seqno [vb]`` (the engine's seqnos and,
for an active vbucket, ``majority_seqno``, ``majority_persisted_seqno`` and
``stable_seqno`` from the durability monitor, durability.py), ``failovers [vb]``,
``checkpoint [vb]``, ``dcp``, ``dcp-streams`` (one JSON value per stream, for tools),
``replication [vb]`` (per vbucket ``vb_N:state`` and, for a replica fed from a source,
``source``, ``high_seqno``, ``source_seqno`` (the highest snapshot end the source
announced), ``lag`` and ``stream``; then per source node ``source:ADDR:FIELD``),
``cluster`` (cluster/agent.py ``stat_pairs``: node name, cluster, map revision, fenced,
whether this node is the orchestrator, lease TTL...; a single node: its name, rev 1).

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
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .server_view import ServerView

__all__ = ["stat_units"]

Pairs = list[tuple[str, Any]]


def _vbuckets(server: ServerView, arg: str) -> range | list[int]:
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


def _general(server: ServerView) -> Iterator[Pairs]:
    b = server.bucket
    conns = server.connections
    m = server.metrics
    yield [
        ("version", "0.1.0"),
        ("uptime", int(server.uptime())),
        ("curr_connections", len(conns)),
        ("max_connections", server.config.max_connections),
        ("total_connections", m.connections_total),
        ("rejected_conns", m.connections_refused),
        ("accept_errors", m.accept_errors),
        ("conns_closed_output_memory", m.connections_shed),
        ("conns_closed_idle", m.idle_closed),
        ("conns_closed_partial_frame", m.partial_frame_closed),
        ("output_bytes", server.output_bytes()),
        ("total_output_cap", server.config.total_output_cap),
        ("durable_write_timeouts", m.durable_timeouts),
        ("ep_dcp_count", sum(1 for c in conns if c.dcp_name)),
        ("ep_num_vbuckets", b.num_vbuckets),
        ("ep_checkpoint_memory", b.checkpoint_memory()),
        ("ep_checkpoint_memory_quota", b.checkpoint_memory_quota),
        ("ep_checkpoint_memory_retained", b.checkpoint_retained()),
        ("ep_queue_size", b.flusher.pending_items()),
        ("ep_storage_error", server.storage_error or ""),
        ("ep_rollbacks_answered", m.rollbacks),
        ("ep_cursors_dropped", b.cursors_dropped),
    ]


def _vbucket_seqno(server: ServerView, vbs: range | list[int]) -> Iterator[Pairs]:
    dur = server.durability
    for vb in vbs:
        p = f"vb_{vb}:"
        out = [(p + k, v) for k, v in server.bucket.vbucket(vb).stats_seqno().items()]
        if dur.is_active(vb):  # the majority is counted by the active only
            out.append((p + "majority_seqno", dur.majority_seqno(vb)))
            out.append((p + "majority_persisted_seqno", dur.majority_persisted_seqno(vb)))
            out.append((p + "stable_seqno", dur.stable_seqno(vb)))
        yield out


def _failovers(server: ServerView, vbs: range | list[int]) -> Iterator[Pairs]:
    for vb in vbs:
        entries = list(server.bucket.vbucket(vb).failover_log.entries)
        out: Pairs = [(f"vb_{vb}:num_entries", len(entries))]
        for i, (uuid, seqno) in enumerate(entries):
            out.append((f"vb_{vb}:{i}:id", uuid))
            out.append((f"vb_{vb}:{i}:seq", seqno))
        yield out


def _checkpoint(server: ServerView, vbs: range | list[int]) -> Iterator[Pairs]:
    for vb in vbs:
        yield _checkpoint_of(server, vb)


def _checkpoint_of(server: ServerView, vb: int) -> Pairs:
    out: Pairs = []
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
    for s in server.streams_of(vb):
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


def _vbucket(server: ServerView, vbs: range | list[int]) -> Iterator[Pairs]:
    for vb in vbs:
        yield [(f"vb_{vb}", server.bucket.vbucket(vb).state.name.lower())]


def _replication(server: ServerView, vbs: range | list[int]) -> Iterator[Pairs]:
    for vb in vbs:
        v = server.bucket.vbucket(vb)
        out: Pairs = [(f"vb_{vb}:state", v.state.name.lower())]
        info = server.replication_of(vb)
        if info:
            high = v.high_seqno
            source_seqno = max(info.get("source_seqno", 0), high)
            out += [
                (f"vb_{vb}:source", info["source"]),
                (f"vb_{vb}:high_seqno", high),
                (f"vb_{vb}:source_seqno", source_seqno),
                (f"vb_{vb}:lag", source_seqno - high),
                (f"vb_{vb}:stream", info.get("stream", "requested")),
            ]
        yield out
    if len(vbs) == server.bucket.num_vbuckets:
        for addr, st in sorted(server.replication_sources().items()):
            yield [
                (f"source:{addr}:{k}", ("true" if v else "false") if isinstance(v, bool) else v)
                for k, v in st.items()
            ]


def _dcp(server: ServerView) -> Iterator[Pairs]:
    producers = [c for c in server.connections if c.dcp_name]
    yield [
        ("ep_dcp_count", len(producers)),
        ("ep_dcp_producer_count", len(producers)),
        ("ep_dcp_total_bytes", server.metrics.bytes_out),
        ("ep_dcp_stream_count", sum(len(c.streams) for c in producers)),
    ]
    sources = server.replication_sources()
    if sources:  # this node as a replica: what it receives from its sources
        lags = [
            i["lag"] for i in map(server.replication_of, range(server.bucket.num_vbuckets)) if i
        ]
        yield [
            ("ep_dcp_replica_sources", len(sources)),
            (
                "ep_dcp_replica_bytes_received",
                sum(v.get("bytes_received", 0) for v in sources.values()),
            ),
            (
                "ep_dcp_replica_items_applied",
                sum(v.get("items_applied", 0) for v in sources.values()),
            ),
            ("ep_dcp_replica_lag", sum(lags)),
            ("ep_dcp_replica_lag_max", max(lags, default=0)),
        ]
    for c in producers:
        prefix = f"eq_dcpq:{c.dcp_name}"
        out: Pairs = [(f"{prefix}:{k}", v) for k, v in c.statistics().items()]
        for s in list(c.streams.values()):
            for k, v in s.statistics().items():
                out.append((f"{prefix}:stream_{s.vbid}_{k}", v))
        yield out


def _dcp_streams(server: ServerView) -> Iterator[Pairs]:
    for c in [c for c in server.connections if c.dcp_name]:
        conn_stats = c.statistics()
        out: Pairs = [(f"conn:{c.id}", json.dumps(conn_stats, sort_keys=True))]
        for s in list(c.streams.values()):
            st = s.statistics()
            st["connection"] = c.dcp_name
            st["connection_id"] = c.id
            st["high_seqno"] = s.vbucket.high_seqno
            st["lag"] = max(0, s.vbucket.high_seqno - s.last_sent_seqno)
            out.append((f"stream:{c.id}:{s.vbid}", json.dumps(st, sort_keys=True)))
        yield out


_PER_VBUCKET = {
    "vbucket-seqno": _vbucket_seqno,
    "failovers": _failovers,
    "checkpoint": _checkpoint,
    "vbucket": _vbucket,
    "replication": _replication,
}


def _cluster(server: ServerView) -> Iterator[Pairs]:
    yield list(server.cluster.stat_pairs())


_WHOLE = {"": _general, "dcp": _dcp, "dcp-streams": _dcp_streams, "cluster": _cluster}


def stat_units(server: ServerView, group: str) -> Iterator[Pairs]:
    """The pairs of ``group``, one unit at a time (see the module rules). Raises
    ``KeyError`` / ``ValueError`` at once, not when iterated."""
    name, _, arg = group.partition(" ")
    arg = arg.strip()
    per_vb = _PER_VBUCKET.get(name)
    if per_vb is not None:
        return per_vb(server, _vbuckets(server, arg))
    whole = _WHOLE.get(name)
    if whole is None:
        raise KeyError(name)
    return whole(server)
