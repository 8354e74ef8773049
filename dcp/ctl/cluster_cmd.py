"""``dcpctl cluster nodes | map | rebalance | failover | reset-autofailover | lag``.

Rules of this module:
- A cluster is read from etcd (``--etcd``, env DCP_CLUSTER) under ``/dcp/<--cluster-name>/``
  with ``dcp.producer.cluster.store.EtcdStore`` (its blocking calls run in threads, under
  its own deadline); the views are built by ``cluster_view.py`` from one range read, so a
  table never mixes two moments of the cluster.
- dcpctl decides nothing: it writes *requests* (``requests/rebalance``,
  ``requests/failover``) that the orchestrator takes, and follows the orchestrator's
  ``status`` key for the outcome of its own request (matched by the fresh id it wrote).
  A request is written create-only, so a second one while the first is pending is
  refused instead of replacing it. The only other write is ``reset-autofailover``
  (deletes ``autofailover``, only if unchanged since it was read).
- Waiting (``rebalance`` without ``--no-wait``, ``failover``) survives etcd blinking:
  reads that fail are retried until etcd has been silent for ``ETCD_PATIENCE`` seconds
  (or ``--timeout`` when longer). ``--wait-timeout`` bounds the whole wait.
- ``lag`` asks every live node for STAT ``replication`` and ``vbucket-seqno`` at once
  (``Remote``, with the command's credentials and TLS); a node that does not answer is
  reported, never fatal.
- Every failure is one line (``CtlError``): etcd not answering, no such cluster, an
  unknown node, a request already pending, a refused or failed outcome (exit 1).
"""

from __future__ import annotations

import argparse
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from ..producer.cluster.membership import cluster_prefix
from ..producer.cluster.store import EtcdStore, StoreUnavailable
from .args import split_address
from .cluster_show import RebalanceProgress, print_lag, print_map, print_nodes
from .cluster_view import REQUEST_FAILOVER, REQUEST_REBALANCE, ClusterView, parse_view
from .output import CtlError, Output
from .remote import Remote

__all__ = [
    "cmd_cluster_failover",
    "cmd_cluster_lag",
    "cmd_cluster_map",
    "cmd_cluster_nodes",
    "cmd_cluster_rebalance",
    "cmd_cluster_reset_autofailover",
]

#: Seconds of etcd silence a wait tolerates before giving up (an etcd restart is shorter).
ETCD_PATIENCE = 15.0
POLL = 0.25
#: After this long with its request still untaken, a wait says no orchestrator took it.
UNTAKEN_HINT = 5.0


def _unavailable(url: str, exc: StoreUnavailable) -> CtlError:
    """etcd3gw's error text is a urllib3 paragraph: keep the reason people can act on."""
    text = str(exc)
    m = re.search(r"\[Errno -?\d+\] ([^\"')]+)", text)
    reason = m.group(1).strip().lower() if m else ("timed out" if "time" in text else text)
    return CtlError(f"etcd at {url} does not answer: {reason} (--etcd URL or env DCP_CLUSTER)")


@asynccontextmanager
async def _etcd(args: argparse.Namespace) -> AsyncIterator[EtcdStore]:
    try:
        store = EtcdStore(args.etcd, timeout=min(max(args.timeout, 0.5), 10.0))
    except ValueError as exc:
        raise CtlError(f"--etcd: {exc}", code=2) from None
    try:
        yield store
    except StoreUnavailable as exc:
        raise _unavailable(args.etcd, exc) from None
    finally:
        await store.aclose()


def _key(args: argparse.Namespace, rel: str) -> str:
    return cluster_prefix(args.cluster_name) + rel


async def _view(store: EtcdStore, args: argparse.Namespace) -> ClusterView:
    snap = await store.get_prefix(cluster_prefix(args.cluster_name))
    view = parse_view(args.cluster_name, snap)
    if view.meta is None:
        raise CtlError(
            f"no cluster {args.cluster_name!r} in etcd at {args.etcd} "
            f"(no {cluster_prefix(args.cluster_name)}meta; --cluster-name?)"
        )
    return view


