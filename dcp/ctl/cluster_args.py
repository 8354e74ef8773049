"""The ``dcpctl cluster`` command line: its options and actions.

Rules of this module:
- Only argparse; nothing heavy imported (every dcpctl command builds the whole parser).
  The actions run in ``cluster_cmd.py``, loaded when one runs.
- ``--etcd`` (env DCP_CLUSTER, default http://127.0.0.1:2379) and ``--cluster-name`` (env
  DCP_CLUSTER_NAME, default ``default``) are accepted before or after the action, as the
  common options are (a flag given after the action wins).
- ``lag`` connects to the nodes, so it takes the credential and TLS flags of ``access.py``
  (``make_command(..., live=True)``); the other actions talk to etcd only.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

__all__ = ["DEFAULT_ETCD", "add_cluster_parser"]

DEFAULT_ETCD = "http://127.0.0.1:2379"
_S = argparse.SUPPRESS


def _options(p: argparse.ArgumentParser, top: bool, timeout: bool) -> None:
    p.add_argument(
        "--etcd",
        default=os.environ.get("DCP_CLUSTER") or DEFAULT_ETCD if top else _S,
        metavar="URL",
        help=f"the cluster's etcd (env DCP_CLUSTER, default {DEFAULT_ETCD})",
    )
    p.add_argument(
        "--cluster-name",
        default=os.environ.get("DCP_CLUSTER_NAME") or "default" if top else _S,
        metavar="NAME",
        help="the nodes' --cluster-name (env DCP_CLUSTER_NAME, default 'default')",
    )
    if timeout:
        p.add_argument(
            "--timeout",
            type=float,
            default=_S,
            help="seconds etcd (or a node) may take to answer one request (default 10)",
        )


def _waits(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--wait-timeout",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="give up waiting for the outcome after this long (default: wait until it comes)",
    )


def add_cluster_parser(sub: Any, make_command: Callable[..., argparse.ArgumentParser]) -> None:
    """Register ``cluster`` and its actions on dcpctl's subparsers (``make_command``: the
    cli's ``_command``, which adds the output and, for live actions, connection flags)."""
    help_ = "a cluster on etcd: nodes, the vbucket map, rebalance, failover, lag"
    p = sub.add_parser("cluster", help=help_, description=help_)
    _options(p, True, True)
    actions = p.add_subparsers(dest="cluster_command", required=True, metavar="ACTION")

    def action(name: str, fn: str, text: str, live: bool = False) -> argparse.ArgumentParser:
        a: argparse.ArgumentParser = make_command(actions, name, f"cluster_cmd:{fn}", text, live)
        _options(a, False, not live)
        return a

    action("nodes", "cmd_cluster_nodes", "nodes: address, up/down, copies held, orchestrator")
    a = action("map", "cmd_cluster_map", "the vbucket map: per node counts, unavailable, moving")
    a.add_argument(
        "--chains", action="store_true", help="also every vbucket's chain, grouped compactly"
    )
    a = action(
        "rebalance",
        "cmd_cluster_rebalance",
        "ask the orchestrator to rebalance (optionally ejecting nodes) and follow its progress",
    )
    a.add_argument(
        "--eject", nargs="+", default=[], metavar="NODE", help="remove these nodes from the map"
    )
    a.add_argument("--no-wait", action="store_true", help="return once the request is written")
    _waits(a)
    a = action(
        "failover",
        "cmd_cluster_failover",
        "fail a node over: hard (promote its replicas now) or --graceful (hand over first)",
    )
    a.add_argument("node", metavar="NODE")
    a.add_argument(
        "--graceful", action="store_true", help="the node is up: take its actives over first"
    )
    _waits(a)
    action(
        "reset-autofailover",
        "cmd_cluster_reset_autofailover",
        "set the automatic failover count back to 0 (re-arms automatic failover)",
    )
    a = action("lag", "cmd_cluster_lag", "replication lag of every replica copy", live=True)
    a.add_argument(
        "--top", type=int, default=20, help="copies behind to list, worst first (0: all)"
    )
