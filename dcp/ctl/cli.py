"""``dcpctl``: inspect a running DCP server, or its data directory offline.

Rules of this module:
- Argument parsing and the error boundary only; each command lives in its own module
  (``live``, ``streams``, ``tail``, ``kv``, ``vbstate``, ``metrics``, ``map_cmd``,
  ``inspect_cmds``, ``users_cmd``, ``cluster_cmd`` with its options in ``cluster_args``;
  the cluster side of the live commands in ``topology`` and ``across``) and composes public
  APIs (the SDK, ``dcp.protocol``, the engine's record decoders, the server's users-file
  writer, the cluster's etcd store). A command's
  module is imported only when it runs (``"module:function"``), so ``inspect`` never
  loads trio or the SDK and every command starts faster.
- Common options (``--host``, ``--port``, ``--timeout``, the credential and TLS flags of
  ``access.py``, ``--json``, ``--no-progress``) are accepted before or after the command
  name. ``DCP_HOST`` / ``DCP_PORT`` / ``DCP_METRICS_PORT`` set their defaults. ``--host``
  may be a cluster's bootstrap list (``topology.normalize``); commands that act on one
  node (``set-state``, ``promote``, ``move``, ``metrics``) refuse a list.
- Exit status: 0 success, 1 failure (one line on stderr, never a traceback), 2 usage,
  3 partial output (a node of the cluster did not answer; the rest is shown),
  130 interrupted (Ctrl-C). An unexpected exception is still one line (exit 70);
  ``DCPCTL_DEBUG=1`` shows its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
import traceback
from typing import Any

from .access import add_options, resolve
from .args import DURABILITY_LEVELS, address, durability_name, vb_id, vb_list
from .cluster_args import add_cluster_parser
from .output import CtlError, Output

__all__ = ["main"]

_S = argparse.SUPPRESS


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def _output_options(p: argparse.ArgumentParser, top: bool) -> None:
    p.add_argument(
        "--json",
        action="store_true",
        default=False if top else _S,
        help="machine-readable output (JSON; JSON Lines for tail and dump)",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        default=False if top else _S,
        help="never draw a progress bar",
    )


def _server_options(p: argparse.ArgumentParser, top: bool) -> None:
    p.add_argument(
        "--host",
        default=os.environ.get("DCP_HOST", "127.0.0.1") if top else _S,
        help="server address, or a cluster's nodes: HOST[:PORT][,HOST[:PORT]...] "
        "(default 127.0.0.1, env DCP_HOST)",
    )
    p.add_argument(
        "--port",
        type=int,
        default=_env_int("DCP_PORT", 11210) if top else _S,
        help="server port (default 11210, env DCP_PORT)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=10.0 if top else _S,
        help="seconds to connect and get an answer (default 10)",
    )
    add_options(p, top)


def _command(
    sub: Any, name: str, fn: str, help_: str, live: bool = True, mcbp: bool | None = None
) -> argparse.ArgumentParser:
    """A command; ``mcbp``: it connects to the server's port (default: when ``live``),
    so its credentials and TLS settings are resolved first (``access.resolve``)."""
    p = sub.add_parser(name, help=help_, description=help_)
    if live:
        _server_options(p, False)
    _output_options(p, False)
    p.set_defaults(func=fn, mcbp=live if mcbp is None else mcbp, live=live)
    return p


_INSPECT = "inspect_cmds:cmd_inspect"


def _node_option(p: argparse.ArgumentParser, help_: str) -> None:
    p.add_argument("--node", metavar="NAME|HOST:PORT", help=help_)


def _durability(p: argparse.ArgumentParser) -> None:
    """``set``/``delete``: the level the answer waits for (docs/sdk.md has the table)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--durability",
        type=durability_name,
        choices=DURABILITY_LEVELS,
        metavar="LEVEL",
        help=f"answer once the write is durable at LEVEL: {', '.join(DURABILITY_LEVELS)} "
        "(any case; default none)",
    )
    g.add_argument("--durable", action="store_true", help="same as --durability persistActive")


