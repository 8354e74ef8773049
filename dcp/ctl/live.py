"""Live-server views built from STAT groups: vbuckets, failover-log, checkpoints, stats.

Rules of this module:
- Read-only: only STAT requests (``Remote.stats``), pipelined per command; ``vbuckets``
  also asks each replica's source for its high seqnos (``replicas.py``).
- Each command turns the raw ``(key, value)`` pairs into plain rows first, then hands
  them to ``Output`` (table or JSON). Seqnos, uuids and sizes are ints in JSON.
- Unknown vbuckets are reported before anything is printed.
- STAT key layout (``dcp/producer/stats.py``): ``vb_N:FIELD``; names inside a field
  (cursors, streams) may hold ``:``, so the last ``:`` separates the field.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .args import check_vbuckets
from .output import Output
from .remote import Remote
from .replicas import (
    lag_cell,
    replica_columns,
    replication_fields,
    source_high_cell,
    source_high_seqnos,
)
from .topology import discover

__all__ = ["cmd_checkpoints", "cmd_failover_log", "cmd_stats", "cmd_vbuckets"]


def num(value: str) -> Any:
    """An int when the STAT value is one, else the string."""
    try:
        return int(value)
    except ValueError:
        return value


def by_vbucket(pairs: list[tuple[str, str]]) -> dict[int, dict[str, Any]]:
    """``vb_N:field`` pairs grouped as ``{N: {field: value}}``."""
    out: dict[int, dict[str, Any]] = {}
    for k, v in pairs:
        head, sep, rest = k.partition(":")
        if head.startswith("vb_") and head[3:].isdigit():
            out.setdefault(int(head[3:]), {})[rest if sep else ""] = num(v)
    return out


def streams_per_vbucket(pairs: list[tuple[str, str]]) -> dict[int, int]:
    """Open DCP streams per vbucket, from the ``dcp-streams`` group."""
    out: dict[int, int] = {}
    for k, v in pairs:
        if k.startswith("stream:"):
            st = json.loads(v)
            if st.get("state") != "dead":
                out[st["vbucket"]] = out.get(st["vbucket"], 0) + 1
    return out


# ---------------------------------------------------------------------- vbuckets

_VB_COLUMNS = [
    "vb",
    "state",
    "uuid",
    "high",
    "persisted",
    "stable",
    "purge",
    "in memory",
    "ckpts",
    "ckpt mem",
    "streams",
]
_VB_NUMERIC = [*_VB_COLUMNS[2:], "vb"]
_REPL_COLUMNS = ["source", "link", "src high", "lag"]


VB_GROUPS = ("vbucket", "vbucket-seqno", "checkpoint", "dcp-streams", "replication")


async def vbucket_groups(r: Remote) -> list[Any]:
    """The STAT groups ``vbuckets`` is built from, in one pipelined round trip."""
    return await r.stats(*VB_GROUPS, optional=("replication",))


def vbucket_states(groups: list[Any]) -> dict[int, str]:
    return {int(k[3:]): v for k, v in groups[0] if k.startswith("vb_")}


def replica_sources(groups: list[Any], vbs: list[int]) -> set[str]:
    """The replication sources of ``vbs`` (HOST:PORT as the node reports them)."""
    rep = replication_fields(groups[4] or [])
    return {rep[vb]["source"] for vb in vbs if rep.get(vb, {}).get("source")}


def seqno_highs(groups: list[Any]) -> dict[int, int]:
    """vb -> high seqno, from the ``vbucket-seqno`` group (what a source is asked for)."""
    return {vb: f["high_seqno"] for vb, f in by_vbucket(groups[1]).items() if "high_seqno" in f}


def vbucket_rows(
    groups: list[Any],
    vbs: list[int],
    active_only: bool,
    highs: dict[str, dict[int, int] | None],
    skip_dead: bool = False,
) -> list[dict[str, Any]]:
    """One row per vbucket of ``vbs`` the node has (``skip_dead``: copies only)."""
    state_of = vbucket_states(groups)
    seq = by_vbucket(groups[1])
    ck = by_vbucket(groups[2])
    nstreams = streams_per_vbucket(groups[3])
    rep = replication_fields(groups[4] or [])
    rows: list[dict[str, Any]] = []
    for vb in vbs:
        state = state_of.get(vb)
        if (active_only and state != "active") or (skip_dead and state in (None, "dead")):
            continue
        s, c = seq.get(vb, {}), ck.get(vb, {})
        rows.append(
            {
                "vbucket": vb,
                "state": state,
                "vb_uuid": s.get("vb_uuid"),
                "high_seqno": s.get("high_seqno"),
                "persisted_seqno": s.get("last_persisted_seqno"),
                # active copies only: no single node failure can take back what is below
                "stable_seqno": s.get("stable_seqno"),
                "purge_seqno": s.get("purge_seqno"),
                "items_in_memory": c.get("num_items"),
                "checkpoints": c.get("num_checkpoints"),
                "checkpoint_memory": c.get("mem_usage"),
                "open_streams": nstreams.get(vb, 0),
                **replica_columns(rep.get(vb, {}), s.get("high_seqno"), highs, vb),
            }
        )
    return rows


def vbucket_totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    totals: dict[str, Any] = {"vbuckets": len(rows)}
    for key in (
        "high_seqno",
        "persisted_seqno",
        "items_in_memory",
        "checkpoints",
        "checkpoint_memory",
        "open_streams",
    ):
        totals[key] = sum(row[key] or 0 for row in rows)
    by_state: dict[str, int] = {}
    for row in rows:
        by_state[row["state"]] = by_state.get(row["state"], 0) + 1
    totals["states"] = by_state
    replicated = [row for row in rows if row["source"]]
    totals["replicated"] = len(replicated)
    totals["lag"] = sum(row["lag"] or 0 for row in replicated)
    return totals


def print_vbuckets(
    out: Output,
    title: str,
    rows: list[dict[str, Any]],
    totals: dict[str, Any],
    node_of: Any = None,
) -> None:
    """The ``vbuckets`` table; ``node_of(row)``: a ``node`` column after ``vb`` (cluster)."""
    by_state = totals["states"]
    states_txt = ", ".join(f"{n} {s}" for s, n in sorted(by_state.items()))
    replicated = totals["replicated"]
    columns = list(_VB_COLUMNS)
    footer: list[Any] = [
        "total",
        states_txt,
        "",
        totals["high_seqno"],
        totals["persisted_seqno"],
        "",
        "",
        totals["items_in_memory"],
        totals["checkpoints"],
        totals["checkpoint_memory"],
        totals["open_streams"],
    ]
    if replicated:  # the replication columns only where there is replication
        columns += _REPL_COLUMNS
        footer += ["", "", "", totals["lag"]]
    body = []
    for row in rows:
        cells = [
            row["vbucket"],
            row["state"],
            row["vb_uuid"],
            row["high_seqno"],
            row["persisted_seqno"],
            row["stable_seqno"],
            row["purge_seqno"],
            row["items_in_memory"],
            row["checkpoints"],
            row["checkpoint_memory"],
            row["open_streams"],
        ]
        if replicated:
            cells += [row["source"], row["stream"], source_high_cell(row), lag_cell(row)]
        if node_of is not None:
            cells.insert(1, node_of(row))
        body.append(cells)
    if node_of is not None:
        columns.insert(1, "node")
        footer.insert(1, "")
    out.table(title, columns, body, footer=footer, numeric=[*_VB_NUMERIC, "src high", "lag"])
    if any(row["source"] and not row["source_reachable"] for row in rows):
        out.line("* source unreachable: lag behind the last snapshot end it announced")


async def cmd_vbuckets(args: argparse.Namespace, out: Output) -> int:
    topo = await discover(args)
    if topo.cluster:
        from .across import vbuckets_across

        return await vbuckets_across(args, out, topo)
    async with Remote.of(args) as r:
        groups = await vbucket_groups(r)
    vbs = check_vbuckets(args.vb, len(vbucket_states(groups)))
    sources = replica_sources(groups, vbs)
    highs = (
        await source_high_seqnos(sources, args.timeout, getattr(args, "security", None))
        if sources
        else {}
    )
    rows = vbucket_rows(groups, vbs, args.active, highs)
    totals = vbucket_totals(rows)
    if out.json_mode:
        out.json({"vbuckets": rows, "totals": totals})
        return 0
    print_vbuckets(out, f"{len(rows)} vbuckets on {r.where}", rows, totals)
    return 0


# ---------------------------------------------------------------------- failover-log


async def cmd_failover_log(args: argparse.Namespace, out: Output) -> int:
    topo = await discover(args)
    addr = topo.pick(args.node, args.vbucket)
    with topo.on_node(addr):
        async with Remote.of(args, *(addr or ())) as r:
            (pairs,) = await r.stats(f"failovers {args.vbucket}")
    fields = by_vbucket(pairs).get(args.vbucket, {})
    n = fields.get("num_entries", 0)
    entries = [
        {"index": i, "vb_uuid": fields[f"{i}:id"], "seqno": fields[f"{i}:seq"]} for i in range(n)
    ]
    where, node = topo.asked(addr, args.vbucket)
    if out.json_mode:
        out.json({"vbucket": args.vbucket, **node, "entries": entries})
        return 0
    out.table(
        f"failover log of vb {args.vbucket}{where} (newest first)",
        ["#", "vb_uuid", "seqno"],
        [[e["index"], e["vb_uuid"], e["seqno"]] for e in entries],
        numeric=["#", "vb_uuid", "seqno"],
    )
    return 0


# ---------------------------------------------------------------------- checkpoints


def _named(fields: dict[str, Any], prefix: str) -> dict[str, dict[str, Any]]:
    """``prefix:NAME:field`` entries as ``{NAME: {field: value}}`` (NAME may hold ':')."""
    out: dict[str, dict[str, Any]] = {}
    for k, v in fields.items():
        if k.startswith(prefix):
            name, _, field = k[len(prefix) :].rpartition(":")
            out.setdefault(name, {})[field] = v
    return out


def checkpoint_view(vb: int, fields: dict[str, Any]) -> dict[str, Any]:
    """The ``checkpoint VB`` group of one vbucket as a document."""
    ckpts = [{"id": int(i), **f} for i, f in _named(fields, "ckpt:").items()]
    ckpts.sort(key=lambda c: c["id"])
    cursors = []
    for name, f in sorted(_named(fields, "cursor:").items()):
        cursors.append(
            {
                "name": name,
                "checkpoint_id": f.get("checkpoint_id"),
                "offset": f.get("offset"),
                "last_seqno": f.get("last_seqno"),
                "lag": f.get("lag"),
                "dropped": f.get("dropped") == "true",
            }
        )
    dropped = [
        {
            "stream": name,
            "cursor_drops": f.get("cursor_drops"),
            "dropped_now": f.get("cursor_dropped") == "true",
            "state": f.get("state"),
            "last_sent_seqno": f.get("last_sent_seqno"),
            "lag": f.get("lag"),
        }
        for name, f in sorted(_named(fields, "stream:").items())
    ]
    summary = {k: v for k, v in fields.items() if not k.startswith(("ckpt:", "cursor:", "stream:"))}
    return {
        "vbucket": vb,
        **summary,
        "checkpoints": ckpts,
        "cursors": cursors,
        "dropped_cursors": dropped,
    }


def _range(start: Any, last: Any) -> str:
    if isinstance(start, int) and isinstance(last, int) and last < start:
        return f"empty (next {start})"
    return f"{start}..{last}"


async def cmd_checkpoints(args: argparse.Namespace, out: Output) -> int:
    topo = await discover(args)
    addr = topo.pick(args.node, args.vbucket)
    with topo.on_node(addr):
        async with Remote.of(args, *(addr or ())) as r:
            (pairs,) = await r.stats(f"checkpoint {args.vbucket}")
    doc = checkpoint_view(args.vbucket, by_vbucket(pairs).get(args.vbucket, {}))
    where, node = topo.asked(addr, args.vbucket)
    if out.json_mode:
        out.json({"vbucket": args.vbucket, **node, **doc} if node else doc)
        return 0
    out.line(
        f"vb {args.vbucket}{where}: high seqno {doc.get('high_seqno')}, persisted "
        f"{doc.get('persisted_seqno')}, memory from seqno {doc.get('memory_start_seqno')}, "
        f"{doc.get('num_items')} items in {doc.get('num_checkpoints')} checkpoints, "
        f"{doc.get('mem_usage')} bytes"
    )
    out.table(
        "checkpoints",
        ["id", "state", "seqnos", "items", "slots", "bytes", "cursors"],
        [
            [
                c["id"],
                c.get("state"),
                _range(c.get("start_seqno"), c.get("last_seqno")),
                c.get("num_items"),
                c.get("num_slots"),
                c.get("mem_usage"),
                c.get("num_cursors"),
            ]
            for c in doc["checkpoints"]
        ],
        numeric=["id", "items", "slots", "bytes", "cursors"],
    )
    out.table(
        "cursors",
        ["cursor", "checkpoint", "offset", "last seqno", "lag"],
        [
            [c["name"], c["checkpoint_id"], c["offset"], c["last_seqno"], c["lag"]]
            for c in doc["cursors"]
        ],
        numeric=["checkpoint", "offset", "last seqno", "lag"],
    )
    if doc["dropped_cursors"]:
        out.table(
            "dropped cursors (streams that fell back to disk)",
            ["stream", "drops", "dropped now", "phase", "last sent", "lag"],
            [
                [
                    d["stream"],
                    d["cursor_drops"],
                    d["dropped_now"],
                    d["state"],
                    d["last_sent_seqno"],
                    d["lag"],
                ]
                for d in doc["dropped_cursors"]
            ],
            numeric=["drops", "last sent", "lag"],
        )
    else:
        out.line("dropped cursors: none")
    return 0


# ---------------------------------------------------------------------- stats


async def cmd_stats(args: argparse.Namespace, out: Output) -> int:
    group = " ".join(args.group)
    topo = await discover(args)
    addr = topo.pick(args.node)
    with topo.on_node(addr):
        async with Remote.of(args, *(addr or ())) as r:
            (pairs,) = await r.stats(group)
    _, node = topo.asked(addr)
    if out.json_mode:
        out.json({"group": group, **node, "stats": dict(pairs)})
        return 0
    where = topo.label(addr) if addr is not None else r.where
    out.pairs(f"STAT {group!r} from {where}", pairs)
    return 0