def _known(view: ClusterView, name: str) -> None:
    if name not in view.nodes():
        raise CtlError(
            f"unknown node {name!r} in cluster {view.name} "
            f"(nodes: {', '.join(view.nodes()) or 'none'})"
        )


# ---------------------------------------------------------------------- reading


async def cmd_cluster_nodes(args: argparse.Namespace, out: Output) -> int:
    async with _etcd(args) as store:
        view = await _view(store, args)
    print_nodes(out, view, time.time())
    return 0


async def cmd_cluster_map(args: argparse.Namespace, out: Output) -> int:
    async with _etcd(args) as store:
        view = await _view(store, args)
    print_map(out, view, chains=args.chains)
    return 0


async def _node_stats(
    args: argparse.Namespace, address: str
) -> tuple[list[Any] | None, list[Any]] | str:
    try:
        host, port = split_address(address)
        async with Remote.of(args, host, port) as r:
            repl, seqnos = await r.stats("replication", "vbucket-seqno", optional=("replication",))
    except ValueError as exc:
        return str(exc)
    except CtlError as exc:
        return str(exc)
    return repl, seqnos


async def cmd_cluster_lag(args: argparse.Namespace, out: Output) -> int:
    async with _etcd(args) as store:
        view = await _view(store, args)
    answers: dict[str, tuple[list[Any] | None, list[Any]] | str] = {}

    async def ask(node: str, address: str | None) -> None:
        answers[node] = await _node_stats(args, address) if address else "no address"

    async with trio.open_nursery() as nursery:
        for node, address in sorted(view.live.items()):
            nursery.start_soon(ask, node, address)
    print_lag(out, view, answers, top=args.top)
    return 0


# ---------------------------------------------------------------------- requests


async def _request(store: EtcdStore, args: argparse.Namespace, rel: str, doc: dict) -> None:
    """Write request ``rel`` create-only; refuse when one is pending already."""
    got = await store.compare_and_put(_key(args, rel), json.dumps(doc).encode(), mod_revision=0)
    if got is None:
        pending = await store.get(_key(args, rel))
        detail = ""
        if pending is not None:
            try:
                detail = f" (id {json.loads(pending.value).get('id')})"
            except (ValueError, AttributeError):
                detail = ""
        what = rel.rpartition("/")[2]
        raise CtlError(
            f"a {what} request is already pending{detail}: the orchestrator has not taken it "
            f"yet; wait for it (dcpctl cluster nodes shows the status) or delete "
            f"{_key(args, rel)} in etcd"
        )


async def _wait_for(
    store: EtcdStore, args: argparse.Namespace, rel: str, part: str, rid: str, on_status: Any
) -> dict[str, Any]:
    """Follow ``status`` until ``status[part]`` is about request ``rid`` and finished;
    ``on_status(doc)`` is called with every new view of that part meanwhile."""
    patience = max(ETCD_PATIENCE, args.timeout)
    started = last_answer = trio.current_time()
    hinted = False
    finished = {"rebalance": ("done", "failed"), "failover": ("done", "failed", "refused")}[part]
    deadline = trio.current_time() + args.wait_timeout if args.wait_timeout else float("inf")
    while True:
        if trio.current_time() > deadline:
            raise CtlError(
                f"no outcome within {args.wait_timeout:g} s; the request may still be pending "
                f"({_key(args, rel)}); dcpctl cluster nodes shows the status"
            )
        try:
            status = await store.get(_key(args, "status"))
            pending = await store.get(_key(args, rel))
        except StoreUnavailable as exc:
            if trio.current_time() - last_answer > patience:
                raise _unavailable(args.etcd, exc) from None
            await trio.sleep(POLL)
            continue
        last_answer = trio.current_time()
        try:
            doc = json.loads(status.value) if status is not None else {}
        except ValueError:  # a torn or foreign value: the next poll reads it again
            doc = {}
        mine = doc.get(part) if isinstance(doc, dict) else None
        if isinstance(mine, dict) and mine.get("id") == rid:
            on_status(mine)
            if mine.get("state") in finished:
                return mine
        elif (
            not hinted
            and pending is not None
            and trio.current_time() - started > UNTAKEN_HINT
            and rid in pending.value.decode("utf-8", "replace")
        ):
            hinted = True
            on_status({"message": "no orchestrator has taken the request yet (is a node up?)"})
        await trio.sleep(POLL)