def _one_node(p: argparse.ArgumentParser) -> None:
    """A command that acts on one node: a bootstrap list in --host is refused."""
    p.set_defaults(one_node=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dcpctl",
        description="Inspect a DCP server: live over its port, or its data directory offline.",
    )
    _server_options(parser, True)
    _output_options(parser, True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = _command(sub, "vbuckets", "live:cmd_vbuckets", "per-vbucket state, seqnos, memory, streams")
    p.add_argument("--vb", type=vb_list, help="only these vbuckets (3 or 0,2,5-7)")
    p.add_argument("--active", action="store_true", help="only active vbuckets")
    p = _command(
        sub, "failover-log", "live:cmd_failover_log", "a vbucket's failover log, newest first"
    )
    p.add_argument("vbucket", type=vb_id)
    _node_option(p, "ask this copy (default: the vbucket's active node)")
    p = _command(
        sub,
        "checkpoints",
        "live:cmd_checkpoints",
        "a vbucket's checkpoints, cursors and dropped cursors",
    )
    p.add_argument("vbucket", type=vb_id)
    _node_option(p, "ask this copy (default: the vbucket's active node)")
    p = _command(sub, "connections", "streams:cmd_connections", "DCP connections")
    p.add_argument("--name", help="only the connection with this DCP name")
    p = _command(
        sub, "streams", "streams:cmd_streams", "DCP streams with phase, lag and flow control"
    )
    p.add_argument("--vb", type=vb_list, help="only streams of these vbuckets")
    p.add_argument("--name", help="only streams of this DCP connection name")
    p = _command(sub, "stats", "live:cmd_stats", "raw STAT output of a group")
    p.add_argument(
        "group",
        nargs="*",
        default=[],
        help='group and argument, e.g. "vbucket-seqno 3" (default: general)',
    )
    _node_option(p, "ask this node of the cluster (default: the one that answered first)")
    _command(
        sub,
        "map",
        "map_cmd:cmd_map",
        "the cluster map as the nodes serve it (GET_CLUSTER_CONFIG): nodes, actives, replicas",
    )
    p = _command(sub, "tail", "tail:cmd_tail", "a live feed of snapshot markers and changes")
    p.add_argument("--vb", type=vb_list, help="only these vbuckets (default: all)")
    p.add_argument(
        "--from",
        dest="start",
        choices=["beginning", "now"],
        default="now",
        help="start at seqno 0 or at the current high seqnos (default now)",
    )
    p.add_argument(
        "--to-latest",
        action="store_true",
        help="stop once every vbucket reached its high seqno at the start",
    )
    p.add_argument("--limit", type=int, default=0, help="stop after this many changes")
    p.add_argument(
        "--stable-only",
        action="store_true",
        help="only whole snapshots no single node failure can roll back (a snapshot is "
        "shown once the vbucket's stable seqno reaches its end)",
    )
    p.add_argument(
        "--value-width", type=int, default=60, help="characters of each value to show (0: all)"
    )
    p = _command(sub, "get", "kv:cmd_get", "read a document")
    p.add_argument("key")
    p = _command(sub, "set", "kv:cmd_set", "write a document")
    p.add_argument("key")
    p.add_argument("value")
    p.add_argument("--flags", type=int, default=0)
    p.add_argument("--expiry", type=int, default=0, help="seconds (<= 30 days) or epoch time")
    _durability(p)
    p = _command(sub, "delete", "kv:cmd_delete", "delete a document")
    p.add_argument("key")
    _durability(p)
    p = _command(
        sub, "set-state", "vbstate:cmd_set_state", "set the state of vbuckets (SET_VBUCKET_STATE)"
    )
    _one_node(p)
    p.add_argument("vbuckets", type=vb_list, metavar="VB[-VB]", help="3, 0-15 or 0,2,5-7")
    p.add_argument("state", choices=["active", "replica", "pending", "dead"])
    p.add_argument(
        "--source", type=address, metavar="HOST:PORT", help="replica/pending: replicate from there"
    )
    p = _command(
        sub, "promote", "vbstate:cmd_promote", "make vbuckets active (default: every replica)"
    )
    _one_node(p)
    p.add_argument("vbuckets", type=vb_list, nargs="*", metavar="VB", help="3, 0-15 or 0,2,5-7")
    p = _command(
        sub,
        "move",
        "vbstate:cmd_move",
        "move a vbucket's active copy from this node to another (takeover)",
    )
    p.add_argument("vbucket", type=vb_id)
    _one_node(p)
    p.add_argument("--to", required=True, type=address, metavar="HOST:PORT", help="the new node")
    p.add_argument(
        "--takeover-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long the new node may take to become active (default 60)",
    )
    p = _command(
        sub, "metrics", "metrics:cmd_metrics", "the server's Prometheus metrics", mcbp=False
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=_env_int("DCP_METRICS_PORT", 0),
        help="the server's --metrics-port (env DCP_METRICS_PORT)",
    )
    _one_node(p)
    p.add_argument("--grep", help="only metrics whose name contains this")
    p.add_argument("--raw", action="store_true", help="print the exposition text as is")

    p = sub.add_parser("user", help="add or remove users of the server's users file")
    users = p.add_subparsers(dest="user_command", required=True, metavar="ACTION")
    for action, help_ in (
        ("add", "add a user or replace its roles and password"),
        ("remove", "remove a user"),
    ):
        u = _command(users, action, f"users_cmd:cmd_user_{action}", help_, live=False)
        u.add_argument("name", metavar="NAME")
        if action == "add":
            u.add_argument(
                "--role",
                required=True,
                metavar="ROLE[,ROLE...]",
                help="read, write, stream, stats, admin, replicate or all (password: asked on a "
                "terminal, else the first line of stdin)",
            )
        u.add_argument(
            "--users-file",
            default=os.environ.get("DCP_USERS_FILE"),
            metavar="PATH",
            help="the server's users file (env DCP_USERS_FILE); created if missing",
        )
        u.add_argument(
            "--etcd",
            default=os.environ.get("DCP_USERS_ETCD"),
            metavar="URL",
            help="write the cluster's users in etcd instead (the servers' users_etcd)",
        )
        u.add_argument(
            "--etcd-prefix",
            default=os.environ.get("DCP_USERS_ETCD_PREFIX", "/dcp/default/users/"),
            metavar="PREFIX",
            help="the servers' users_etcd_prefix (default /dcp/default/users/)",
        )

    add_cluster_parser(sub, _command)

    p = _command(
        sub,
        "inspect",
        _INSPECT,
        "read a data directory offline (read-only; safe while the server runs)",
        live=False,
    )
    p.add_argument("data_dir", help="the server's --data-dir")
    views = p.add_subparsers(dest="view", metavar="VIEW")
    v = _command(
        views,
        "vbuckets",
        _INSPECT,
        "persisted vbucket states and item counts (default)",
        live=False,
    )
    v.add_argument("--vb", type=vb_list)
    v.add_argument("--active", action="store_true")
    v = _command(views, "failover-log", _INSPECT, "a persisted failover log", live=False)
    v.add_argument("vbucket", type=vb_id)
    v = _command(views, "dump", _INSPECT, "items of a vbucket in a seqno range", live=False)
    v.add_argument("vbucket", type=vb_id)
    v.add_argument("--from", dest="start", type=int, default=0, help="first seqno")
    v.add_argument("--to", dest="end", type=int, default=None, help="last seqno")
    v.add_argument("--limit", type=int, default=0, help="at most this many items")
    v.add_argument("--value-width", type=int, default=60)
    v = _command(
        views, "history", _INSPECT, "superseded versions kept by the history window", live=False
    )
    v.add_argument("vbucket", type=vb_id)
    v.add_argument("--limit", type=int, default=0)
    v = _command(views, "check", _INSPECT, "consistency check; exits 1 on problems", live=False)
    v.add_argument("--vb", type=vb_list)
    return parser


def _find(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """``exc`` or the first ``kind`` inside an exception group."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            found = _find(sub, kind)
            if found is not None:
                return found
    return None


def _run(args: argparse.Namespace, out: Output) -> int:
    module, _, name = args.func.partition(":")
    fn = getattr(importlib.import_module(f"{__package__}.{module}"), name)
    if getattr(args, "live", False):  # --host is a bootstrap list (topology.py)
        from .topology import normalize

        normalize(args)
    if args.mcbp:  # credentials (maybe a prompt) and TLS before trio starts
        resolve(args)
    if inspect.iscoroutinefunction(fn):
        import trio

        return trio.run(fn, args, out)
    return fn(args, out)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Output(json_mode=args.json, progress=not args.no_progress)
    try:
        return _run(args, out)
    except BaseException as exc:
        err = _find(exc, CtlError)
        if isinstance(err, CtlError):
            print(f"dcpctl: {err}", file=sys.stderr)
            return err.code
        if _find(exc, KeyboardInterrupt) is not None:
            print("dcpctl: interrupted", file=sys.stderr)
            return 130
        if _find(exc, BrokenPipeError) is not None:  # `dcpctl ... | head`
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        if isinstance(exc, SystemExit):
            raise
        if os.environ.get("DCPCTL_DEBUG"):
            traceback.print_exc()
        print(
            f"dcpctl: internal error: {exc!r} (DCPCTL_DEBUG=1 shows the traceback)", file=sys.stderr
        )
        return 70


if __name__ == "__main__":
    sys.exit(main())
