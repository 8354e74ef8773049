"""``dcpctl tail``: a live, readable feed of snapshot markers and changes.

Rules of this module:
- Built on the SDK's raw mode (``DcpClient(raw=True)``): events are shown as they
  arrive, partial snapshots included, nothing is committed or saved.
- It starts with one discovery round trip (``Remote``): unknown vbuckets and an
  unreachable server fail fast with one line, and ``--to-latest`` knows how far it must
  go (the progress bar's total, on a terminal only).
- In a cluster (``topology.discover``) the high seqnos are the active ones of every node
  (GET_ALL_VB_SEQNOS for state active, all nodes at once) and ``DcpClient`` gets the
  bootstrap list: it streams each vbucket from the node that holds it and follows the
  map through failovers and rebalances. A node that does not answer at the start is a
  warning; its vbuckets are still streamed (no progress bar then: their end is unknown).
- ``--stable-only`` asks for a stable-only stream (``DcpClient(stable_only=True)``): a
  snapshot is shown once no single node failure can roll it back; a server that does
  not know the control refuses the stream with one line.
- Runs until Ctrl-C, ``--limit`` changes, or (``--to-latest``) every vbucket reached
  the high seqno it had at the start. Table mode prints one line per event; ``--json``
  prints JSON Lines.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..consumer import (
    DcpClient,
    DcpClientError,
    Deletion,
    Expiration,
    Mutation,
    RollbackEvent,
    SnapshotMarker,
    StartFrom,
    StatusError,
    StreamEnd,
)
from ..protocol import SnapshotMarkerFlag, StreamEndStatus, VBucketState
from ..protocol.cluster_config import format_address
from .access import sdk_options
from .args import check_vbuckets
from .output import CtlError, Output, preview, value_doc
from .remote import Remote
from .topology import Topology, discover, each_node, warn

__all__ = ["cmd_tail", "event_doc", "snapshot_flags"]

_OK = int(StreamEndStatus.OK)


def snapshot_flags(flags: int) -> list[str]:
    return [
        f.name.lower()
        for f in SnapshotMarkerFlag
        if f.value and flags & f.value and f.name is not None
    ]


def _end_reason(reason: int) -> str:
    try:
        return StreamEndStatus(reason).name.lower()
    except ValueError:
        return f"0x{reason:02x}"


def event_doc(ev: Any) -> dict[str, Any]:
    """One raw-mode event as a JSON Lines record."""
    t = type(ev)
    if t is SnapshotMarker:
        return {
            "type": "snapshot",
            "vbucket": ev.vbucket,
            "start": ev.start,
            "end": ev.end,
            "flags": snapshot_flags(ev.flags),
        }
    if t is Mutation:
        return {
            "type": "mutation",
            "vbucket": ev.vbucket,
            "seqno": ev.seqno,
            "key": ev.key.decode("utf-8", "backslashreplace"),
            **value_doc(bytes(ev.value)),
            "rev_seqno": ev.rev_seqno,
            "cas": ev.cas,
            "flags": ev.flags,
            "expiry": ev.expiry,
            "datatype": ev.datatype,
        }
    if t is Deletion or t is Expiration:
        return {
            "type": ev.kind,
            "vbucket": ev.vbucket,
            "seqno": ev.seqno,
            "key": ev.key.decode("utf-8", "backslashreplace"),
            "rev_seqno": ev.rev_seqno,
            "cas": ev.cas,
        }
    if t is StreamEnd:
        return {"type": "stream_end", "vbucket": ev.vbucket, "reason": _end_reason(ev.reason)}
    if t is RollbackEvent:
        return {"type": "rollback", "vbucket": ev.vbucket, "rollback_seqno": ev.rollback_seqno}
    return {"type": getattr(ev, "kind", t.__name__)}


def _event_line(ev: Any, width: int) -> str:
    t = type(ev)
    vb = f"vb {ev.vbucket:<4}"
    if t is SnapshotMarker:
        return f"{vb} snapshot {ev.start}..{ev.end} [{', '.join(snapshot_flags(ev.flags))}]"
    if t is Mutation:
        return (
            f"{vb}   #{ev.seqno:<8} mutation    {preview(bytes(ev.key), 0)} = "
            f"{preview(bytes(ev.value), width)}"
        )
    if t is Deletion or t is Expiration:
        return f"{vb}   #{ev.seqno:<8} {ev.kind:<11} {preview(bytes(ev.key), 0)}"
    if t is StreamEnd:
        return f"{vb} stream end ({_end_reason(ev.reason)})"
    if t is RollbackEvent:
        return f"{vb} rollback to seqno {ev.rollback_seqno}"
    return f"{vb} {ev!r}"


def _progress(bar: Any, last: dict[int, int], vb: int, seqno: int) -> None:
    """Seqnos covered so far: what the progress bar counts (deduplicated ones too)."""
    if seqno > last[vb]:
        bar.advance(seqno - last[vb])
        last[vb] = seqno


async def _cluster_highs(args: argparse.Namespace, topo: Topology) -> tuple[int, dict[int, int]]:
    """The map's vbucket count and the high seqno of each active vbucket, from every node
    at once; a node that does not answer is a warning (the SDK streams its vbuckets once
    the map moves them), not a failure."""
    answers = await each_node(args, topo, lambda r: r.all_vb_seqnos(VBucketState.ACTIVE))
    highs: dict[int, int] = {}
    for got in answers.results.values():
        highs.update(got)
    for addr, err in answers.errors.items():
        warn(f"{topo.label(addr)} unreachable: {err}; its vbuckets follow when the map moves them")
    cfg = topo.config
    if cfg is None:
        return max(highs, default=-1) + 1, highs
    for vb in range(cfg.num_vbuckets):  # actives on a node that did not answer
        if vb not in highs and cfg.active(vb) in answers.errors:
            highs[vb] = -1
    return cfg.num_vbuckets, highs


async def cmd_tail(args: argparse.Namespace, out: Output) -> int:
    topo = await discover(args)
    host: Any = args.host
    if topo.cluster:  # the SDK follows the whole cluster from the bootstrap list
        count, highs = await _cluster_highs(args, topo)
        host, where = args.bootstrap, ",".join(format_address(a) for a in args.bootstrap)
    else:
        async with Remote.of(args) as r:
            count = await r.num_vbuckets()
            highs = await r.all_vb_seqnos()
        where = f"{args.host}:{args.port}"
    vbs = check_vbuckets(args.vb, count)
    vbs = [vb for vb in vbs if vb in highs] if args.vb is None else vbs
    dead = [vb for vb in vbs if vb not in highs]
    if dead:
        raise CtlError(f"vbucket {dead[0]} is dead: there is nothing to stream")
    if not vbs:
        raise CtlError("every vbucket is dead: there is nothing to stream")
    start = StartFrom(args.start)
    total = (
        sum(highs[vb] for vb in vbs)
        if args.to_latest and start is StartFrom.BEGINNING and min(highs[vb] for vb in vbs) >= 0
        else None
    )
    client = DcpClient(
        host,
        args.port,
        vbuckets=vbs,
        start=start,
        to_latest=args.to_latest,
        raw=True,
        include_expirations=True,
        stable_only=args.stable_only,
        name=f"dcpctl-tail-{os.getpid()}",
        connect_timeout=args.timeout,
        retry_timeout=args.timeout,
        **sdk_options(args),
    )
    last = dict.fromkeys(vbs, 0)
    counts = {"snapshots": 0, "mutations": 0, "deletions": 0, "expirations": 0}
    changes = 0
    try:
        with out.progress("streaming", total) as bar:
            async with client:
                async for ev in client:
                    if out.json_mode:
                        out.json_line(event_doc(ev))
                    else:
                        out.line(_event_line(ev, args.value_width))
                    if isinstance(ev, SnapshotMarker):
                        counts["snapshots"] += 1
                    elif isinstance(ev, (Mutation, Deletion, Expiration)):
                        counts[ev.kind + "s"] += 1
                        changes += 1
                        if total is not None:
                            _progress(bar, last, ev.vbucket, min(ev.seqno, highs[ev.vbucket]))
                        if args.limit and changes >= args.limit:
                            break
                    elif isinstance(ev, StreamEnd) and total is not None and ev.reason == _OK:
                        _progress(bar, last, ev.vbucket, highs[ev.vbucket])
    except (DcpClientError, StatusError) as exc:
        raise CtlError(f"streaming from {where} failed: {exc}") from None
    if not out.json_mode and (args.to_latest or args.limit):
        out.line(
            f"-- {counts['mutations']} mutations, {counts['deletions']} deletions, "
            f"{counts['expirations']} expirations in {counts['snapshots']} snapshots "
            f"from {len(vbs)} vbuckets"
        )
    return 0