async def cmd_cluster_rebalance(args: argparse.Namespace, out: Output) -> int:
    rid = uuid.uuid4().hex
    async with _etcd(args) as store:
        view = await _view(store, args)
        for name in args.eject:
            _known(view, name)
            if name not in view.members:  # the orchestrator ejects members only
                raise CtlError(f"{name} is not a member of cluster {view.name} (already ejected?)")
        if view.members and set(view.members) <= set(args.eject):
            raise CtlError("cannot eject every node of the cluster")
        await _request(store, args, REQUEST_REBALANCE, {"id": rid, "eject": list(args.eject)})
        ejecting = f", ejecting {', '.join(args.eject)}" if args.eject else ""
        if args.no_wait:
            if out.json_mode:
                out.json({"id": rid, "eject": list(args.eject), "state": "requested"})
            else:
                out.line(f"rebalance requested (id {rid}{ejecting})")
            return 0
        if not out.json_mode:
            out.line(f"rebalance requested (id {rid}{ejecting}); following its progress")
        with RebalanceProgress(out) as progress:
            final = await _wait_for(store, args, REQUEST_REBALANCE, "rebalance", rid, progress)
    if out.json_mode:
        out.json(final)
        return 0 if final.get("state") == "done" else 1
    if final.get("state") != "done":
        raise CtlError(f"rebalance failed: {final.get('message') or 'no reason given'}")
    out.line(RebalanceProgress.summary(final))
    return 0


async def cmd_cluster_failover(args: argparse.Namespace, out: Output) -> int:
    rid = uuid.uuid4().hex
    kind = "graceful" if args.graceful else "hard"
    async with _etcd(args) as store:
        view = await _view(store, args)
        _known(view, args.node)
        if args.graceful and args.node not in view.live:
            raise CtlError(
                f"a graceful failover needs {args.node} up (it is down): "
                f"use a hard failover (without --graceful)"
            )
        doc = {"id": rid, "node": args.node, "graceful": bool(args.graceful)}
        await _request(store, args, REQUEST_FAILOVER, doc)
        if not out.json_mode:
            out.line(f"{kind} failover of {args.node} requested (id {rid}); waiting for it")
        shown: list[str] = []

        def on_status(part: dict[str, Any]) -> None:
            msg = part.get("message")
            if msg and not out.json_mode and (not shown or shown[-1] != msg):
                shown.append(msg)
                if part.get("state") not in ("done", "failed", "refused"):
                    out.line(f"  {msg}")

        final = await _wait_for(store, args, REQUEST_FAILOVER, "failover", rid, on_status)
    if out.json_mode:
        out.json(final)
        return 0 if final.get("state") == "done" else 1
    message = final.get("message") or ""
    if final.get("state") != "done":
        raise CtlError(f"{kind} failover of {args.node} {final.get('state')}: {message}")
    out.line(f"{kind} failover of {args.node} done" + (f": {message}" if message else ""))
    return 0


async def cmd_cluster_reset_autofailover(args: argparse.Namespace, out: Output) -> int:
    key = _key(args, "autofailover")
    async with _etcd(args) as store:
        await _view(store, args)
        for _ in range(10):  # the orchestrator may count a failover meanwhile: read again
            got = await store.get(key)
            if got is None:
                before: dict[str, Any] = {}
                break
            try:
                before = json.loads(got.value)
            except ValueError:
                before = {}
            if await store.delete(key, mod_revision=got.mod_revision):
                break
        else:
            raise CtlError(f"{key} keeps changing; try again")
    doc = {
        "count_before": before.get("count", 0) if isinstance(before, dict) else 0,
        "failed_over": before.get("failed_over", []) if isinstance(before, dict) else [],
        "count": 0,
    }
    if out.json_mode:
        out.json(doc)
    elif not doc["count_before"]:
        out.line("auto-failover count is already 0")
    else:
        names = ", ".join(map(str, doc["failed_over"])) or "-"
        out.line(
            f"auto-failover count reset to 0 (was {doc['count_before']}; failed over: {names})"
        )
    return 0
