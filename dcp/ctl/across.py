"""``dcpctl vbuckets`` across the nodes of a cluster: every copy of every vbucket.

Rules of this module:
- The nodes are the map's (``topology.discover``); each is asked the same pipelined STAT
  groups as a single node (``live.vbucket_groups``), all at once, each within
  ``--timeout``. A row is one copy: a vbucket on a node that holds it (state other than
  dead), with a ``node`` column; rows are ordered by vbucket, the active copy first.
- A replica's source is one of the nodes already asked, so its high seqnos come from
  that answer; only a source outside the map is asked separately (``replicas.py``). A
  source that did not answer is unreachable there too (not asked twice).
- A node that does not answer is a line ``<node> unreachable: <error>`` after the table
  (``unreachable`` in JSON) and exit status 3; the map's actives on it are listed, so
  one sees which vbuckets have no copy shown.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..protocol.cluster_config import format_address
from .args import check_vbuckets, ranges_text
from .live import (
    print_vbuckets,
    replica_sources,
    seqno_highs,
    vbucket_groups,
    vbucket_rows,
    vbucket_totals,
)
from .output import Output
from .replicas import source_high_seqnos
from .topology import Topology, each_node, finish

__all__ = ["vbuckets_across"]


async def vbuckets_across(args: argparse.Namespace, out: Output, topo: Topology) -> int:
    answers = await each_node(args, topo, vbucket_groups)
    count = topo.num_vbuckets
    if count is None:  # no map: the nodes' own vbucket counts
        count = max(len(g[0]) for g in answers.results.values())
    vbs = check_vbuckets(args.vb, count, "the cluster")
    highs: dict[str, dict[int, int] | None] = {
        format_address(a): seqno_highs(g) for a, g in answers.results.items()
    }
    highs.update({format_address(a): None for a in answers.errors})
    sources: set[str] = set()
    for groups in answers.results.values():
        sources |= replica_sources(groups, vbs)
    others = sources - set(highs)
    if others:
        highs.update(
            await source_high_seqnos(others, args.timeout, getattr(args, "security", None))
        )
    rows: list[dict[str, Any]] = []
    for addr, groups in answers.results.items():
        node = topo.node_doc(addr)
        rows += [
            {**node, **row} for row in vbucket_rows(groups, vbs, args.active, highs, skip_dead=True)
        ]
    rows.sort(key=lambda r: (r["vbucket"], r["state"] != "active", r["node"]))
    totals = {**vbucket_totals(rows), "nodes": len(answers.results)}
    cfg = topo.config
    missing = {}
    for addr in answers.errors:
        if cfg is not None:
            missing[addr] = [vb for vb in vbs if cfg.active(vb) == addr]
    if out.json_mode:
        unreachable = [
            {**doc, "actives_in_map": missing.get(a)}
            for a, doc in zip(answers.errors, answers.unreachable_docs(topo), strict=True)
        ]
        out.json(
            {
                "map_rev": cfg.rev if cfg is not None else None,
                "vbuckets": rows,
                "totals": totals,
                "unreachable": unreachable,
            }
        )
        return finish(answers, topo)
    rev = f", map rev {cfg.rev}" if cfg is not None else ""
    print_vbuckets(
        out,
        f"{len(vbs)} vbuckets, {len(rows)} copies on {len(answers.results)} nodes{rev}",
        rows,
        totals,
        node_of=lambda r: r["node_name"] or r["node"],
    )
    for addr, err in answers.errors.items():
        held = missing.get(addr)
        also = f" (active in the map for vb {ranges_text(held)})" if held else ""
        out.line(f"{topo.label(addr)} unreachable: {err}{also}")
    return finish(answers, topo)
