"""Reliability harness: try hard to make the change stream lose or invent a change.

Scenarios (each bounded in time and count, loopback only, stops by itself)::

    .venv/bin/python -m tools.chaos crash   [--rounds 50 --consumers 3 ...]
    .venv/bin/python -m tools.chaos fuzz    [--frames 1000000 --connections 4 ...]
    .venv/bin/python -m tools.chaos slow    [--seconds 20 --quota-mib 8 ...]
    .venv/bin/python -m tools.chaos storage [--map-mib 2 ...]
    .venv/bin/python -m tools.chaos abuse   [--short --value-mib 20 --gets 100 ...]
    .venv/bin/python -m tools.chaos failover [--rounds 30 --levels none,majority ...]
    .venv/bin/python -m tools.chaos all     (every scenario but failover, with defaults)

Each prints a JSON report (also written to ``WORKDIR/<scenario>/report.json``) and exits
1 when the report has divergences, crashes or errors. The scenario functions
(``run_crash``, ``run_fuzz``, ``run_slow``, ``run_storage``, ``run_abuse``,
``run_failover``) are importable for tests. ``all`` leaves ``failover`` out: it needs etcd
and runs for minutes.

Rules of this module: argument parsing and report printing only; each scenario lives in
``tools/chaos/<scenario>.py``; shared pieces: ``procs`` (child processes, raw wire),
``writer`` (writer and its log), ``view`` (rollback-safe view + journal),
``verify`` (the verifier), ``frames`` (fuzz frames), ``consumer`` (the
consumer child process). See ``docs/reliability.md`` for what each scenario proves and the figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio

from .abuse import DEFAULT, SHORT, run_abuse
from .crash import run_crash
from .failover import KINDS, run_failover
from .failover_writer import LEVELS
from .fuzz import run_fuzz
from .slow import run_slow
from .storage import run_storage

__all__ = [
    "FAILURE_KEYS",
    "failed",
    "main",
    "run_abuse",
    "run_crash",
    "run_failover",
    "run_fuzz",
    "run_slow",
    "run_storage",
]

#: Report counters that must be 0 for a scenario to pass.
FAILURE_KEYS = ("divergences", "crashes", "errors", "healthy_stream_errors", "violations")


def failed(report: dict[str, Any]) -> bool:
    return any(report.get(k) for k in FAILURE_KEYS)


def _summary(report: dict[str, Any]) -> str:
    skip = {"findings", "per_consumer", "errors_detail", "options", "per_round"}
    return json.dumps({k: v for k, v in report.items() if k not in skip}, indent=1)


def _names(text: str, valid: tuple[str, ...], p: argparse.ArgumentParser) -> tuple[str, ...]:
    """A comma-separated subset of ``valid`` (a usage error names the valid ones)."""
    got = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in got if x not in valid]
    if bad or not got:
        p.error(f"{text!r}: choose from {', '.join(valid)}")
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.chaos", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", help="where data, logs and reports go (default: a temp dir)")
    p.add_argument("--seed", type=int)
    sub = p.add_subparsers(dest="scenario", required=True)
    c = sub.add_parser("crash", help="SIGKILL server and consumers; verify convergence")
    c.add_argument("--rounds", type=int, default=50)
    c.add_argument("--consumers", type=int, default=3)
    c.add_argument("--num-vbuckets", type=int, default=16)
    c.add_argument("--keys-per-vb", type=int, default=40)
    c.add_argument("--min-up", type=float, default=0.4)
    c.add_argument("--max-up", type=float, default=2.0)
    c.add_argument("--consumer-kill-prob", type=float, default=0.35)
    c.add_argument(
        "--graceful-prob",
        type=float,
        default=0.15,
        help="share of rounds that stop the server with SIGTERM instead",
    )
    c.add_argument(
        "--freeze-prob",
        type=float,
        default=0.08,
        help="share of rounds that SIGSTOP the server for 2-5 s instead",
    )
    c.add_argument(
        "--sleeper-rounds",
        type=int,
        default=30,
        help="the last consumer is down this many rounds (0: never), more than "
        "the 25 failover-log entries; needs rounds >= this + 5",
    )
    c.add_argument("--time-limit", type=float, default=1200.0)
    c.add_argument("--server-args", default="", help="extra dcp-server flags, one string")
    c.add_argument(
        "--consumer-args",
        default="",
        help="extra tools.chaos.consumer flags, e.g. '--buffer-size 65536'",
    )
    c.add_argument(
        "--consumer-fault",
        default="none",
        choices=["none", "ignore-rollback", "partial"],
        help="harness self-test: consumers misbehave; the report must show it",
    )
    f = sub.add_parser("fuzz", help="malformed frames at a live server; a healthy consumer")
    f.add_argument("--frames", type=int, default=1_000_000)
    f.add_argument("--connections", type=int, default=4)
    f.add_argument("--num-vbuckets", type=int, default=16)
    f.add_argument("--corpus-size", type=int, default=400)
    f.add_argument("--time-limit", type=float, default=900.0)
    f.add_argument(
        "--graceful-close",
        action="store_true",
        help="end episodes with a half-close and a drain instead of a close that "
        "may send RST (works around the reset crash)",
    )
    w = sub.add_parser("slow", help="stalled/slow consumers under heavy writes")
    w.add_argument("--seconds", type=float, default=20.0)
    w.add_argument("--quota-mib", type=int, default=8)
    w.add_argument("--num-vbuckets", type=int, default=32)
    w.add_argument("--keys", type=int, default=40000)
    w.add_argument("--value-bytes", type=int, default=1024)
    w.add_argument("--overhead-mib", type=int, default=64)
    g = sub.add_parser("storage", help="a tiny LMDB map fills up; then it is grown")
    g.add_argument("--map-mib", type=int, default=2)
    g.add_argument("--grown-map-mib", type=int, default=64)
    g.add_argument("--num-vbuckets", type=int, default=8)
    g.add_argument("--full-seconds", type=float, default=3.0)
    a = sub.add_parser(
        "abuse",
        help="clients that never read, floods, slowloris; a neighbour measures its NOOP latency",
    )
    a.add_argument("--short", action="store_true", help="the CI form: under 20 s")
    a.add_argument("--num-vbuckets", type=int, default=1024)
    a.add_argument("--connection-output-cap-mib", type=int, default=4)
    a.add_argument("--total-output-cap-mib", type=int, default=64)
    a.add_argument(
        "--rss-guard-mib",
        type=int,
        default=1536,
        help="SIGKILL the server past this RSS (protects the machine)",
    )
    for name in (
        "value_mib",
        "gets",
        "stat_requests",
        "slowloris",
        "flood_extra",
        "max_connections",
    ):
        a.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            dest=name,
            help=f"default {DEFAULT[name]} (--short: {SHORT[name]})",
        )
    for name in ("phase_seconds", "partial_frame_timeout"):
        a.add_argument(
            "--" + name.replace("_", "-"),
            type=float,
            dest=name,
            help=f"default {DEFAULT[name]} (--short: {SHORT[name]})",
        )
    o = sub.add_parser(
        "failover",
        help="etcd + 3 nodes: kill -9, SIGSTOP past the failover, etcd kill, kill -9 and "
        "an immediate restart; writers at "
        "every durability level, normal and stable-only consumers",
    )
    o.add_argument("--rounds", type=int, default=30)
    o.add_argument("--kinds", default=",".join(KINDS), help="round kinds to draw from")
    o.add_argument("--levels", default=",".join(LEVELS), help="one writer per level")
    o.add_argument("--num-vbuckets", type=int, default=16)
    o.add_argument("--keys-per-vb", type=int, default=6, help="per writer")
    o.add_argument("--normal-consumers", type=int, default=2)
    o.add_argument("--stable-consumers", type=int, default=2)
    o.add_argument("--lease-ttl", type=int, default=2)
    o.add_argument("--failover-timeout", type=float, default=3.0)
    o.add_argument("--min-up", type=float, default=1.0)
    o.add_argument("--max-up", type=float, default=3.0)
    o.add_argument("--heal-timeout", type=float, default=60.0)
    o.add_argument("--time-limit", type=float, default=1800.0)
    sub.add_parser("all", help="every scenario but failover, with its defaults")
    args = p.parse_args(argv)
    base = Path(args.workdir or tempfile.mkdtemp(prefix="chaos-"))
    jobs: list[tuple[str, Any]] = []
    if args.scenario in ("crash", "all"):
        kw: dict[str, Any] = {}
        if args.scenario == "crash":
            kw = dict(
                rounds=args.rounds,
                consumers=args.consumers,
                num_vbuckets=args.num_vbuckets,
                keys_per_vb=args.keys_per_vb,
                min_up=args.min_up,
                max_up=args.max_up,
                consumer_kill_prob=args.consumer_kill_prob,
                time_limit=args.time_limit,
                server_args=args.server_args.split(),
                consumer_args=args.consumer_args.split(),
                consumer_fault=args.consumer_fault,
                graceful_prob=args.graceful_prob,
                freeze_prob=args.freeze_prob,
                sleeper_rounds=args.sleeper_rounds,
            )
        jobs.append(("crash", functools.partial(run_crash, base / "crash", seed=args.seed, **kw)))
    if args.scenario in ("fuzz", "all"):
        kw = {}
        if args.scenario == "fuzz":
            kw = dict(
                frames=args.frames,
                connections=args.connections,
                num_vbuckets=args.num_vbuckets,
                corpus_size=args.corpus_size,
                time_limit=args.time_limit,
                graceful_close=args.graceful_close,
            )
        jobs.append(("fuzz", functools.partial(run_fuzz, base / "fuzz", seed=args.seed, **kw)))
    if args.scenario in ("slow", "all"):
        kw = {}
        if args.scenario == "slow":
            kw = dict(
                seconds=args.seconds,
                quota_mib=args.quota_mib,
                num_vbuckets=args.num_vbuckets,
                keys=args.keys,
                value_bytes=args.value_bytes,
                overhead_mib=args.overhead_mib,
            )
        jobs.append(("slow", functools.partial(run_slow, base / "slow", seed=args.seed, **kw)))
    if args.scenario in ("storage", "all"):
        kw = {}
        if args.scenario == "storage":
            kw = dict(
                map_mib=args.map_mib,
                grown_map_mib=args.grown_map_mib,
                num_vbuckets=args.num_vbuckets,
                full_seconds=args.full_seconds,
            )
        jobs.append(
            ("storage", functools.partial(run_storage, base / "storage", seed=args.seed, **kw))
        )
    if args.scenario in ("abuse", "all"):
        kw = {}
        if args.scenario == "abuse":
            kw = dict(
                short=args.short,
                num_vbuckets=args.num_vbuckets,
                connection_output_cap_mib=args.connection_output_cap_mib,
                total_output_cap_mib=args.total_output_cap_mib,
                rss_guard_mib=args.rss_guard_mib,
            )
            kw.update({k: v for k in DEFAULT if (v := getattr(args, k)) is not None})
        jobs.append(("abuse", functools.partial(run_abuse, base / "abuse", seed=args.seed, **kw)))
    if args.scenario == "failover":
        kw = dict(
            rounds=args.rounds,
            kinds=_names(args.kinds, KINDS, p),
            levels=_names(args.levels, LEVELS, p),
            num_vbuckets=args.num_vbuckets,
            keys_per_vb=args.keys_per_vb,
            normal_consumers=args.normal_consumers,
            stable_consumers=args.stable_consumers,
            lease_ttl=args.lease_ttl,
            failover_timeout=args.failover_timeout,
            min_up=args.min_up,
            max_up=args.max_up,
            heal_timeout=args.heal_timeout,
            time_limit=args.time_limit,
        )
        jobs.append(
            ("failover", functools.partial(run_failover, base / "failover", seed=args.seed, **kw))
        )
    rc = 0
    for name, job in jobs:
        report = trio.run(job)
        (base / name).mkdir(parents=True, exist_ok=True)
        (base / name / "report.json").write_text(json.dumps(report, indent=1))
        print(f"== {name} (workdir {base / name})")
        print(_summary(report))
        for f in report.get("findings", [])[:50]:
            print("  FINDING:", f)
        if failed(report):
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
