"""Benchmarks of dcp-server + the SDK against Redis Streams, side by side, same run.

Usage (see docs/benchmarks.md)::

    .venv/bin/python -m tools.bench all                        # everything, full size
    .venv/bin/python -m tools.bench stream-memory --reps 5     # one scenario
    .venv/bin/python -m tools.bench all --tiny --json          # CI-sized, machine-readable
    .venv/bin/python -m tools.bench all --output r.json --plot docs/img/benchmarks.png
    .venv/bin/python -m tools.bench plot r.json docs/img/benchmarks.png
    .venv/bin/python -m tools.bench setup                      # install redis-server (root)

Scenarios: ceiling, stream-memory, stream-disk, ingest, fanout, latency, slow-consumer;
and ``replication`` (an active and a ``--replica-of`` replica; not part of ``all``: it runs
itself, then stream-memory and stream-disk at the same size, without the Redis peer), and
``tls`` (not part of ``all``: stream-memory and ingest over TLS vs plaintext on the same
server, and SCRAM/PLAIN logins per second; ``tls.py``), and ``cluster`` (not part of
``all``: failover time and rebalance rate of a cluster on etcd; ``cluster.py``), and
``scale`` (not part of ``all``: ingest and stream-memory on one node against two;
``scale.py``), and ``durability`` (not part of ``all``: write throughput and latency at
each durability level on a 3-node cluster beside Redis ``WAIT 1``; ``durability.py``).
Each starts its own servers on loopback ports (ours: ``dcp-server --port 0`` as a
subprocess; the peer: ``redis-server`` on a free port with persistence off), runs ours and
the peer alternately for ``--reps`` repetitions, and reports medians, min-max, ours/peer,
server and client CPU seconds of the measured phase, and peak RSS.

Needs (the ``bench`` extra): psutil, redis, hiredis, matplotlib (plots only), and
optionally py-spy (``--profile``). The machine is noisy: compare only numbers of one run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import report as bench_report
from .cluster import cluster_bench
from .durability import durability
from .procs import BenchError, ensure_redis
from .replication import replication
from .scale import scale
from .scenarios import SCENARIOS, Ctx
from .tls import tls

ORDER = list(SCENARIOS)
#: Commands that are not part of ``all``: the scenarios each one runs, in order.
GROUPS = {
    "replication": ["replication", "stream-memory", "stream-disk"],
    "tls": ["tls"],
    "cluster": ["cluster"],
    "scale": ["scale"],
    "durability": ["durability"],
}
RUNNERS = {
    **SCENARIOS,
    "replication": replication,
    "tls": tls,
    "cluster": cluster_bench,
    "scale": scale,
    "durability": durability,
}
DEFAULTS = {
    "items": 1_000_000,
    "fanout_items": 200_000,
    "slow_items": 10_000_000,
    "keys": 100_000,
    "seconds": 30.0,
    "rate": 10_000,
    "clients": [1, 4, 16],
    "quota_mib": 256.0,
    "reps": 3,
    "vbuckets": 1024,
    "batch": 1000,
    "value_size": 100,
    "timeout": 900.0,
    "profile": None,
    "output": None,
    "plot": None,
    "only": None,
    "server_arg": None,
    "slow_reps": None,
    "code_root": None,
    "configs": None,
    "writers": 2,
    "consumers": 2,
    "window": 16,
    "conns": 1,
    "levels": None,
}
#: per command, between DEFAULTS and --tiny: sized so the full command takes <= 3 min
COMMAND_DEFAULTS = {"durability": {"seconds": 3.0, "reps": 2}}
TINY = {
    "items": 3000,
    "fanout_items": 2000,
    "slow_items": 20_000,
    "keys": 2000,
    "seconds": 1.0,
    "rate": 2000,
    "clients": [1, 2],
    "quota_mib": 1.0,
    "reps": 1,
    "vbuckets": 16,
    "timeout": 60.0,
}


def _common(p: argparse.ArgumentParser, scenario: str) -> None:
    g = p.add_argument_group("sizes")
    g.add_argument("--items", type=int, help="items written / streamed (per scenario default)")
    g.add_argument("--reps", type=int, help="repetitions (ours and the peer alternate)")
    g.add_argument("--vbuckets", type=int, help="server vbuckets (default 1024)")
    g.add_argument("--batch", type=int, help="writes per pipelined batch, both sides (1000)")
    g.add_argument("--value-size", type=int, help="value bytes (100; keys are 16 bytes)")
    if scenario in ("latency", "replication", "durability", "all"):
        g.add_argument(
            "--seconds",
            type=float,
            help="latency/lag: seconds of writing (30; durability: 3 per run)",
        )
        g.add_argument("--rate", type=int, help="latency/lag: writes per second (10000)")
    if scenario in ("fanout", "tls", "all"):
        g.add_argument(
            "--clients",
            type=lambda s: [int(x) for x in s.split(",")],
            help="fanout: consumer counts, comma-separated (1,4,16); tls: the largest is "
            "the number of concurrent logins",
        )
    if scenario == "durability":
        g.add_argument(
            "--levels",
            help="comma-separated: none,majority,majorityAndPersistActive,"
            "persistToMajority,persistActive (default all)",
        )
        g.add_argument("--window", type=int, help="writes outstanding per connection (16)")
        g.add_argument(
            "--conns", type=int, help="connections per node (1); Redis gets as many in total"
        )
        g.add_argument("--keys", type=int, help="distinct keys written over and over (100000)")
    if scenario in ("slow-consumer", "all"):
        g.add_argument("--keys", type=int, help="slow-consumer: distinct keys (100000)")
        g.add_argument("--quota-mib", type=float, help="slow-consumer: checkpoint quota (256)")
    if scenario == "cluster":
        g.add_argument("--only", help="failover or rebalance (default: both)")
    if scenario == "scale":
        g.add_argument(
            "--configs",
            help="comma-separated: c1 (1-node cluster, the baseline), c2r0 (2 nodes, no "
            "replica), c2r1 (2 nodes, 1 replica), plain (dcp-server); default all four",
        )
        g.add_argument("--writers", type=int, help="writer processes (2), every configuration")
        g.add_argument("--consumers", type=int, help="consumer processes (2), every configuration")
    if scenario == "all":
        g.add_argument("--fanout-items", type=int, help="fanout items (200000)")
        g.add_argument("--slow-items", type=int, help="slow-consumer writes (10000000)")
        g.add_argument("--slow-reps", type=int, help="slow-consumer repetitions (--reps)")
        g.add_argument("--only", help="comma-separated scenarios to run (default: all)")
    g.add_argument("--tiny", action="store_true", help="CI size: everything tiny (seconds)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the JSON document on stdout")
    o.add_argument("--output", help="also write the JSON document to this file")
    o.add_argument("--plot", help="write a PNG plot of the results (matplotlib)")
    r = p.add_argument_group("running")
    r.add_argument("--no-peer", action="store_true", help="skip the Redis half")
    r.add_argument(
        "--no-install", action="store_true", help="never apt-get install redis-server, even as root"
    )
    r.add_argument("--timeout", type=float, help="seconds any one step may take (900)")
    r.add_argument("--keep", action="store_true", help="keep scratch dirs and logs")
    r.add_argument("--profile", help="py-spy record our server into this directory")
    r.add_argument(
        "--code-root",
        help="run server and clients from another checkout of "
        "the project (A/B: e.g. a git worktree of an older commit)",
    )
    r.add_argument(
        "--server-arg",
        action="append",
        metavar="NAME=VALUE",
        help="extra dcp-server setting, e.g. log_level=WARNING (repeatable)",
    )


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m tools.bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in [*ORDER, *GROUPS, "all"]:
        _common(sub.add_parser(name, help=f"run {name}"), name)
    p = sub.add_parser("plot", help="plot a saved JSON document")
    p.add_argument("input")
    p.add_argument("png")
    p = sub.add_parser("table", help="print a saved JSON document as a table")
    p.add_argument("input")
    p.add_argument("--markdown", action="store_true")
    sub.add_parser("setup", help="install redis-server (apt-get, root) and check packages")
    return ap.parse_args(argv)


def options(ns: argparse.Namespace) -> argparse.Namespace:
    """Defaults, --tiny, then explicit flags; ``--items`` of fanout / slow-consumer means
    their own item counts."""
    o = dict(DEFAULTS)
    o.update(COMMAND_DEFAULTS.get(ns.cmd, {}))
    if ns.tiny:
        o.update(TINY)
    given = {k: v for k, v in vars(ns).items() if v is not None}
    if ns.cmd == "fanout" and "items" in given:
        given["fanout_items"] = given.pop("items")
    if ns.cmd == "slow-consumer" and "items" in given:
        given["slow_items"] = given.pop("items")
    if ns.cmd in ("replication", "tls", "cluster", "scale"):
        given["no_peer"] = True  # our servers only; Redis has nothing to compare here
    o.update(given)
    o["log_dir"] = tempfile.mkdtemp(prefix="dcp-bench-logs-")
    return argparse.Namespace(**o)


def _steps(o: argparse.Namespace, names: list[str], peer: bool) -> int:
    sides = 2 if peer else 1
    n = 0
    for name in names:
        if name == "fanout":
            n += o.reps * sides * len(o.clients)
        elif name in ("ceiling",):
            n += o.reps * 2
        elif name == "stream-disk":
            n += o.reps
        elif name == "slow-consumer":
            n += o.slow_reps or o.reps
        elif name == "replication":
            n += o.reps * 2
        elif name == "tls":
            n += o.reps * 4 + 2
        elif name == "cluster":
            n += o.reps * 2
        elif name == "durability":
            levels = (o.levels or "none,majority,a,b,c").split(",")
            peer_runs = sum(1 for lv in levels if lv in ("none", "majority")) if peer else 0
            n += o.reps * (2 * (len(levels) + peer_runs) + 1)
        elif name == "scale":
            n += o.reps * 2 * len((o.configs or "c1,c2r0,c2r1,plain").split(","))
        else:
            n += o.reps * sides
    return n


def run(o: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    reason = "--no-peer" if o.no_peer else ensure_redis(install=not o.no_install)
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    results: dict[str, Any] = {}
    tty = sys.stderr.isatty()
    progress = None
    if tty:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        progress = Progress(
            TextColumn("{task.description:<36}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            transient=True,
        )
        progress.start()
        task = progress.add_task("starting", total=_steps(o, names, reason is None))
    last = [None]

    def step(desc: str) -> None:
        if progress is not None:
            if last[0] is not None:
                progress.advance(task)
            progress.update(task, description=desc)
            last[0] = desc

    if o.code_root:
        os.environ["DCP_BENCH_CODE_ROOT"] = str(Path(o.code_root).resolve())
    if o.profile:
        Path(o.profile).mkdir(parents=True, exist_ok=True)
        os.environ["DCP_BENCH_PROFILE"] = str(Path(o.profile).resolve())
    ctx = Ctx(o, reason, step)
    try:
        for name in names:
            t0 = time.perf_counter()
            os.environ["DCP_BENCH_SCENARIO"] = name
            results[name] = RUNNERS[name](ctx)
            results[name]["wall_s"] = round(time.perf_counter() - t0, 1)
    finally:
        if progress is not None:
            progress.stop()
    bench_report.annotate(results)
    opts = {k: v for k, v in vars(o).items() if k not in ("json", "output", "plot")}
    return {
        "tool": "tools.bench",
        "command": " ".join(
            shlex.quote(a) for a in [".venv/bin/python", "-m", "tools.bench", *sys.argv[1:]]
        ),
        "started_at": started,
        "finished_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": bench_report.machine(),
        "options": opts,
        "peer": None if reason else "redis-server (persistence off) + redis-py",
        "peer_skipped": reason,
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    ns = parse(sys.argv[1:] if argv is None else argv)
    if ns.cmd == "setup":
        why = ensure_redis(install=True)
        missing = []
        for mod in ("psutil", "redis", "hiredis", "matplotlib", "rich"):
            try:
                __import__(mod)
            except ImportError:
                missing.append(mod)
        print("redis peer:", "ready" if why is None else why)
        print(
            "python packages:",
            "all present"
            if not missing
            else f"missing {' '.join(missing)} (pip install {' '.join(missing)})",
        )
        return 0 if why is None and not missing else 1
    if ns.cmd in ("plot", "table"):
        doc = json.loads(Path(ns.input).read_text())
        if ns.cmd == "plot":
            bench_report.plot(doc, ns.png)
        elif ns.markdown:
            print(bench_report.markdown_table(doc))
        else:
            bench_report.print_table(doc)
        return 0
    o = options(ns)
    names = ORDER if ns.cmd == "all" else GROUPS.get(ns.cmd, [ns.cmd])
    if ns.cmd == "all" and getattr(ns, "only", None):
        names = [n for n in ORDER if n in ns.only.split(",")]
    try:
        doc = run(o, names)
    except BenchError as exc:
        print(f"tools.bench: {exc}", file=sys.stderr)
        return 1
    text = json.dumps(doc, indent=1)
    if o.output:
        Path(o.output).write_text(text)
    if o.plot:
        bench_report.plot(doc, o.plot)
    if o.json:
        print(text)
    else:
        bench_report.print_table(doc)
        if doc["peer_skipped"]:
            print(f"peer skipped: {doc['peer_skipped']}")
        for res in doc["results"].values():
            for line in res.get("summary", []):
                print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
