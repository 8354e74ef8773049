"""How ``dcpctl cluster`` prints: tables and lines for people, one JSON document for scripts,
and the rebalance progress bar.

Rules of this module:
- Every function takes the data ``cluster_view.py`` built and hands it to ``Output``: the
  same document is the JSON (``--json``) and the source of the tables, so the two never
  disagree.
- Vbucket sets are printed as compact ranges (``0-3,9``); a thousand vbuckets stay one
  line.
- The progress bar is drawn only on a terminal (``Output.show_progress``); piped, a
  rebalance prints one line when its count or message changes, at most one a second for
  counts, so a log of a long rebalance stays readable.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from .args import ranges_text
from .cluster_view import ClusterView, chain_groups, lag_report, map_doc, node_rows
from .output import CtlError, Output

__all__ = ["RebalanceProgress", "print_lag", "print_map", "print_nodes"]


def _why(part: dict[str, Any]) -> str:
    return f" ({part['message']})" if part.get("message") else ""


def _status_lines(view: ClusterView, doc: dict[str, Any]) -> list[str]:
    lines = []
    if view.vbmap is None:
        lines.append("no map yet" + ("" if view.live else " (no node is up)"))
    else:
        lines.append(f"map revision {view.map_revision}")
    if view.orchestrator:
        lines[-1] += f"; orchestrator {view.orchestrator} (term {view.term})"
    else:
        lines[-1] += "; no orchestrator elected"
    if doc["unavailable"]:
        lines.append(f"unavailable vbuckets (no active copy): {doc['unavailable']}")
    af = doc["autofailover"]
    if af["count"]:
        names = ", ".join(map(str, af["failed_over"])) or "-"
        lines.append(
            f"auto-failover: {af['count']} of {af['max'] if af['max'] is not None else '?'} "
            f"used (failed over: {names}); 'dcpctl cluster reset-autofailover' re-arms it"
        )
    rb, fo = doc["rebalance"], doc["failover"]
    if rb.get("state") == "running":
        lines.append(f"rebalance running: {rb.get('done', 0)}/{rb.get('total', 0)} vbuckets moved")
    elif rb.get("state") in ("done", "failed"):
        lines.append(f"last rebalance: {rb['state']}" + _why(rb))
    if fo.get("state") == "running":
        lines.append(f"failover of {fo.get('node')} running: {fo.get('message', '')}")
    elif fo.get("state") in ("done", "failed", "refused"):
        auto = "automatic " if fo.get("auto") else ""
        lines.append(f"last {auto}failover of {fo.get('node')}: {fo['state']}" + _why(fo))
    for rel, req in sorted(view.requests.items()):
        lines.append(f"pending request: {rel.partition('/')[2]} (id {req.get('id')})")
    lines.extend(f"warning: {p}" for p in view.problems)
    return lines


def print_nodes(out: Output, view: ClusterView, now: float) -> None:
    rows = node_rows(view, now)
    unavailable = view.vbmap.unavailable() if view.vbmap is not None else []
    af_status = view.status_part("autofailover")
    doc = {
        "cluster": view.name,
        "cluster_id": (view.meta or {}).get("cluster_id"),
        "num_vbuckets": (view.meta or {}).get("num_vbuckets"),
        "map_revision": view.map_revision or None,
        "orchestrator": view.orchestrator,
        "term": view.term or None,
        "nodes": rows,
        "unavailable": ranges_text(unavailable),
        "autofailover": {
            "count": int(view.autofailover.get("count", 0) or 0),
            "failed_over": list(view.autofailover.get("failed_over", []) or []),
            "max": af_status.get("max"),
        },
        "rebalance": view.status_part("rebalance"),
        "failover": view.status_part("failover"),
        "pending_requests": sorted(view.requests),
        "problems": view.problems,
    }
    if out.json_mode:
        out.json(doc)
        return
    up = sum(1 for r in rows if r["state"] == "up")
    table = [
        (
            r["node"],
            r["address"],
            r["state"] + ("" if r["member"] else " (not a member)"),
            r["actives"],
            r["replicas"],
            "*" if r["orchestrator"] else "",
            f"{r['down_for']:g} s" if r["down_for"] is not None else None,
        )
        for r in rows
    ]
    out.table(
        f"cluster {view.name}: {len(rows)} nodes, {up} up",
        ["node", "address", "state", "actives", "replicas", "orchestrator", "down for"],
        table,
        numeric=("actives", "replicas", "down for"),
    )
    for line in _status_lines(view, doc):
        out.line(line)


def print_map(out: Output, view: ClusterView, *, chains: bool = False) -> None:
    if view.vbmap is None:
        bad = [p for p in view.problems if p.startswith("map")]
        if bad:
            raise CtlError(f"cluster {view.name}: unreadable {bad[0]}")
        if out.json_mode:
            out.json({"cluster": view.name, "map": None})
        else:
            out.line(f"cluster {view.name} has no map yet (the orchestrator writes the first)")
        return
    doc = map_doc(view)
    if chains:
        doc["chains"] = chain_groups([view.vbmap.names(vb) for vb in range(doc["num_vbuckets"])])
    if out.json_mode:
        out.json(doc)
        return
    moving = bool(doc["moving_count"])
    cols = ["node", "state", "actives", "replicas"]
    if moving:
        cols += ["actives_after", "replicas_after"]
    out.table(
        f"map of cluster {view.name}: revision {doc['revision']}, {doc['num_vbuckets']} "
        f"vbuckets, {doc['num_replicas']} replica(s)",
        [c.replace("_", " ") for c in cols],
        [[n.get(c) for c in cols] for n in doc["nodes"]],
        numeric=("actives", "replicas", "actives after", "replicas after"),
    )
    if doc["unavailable_count"]:
        out.line(
            f"unavailable (no active copy): {doc['unavailable_count']} vbuckets: "
            f"{doc['unavailable']}"
        )
    else:
        out.line("unavailable: none")
    if moving:
        out.line(f"moving: {doc['moving_count']} vbuckets: {doc['moving']}")
        out.table(
            "moves (chain now -> chain after)",
            ["from", "to", "count", "vbuckets"],
            [(m["from"], m["to"], m["count"], m["vbuckets"]) for m in doc["moves"]],
            numeric=("count",),
        )
    if chains:
        out.table(
            "chains (active,replica...)",
            ["chain", "count", "vbuckets"],
            [(g["chain"], g["count"], g["vbuckets"]) for g in doc["chains"]],
            numeric=("count",),
        )


def print_lag(
    out: Output,
    view: ClusterView,
    answers: dict[str, tuple[list[Any] | None, list[Any]] | str],
    *,
    top: int,
) -> None:
    rep = lag_report(view, answers)
    if out.json_mode:
        out.json(rep)
        return
    cols = ["node", "state", "replicas", "caught_up", "behind", "not_replicating", "max_lag"]
    cols.append("total_lag")
    out.table(
        f"replication lag in cluster {view.name} (seqnos behind the source)",
        [c.replace("_", " ") for c in cols],
        [[n.get(c) for c in cols] for n in rep["nodes"]],
        numeric=tuple(c.replace("_", " ") for c in cols[2:]),
    )
    for n in rep["nodes"]:
        if n["error"]:
            out.line(f"{n['node']}: {n['error']}")
    bad = [c for c in rep["copies"] if c["lag"] is None or c["lag"] > 0]
    if not bad:
        if rep["copies"]:
            out.line(f"all {len(rep['copies'])} replica copies are caught up")
        else:
            out.line("no replica copies reported")
        return
    shown = bad[:top] if top else bad
    out.table(
        "copies behind (worst first)",
        ["vb", "node", "source", "lag", "stream", "measured"],
        [(c["vb"], c["node"], c["source"], c["lag"], c["stream"], c["measured"]) for c in shown],
        numeric=("vb", "lag"),
    )
    if len(bad) > len(shown):
        out.line(f"... and {len(bad) - len(shown)} more (--top 0 shows all)")


class RebalanceProgress:
    """Called with each new ``status.rebalance`` of the request followed; draws a bar on
    a terminal, prints progress lines when piped, stays quiet in JSON mode."""

    def __init__(self, out: Output) -> None:
        self.out = out
        self._progress: Progress | None = None
        self._task: Any = None
        self._last: tuple[Any, Any] | None = None
        self._last_line = 0.0

    def __enter__(self) -> RebalanceProgress:
        if self.out.show_progress:
            self._progress = Progress(
                TextColumn("[bold]rebalance"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("vbuckets"),
                TaskProgressColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[message]}", markup=False),
                console=self.out.console,
                transient=True,
            )
            self._task = self._progress.add_task("rebalance", total=None, message="waiting")
            self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()

    def __call__(self, part: dict[str, Any]) -> None:
        total, done = part.get("total"), part.get("done")
        message = str(part.get("message") or "")
        if self._progress is not None:
            self._progress.update(
                self._task,
                total=total if isinstance(total, int) and total > 0 else None,
                completed=done if isinstance(done, int) else 0,
                message=message,
            )
            return
        if self.out.json_mode or part.get("state") in ("done", "failed"):
            return
        now = time.monotonic()
        if self._last is not None and message == self._last[1]:
            if done == self._last[0] or now - self._last_line < 1.0:
                return
        self._last, self._last_line = (done, message), now
        count = f"{done}/{total} vbuckets" if isinstance(total, int) else "waiting"
        self.out.line(f"rebalance: {count}" + (f" ({message})" if message else ""))

    @staticmethod
    def summary(final: dict[str, Any]) -> str:
        took = ""
        started, finished = final.get("started"), final.get("finished")
        if isinstance(started, int | float) and isinstance(finished, int | float):
            took = f" in {finished - started:.1f} s"
        message = final.get("message")
        return (
            f"rebalance done: {final.get('done', 0)}/{final.get('total', 0)} vbuckets moved{took}"
            + (f" ({message})" if message else "")
        )
