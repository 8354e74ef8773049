"""``dcpctl inspect DATA_DIR ...``: what a data directory holds, read without a server.

Rules of this module:
- Read-only and safe while the server runs (see ``store_reader.py``); every view is what is
  *persisted*: a running server may hold newer items in memory.
- ``vbuckets`` (the default) and ``check`` scan every record of the chosen vbuckets;
  ``dump`` and ``history`` scan one vbucket. A progress bar appears on a terminal.
- ``dump`` writes JSON Lines with ``--json`` (one item per line, streamed); the other
  views write one JSON document.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

from ..producer.engine.item import ItemOp
from ..protocol.opcodes import VBucketState
from .args import check_vbuckets
from .check import check_store
from .output import CtlError, Output, preview, value_doc
from .store_reader import OfflineStore, Snapshot, describe_env

__all__ = ["cmd_inspect"]

_MUTATION = int(ItemOp.MUTATION)


def _op_name(op: int) -> str:
    try:
        return ItemOp(op).name.lower()
    except ValueError:
        return f"0x{op:02x}"


def _state_name(state: int) -> str:
    try:
        return VBucketState(state).name.lower()
    except ValueError:
        return f"unknown({state})"


# ---------------------------------------------------------------------- vbuckets


def _vb_summary(snap: Snapshot, vb: int) -> dict[str, Any]:
    rec = snap.state(vb)
    newest: dict[bytes, int] = {}
    records = lo = hi = 0
    for r in snap.records(vb):
        records += 1
        lo = lo or r.key_seqno
        hi = r.key_seqno
        newest[r.key] = r.op
    live = sum(1 for op in newest.values() if op == _MUTATION)
    return {
        "vbucket": vb,
        "state": _state_name(rec.state) if rec else None,
        "vb_uuid": rec.failover[0][0] if rec and rec.failover else None,
        "failover_entries": len(rec.failover) if rec else 0,
        "high_seqno": rec.high_seqno if rec else None,
        "snap_start": rec.snap_start if rec else None,
        "snap_end": rec.snap_end if rec else None,
        "purge_seqno": rec.purge_seqno if rec else None,
        "history_start": rec.history_start if rec else None,
        "max_cas": rec.max_cas if rec else None,
        "records": records,
        "live_items": live,
        "tombstones": len(newest) - live,
        "superseded": records - len(newest),
        "min_seqno": lo,
        "max_seqno": hi,
    }


def _vbuckets(store: OfflineStore, args: argparse.Namespace, out: Output) -> int:
    vbs = check_vbuckets(args.vb, store.num_vbuckets, "this data dir")
    rows = []
    with out.progress("scanning vbuckets", len(vbs)) as bar:
        for vb in vbs:
            with store.read() as snap:
                row = _vb_summary(snap, vb)
            bar.advance()
            if args.active and row["state"] != "active":
                continue
            rows.append(row)
    totals = {
        k: sum(r[k] or 0 for r in rows)
        for k in ("high_seqno", "records", "live_items", "tombstones", "superseded")
    }
    env = describe_env(store)
    if out.json_mode:
        out.json({"data_dir": env, "vbuckets": rows, "totals": totals})
        return 0
    out.line(
        f"{env['path']}: format {env['format']}, {env['num_vbuckets']} vbuckets, "
        f"{env['file_bytes']} bytes, clean shutdown marker: "
        f"{'yes' if env['clean_shutdown'] else 'no'}"
    )
    cols = [
        "vb",
        "state",
        "uuid",
        "high",
        "snapshot",
        "purge",
        "history from",
        "records",
        "live",
        "tombstones",
        "superseded",
        "seqnos",
    ]
    out.table(
        f"{len(rows)} vbuckets as persisted",
        cols,
        [
            [
                r["vbucket"],
                r["state"],
                r["vb_uuid"],
                r["high_seqno"],
                f"{r['snap_start']}..{r['snap_end']}",
                r["purge_seqno"],
                r["history_start"],
                r["records"],
                r["live_items"],
                r["tombstones"],
                r["superseded"],
                f"{r['min_seqno']}..{r['max_seqno']}" if r["records"] else "-",
            ]
            for r in rows
        ],
        footer=[
            "total",
            "",
            "",
            totals["high_seqno"],
            "",
            "",
            "",
            totals["records"],
            totals["live_items"],
            totals["tombstones"],
            totals["superseded"],
            "",
        ],
        numeric=[
            "vb",
            "uuid",
            "high",
            "purge",
            "history from",
            "records",
            "live",
            "tombstones",
            "superseded",
        ],
    )
    return 0


# ---------------------------------------------------------------------- failover-log


def _failover(store: OfflineStore, args: argparse.Namespace, out: Output) -> int:
    with store.read() as snap:
        rec = snap.state(args.vbucket)
    if rec is None:
        raise CtlError(f"vbucket {args.vbucket} has no persisted state")
    entries = [{"index": i, "vb_uuid": u, "seqno": s} for i, (u, s) in enumerate(rec.failover)]
    if out.json_mode:
        out.json({"vbucket": args.vbucket, "entries": entries})
        return 0
    out.table(
        f"persisted failover log of vb {args.vbucket} (newest first)",
        ["#", "vb_uuid", "seqno"],
        [[e["index"], e["vb_uuid"], e["seqno"]] for e in entries],
        numeric=["#", "vb_uuid", "seqno"],
    )
    return 0


# ---------------------------------------------------------------------- dump


def _dump(store: OfflineStore, args: argparse.Namespace, out: Output) -> int:
    vb = args.vbucket
    store.check_vbucket(vb)
    with store.read() as snap:
        lo, hi = snap.seqno_range(vb)
        start = max(args.start, lo)
        end = hi if args.end is None else min(args.end, hi)
        if not out.json_mode:
            out.line(
                f"vb {vb}: stored seqnos {lo}..{hi}; showing {args.start}.."
                f"{'end' if args.end is None else args.end}"
            )
        rows = []
        shown = 0
        with out.progress(f"vb {vb}", max(end - start + 1, 0)) as bar:
            for it in snap.items(vb, args.start, args.end):
                bar.set_completed(it.seqno - start + 1)
                shown += 1
                if out.json_mode:
                    out.json_line(_item_doc(vb, it))
                else:
                    rows.append(
                        [
                            it.seqno,
                            _op_name(it.op),
                            preview(bytes(it.key), 0),
                            it.rev_seqno,
                            it.flags,
                            it.expiry,
                            preview(bytes(it.value), args.value_width)
                            if it.op == _MUTATION
                            else "-",
                        ]
                    )
                if args.limit and shown >= args.limit:
                    break
    if not out.json_mode:
        out.table(
            f"{shown} items",
            ["seqno", "op", "key", "rev", "flags", "expiry", "value"],
            rows,
            numeric=["seqno", "rev", "flags", "expiry"],
        )
    return 0


def _item_doc(vb: int, it: Any) -> dict[str, Any]:
    doc = {
        "vbucket": vb,
        "seqno": it.seqno,
        "op": _op_name(it.op),
        "key": it.key.decode("utf-8", "backslashreplace"),
        "rev_seqno": it.rev_seqno,
        "cas": it.cas,
        "flags": it.flags,
        "expiry": it.expiry,
        "datatype": it.datatype,
    }
    if it.op == _MUTATION:
        doc.update(value_doc(bytes(it.value)))
    else:
        doc["delete_time"] = it.delete_time
    return doc


# ---------------------------------------------------------------------- history


def _history(store: OfflineStore, args: argparse.Namespace, out: Output) -> int:
    vb = args.vbucket
    versions: dict[bytes, list[tuple[int, int, int, int]]] = {}
    with store.read() as snap:
        rec = snap.state(vb)
        for r in snap.records(vb):
            versions.setdefault(r.key, []).append((r.key_seqno, r.op, r.rev_seqno, r.cas))
    old: list[dict[str, Any]] = []
    for key, vs in versions.items():
        for (seqno, op, rev, cas), nxt in itertools.pairwise(vs):
            old.append(
                {
                    "seqno": seqno,
                    "key": key.decode("utf-8", "backslashreplace"),
                    "op": _op_name(op),
                    "rev_seqno": rev,
                    "cas": cas,
                    "superseded_by": nxt[0],
                    "newest_seqno": vs[-1][0],
                }
            )
    old.sort(key=lambda d: d["seqno"])
    if args.limit:
        old = old[: args.limit]
    doc = {
        "vbucket": vb,
        "history_start": rec.history_start if rec else None,
        "high_seqno": rec.high_seqno if rec else None,
        "superseded_versions": old,
    }
    if out.json_mode:
        out.json(doc)
        return 0
    out.line(
        f"vb {vb}: complete history from seqno {doc['history_start']} to "
        f"{doc['high_seqno']}; {len(old)} superseded versions kept"
    )
    if not old:
        return 0
    out.table(
        "superseded versions (oldest first)",
        ["seqno", "key", "op", "rev", "superseded by", "newest"],
        [
            [d["seqno"], d["key"], d["op"], d["rev_seqno"], d["superseded_by"], d["newest_seqno"]]
            for d in old
        ],
        numeric=["seqno", "rev", "superseded by", "newest"],
    )
    return 0


# ---------------------------------------------------------------------- check


def _check(store: OfflineStore, args: argparse.Namespace, out: Output) -> int:
    vbs = check_vbuckets(args.vb, store.num_vbuckets, "this data dir")
    with out.progress("checking", len(vbs)) as bar:
        report = check_store(store, vbs, bar)
    if out.json_mode:
        out.json(report)
    else:
        for note in report["notes"]:
            out.line(f"note: {note}")
        if report["problems"]:
            out.table(
                f"{len(report['problems'])} problems in {report['data_dir']}",
                ["vb", "problem"],
                [[p["vbucket"], p["problem"]] for p in report["problems"]],
                numeric=["vb"],
            )
        else:
            out.line(
                f"OK: {report['vbuckets_checked']} vbuckets, "
                f"{report['records_checked']} records, no problems"
            )
    if report["problems"]:
        first = report["problems"][0]
        raise CtlError(
            f"check failed: {len(report['problems'])} problems (first: vb "
            f"{first['vbucket']}: {first['problem']})"
        )
    return 0


_VIEWS = {
    "vbuckets": _vbuckets,
    "failover-log": _failover,
    "dump": _dump,
    "history": _history,
    "check": _check,
}


def cmd_inspect(args: argparse.Namespace, out: Output) -> int:
    view = _VIEWS[args.view or "vbuckets"]
    if not args.view:  # bare `inspect DIR`: the vbuckets view with its defaults
        args.vb, args.active = None, False
    with OfflineStore(args.data_dir) as store:
        return view(store, args, out)
