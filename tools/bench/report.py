"""Goals, the machine description, the human table and the plot of ``bench.py`` results.

Rules of this module: it only reads result dicts (as ``bench.py --json`` prints them);
it never runs anything. matplotlib is imported only when a plot is asked for.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

# name -> (text, check(result) -> bool | None)
GOALS: dict[str, str] = {
    "stream-memory": ">= 600 k/s and >= 2x Redis",
    "stream-disk": ">= 500 k/s",
    "ingest": ">= 200 k/s and >= 2.5x Redis",
    "fanout": "<= 0.3 us server CPU per extra delivered mutation",
    "latency": "p99 <= 2 ms at 10 k/s",
    "slow-consumer": "peak RSS <= quota + 150 MiB, nothing lost",
    "ceiling": "(reference)",
    "replication": ">= 300 k/s applied; lag p99 <= 5 ms at 10 k/s",
    "tls": "TLS >= 0.6x plaintext (stream-memory and ingest)",
    "cluster": "failover <= auto_failover_timeout + 2 s; rebalance >= 200 k items/s moved",
    "scale": "2 nodes / 1 node: ingest >= 1.6x, stream-memory >= 1.3x",
    "durability": "majority >= 0.5x none throughput; majority p99 <= 3 ms at 10 k/s",
}


def evaluate(res: dict[str, Any]) -> bool | None:
    """Whether ``res`` meets its goal (None: no goal, or not measurable)."""
    name = res["name"]
    ours = res.get("ours") or {}
    med = ours.get("median")
    ratio = res.get("ratio")
    if name == "stream-memory":
        return med is not None and med >= 600_000 and ratio is not None and ratio >= 2
    if name == "stream-disk":
        return med is not None and med >= 500_000
    if name == "ingest":
        return med is not None and med >= 200_000 and ratio is not None and ratio >= 2.5
    if name == "fanout":
        x = res.get("ours_extra_us")
        return None if x is None else x <= 0.3
    if name == "latency":
        return med is not None and med <= 2.0
    if name == "slow-consumer":
        return bool(res.get("ok")) and all(r["within_limit"] for r in ours.get("runs", []))
    if name == "tls":
        ratios = list((res.get("tls_ratios") or {}).values())
        return bool(ratios) and all(r is not None and r >= 0.6 for r in ratios)
    if name in ("cluster", "scale", "durability"):  # each part it ran against its own goal
        met = res.get("goals_met") or {}
        return all(met.values()) if met else None
    if name == "replication":
        applied, p99 = res.get("applied_rate"), res.get("lag_p99_ms")
        return applied is not None and applied >= 300_000 and p99 is not None and p99 <= 5.0
    return None


def annotate(results: dict[str, Any]) -> None:
    """Add goal, met and fraction-of-ceiling to every scenario result, in place."""
    ceil = results.get("ceiling", {}).get("ours", {}).get("median")
    for name, res in results.items():
        res["goal"] = GOALS.get(name, "")
        res["met"] = evaluate(res)
        if ceil and name in ("stream-memory", "stream-disk", "ingest") and res["ours"]["median"]:
            res["ceiling_fraction"] = res["ours"]["median"] / ceil
    rep = results.get("replication")
    if rep and rep.get("applied_rate"):
        # the replica's apply rate beside the same run's streaming figures
        for name in ("stream-memory", "stream-disk"):
            med = (results.get(name, {}).get("ours") or {}).get("median")
            rep.setdefault("beside", {})[name] = {
                "mutations_per_s": med,
                "applied_vs_stream": rep["applied_rate"] / med if med else None,
            }


def machine() -> dict[str, Any]:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        out = subprocess.run(
            ["redis-server", "--version"], capture_output=True, text=True, timeout=10
        ).stdout
        info["redis_server"] = out.split("v=")[1].split()[0] if "v=" in out else out.strip()
    except (OSError, subprocess.SubprocessError, IndexError):
        info["redis_server"] = None
    for mod in ("redis", "hiredis", "trio", "lmdb"):
        try:
            from importlib.metadata import version

            info[mod] = version(mod)
        except Exception:
            info[mod] = None
    return info


# ---------------------------------------------------------------------- table


def _k(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 1000:,.0f} k" if x >= 10_000 else f"{x:,.3g}"


def _fmt(name: str, s: dict[str, Any] | None) -> str:
    if not s or s.get("median") is None:
        return "-"
    if name in ("latency",) or name.endswith((" lag", " p99")):
        return f"{s['median']:.2f} ms [{s['min']:.2f}-{s['max']:.2f}]"
    if name.endswith(" failover"):
        return f"{s['median']:.2f} s [{s['min']:.2f}-{s['max']:.2f}]"
    if name == "slow-consumer":
        return f"{s['median']:.0f} MiB [{s['min']:.0f}-{s['max']:.0f}]"
    if name.startswith("fanout"):
        return f"{s['median']:.2f} us [{s['min']:.2f}-{s['max']:.2f}]"
    return f"{_k(s['median'])}/s [{_k(s['min'])}-{_k(s['max'])}]"


def rows(results: dict[str, Any]) -> list[list[str]]:
    """One row per scenario (fan-out: one per consumer count, then the slope)."""
    out = []

    def cpu(s: dict | None, k: str) -> str:
        return "-" if not s or s.get(k) is None else f"{s[k]:.2f}"

    def rss(s: dict | None) -> str:
        return (
            "-" if not s or not s.get("server_peak_rss_mib") else f"{s['server_peak_rss_mib']:.0f}"
        )

    def met(r: dict) -> str:
        return {True: "yes", False: "NO", None: ""}[r.get("met")]

    for _name, r in results.items():
        subs = r.get("rows") or [r]
        for sub in subs:
            o, p = sub.get("ours"), sub.get("peer")
            ratio = sub.get("ratio")
            frac = r.get("ceiling_fraction")
            out.append(
                [
                    sub["name"],
                    sub["metric"],
                    _fmt(sub["name"], o),
                    _fmt(sub["name"], p) if p else "-",
                    f"{ratio:.2f}x" if ratio and sub is r else (f"{ratio:.2f}x" if ratio else "-"),
                    f"{cpu(o, 'server_cpu_s')} / {cpu(p, 'server_cpu_s')}",
                    f"{cpu(o, 'client_cpu_s')} / {cpu(p, 'client_cpu_s')}",
                    f"{rss(o)} / {rss(p)}",
                    f"{frac:.0%}" if frac else "",
                    r.get("goal", "") if sub is subs[-1] else "",
                    met(r) if sub is subs[-1] else "",
                ]
            )
        if r["name"] == "fanout" and r.get("ours_extra_us") is not None:
            pe = r.get("peer_extra_us")
            out.append(
                [
                    "fanout slope",
                    "server CPU us per extra delivered",
                    f"{r['ours_extra_us']:.3f} us",
                    f"{pe:.3f} us" if pe else "-",
                    f"{r['ratio']:.2f}x" if r.get("ratio") else "-",
                    "",
                    "",
                    "",
                    "",
                    r.get("goal", ""),
                    met(r),
                ]
            )
    return out


HEADERS = [
    "scenario",
    "metric",
    "ours median [min-max]",
    "peer median [min-max]",
    "ours/peer",
    "server CPU s (ours / peer)",
    "client CPU s (ours / peer)",
    "server peak RSS MiB (ours / peer)",
    "of ceiling",
    "goal",
    "met",
]


def print_table(doc: dict[str, Any], file: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stdout, width=220)
    t = Table(title="DCP streaming vs peers (medians over repetitions; CPU = measured phase)")
    for h in HEADERS:
        t.add_column(h)
    for row in rows(doc["results"]):
        t.add_row(*row)
    console.print(t)
    for name, r in doc["results"].items():
        if r.get("peer_skipped"):
            console.print(f"[dim]{name}: peer: {r['peer_skipped']}[/dim]")
        if not r.get("ok", True):
            console.print(
                f"[bold red]{name}: delivered counts did not match what was written[/bold red]"
            )
    rep = doc["results"].get("replication")
    if rep:
        g = rep["goal_ratios"]
        console.print(
            f"replication: writer {_k(rep['writer_rate'])}/s to the active; replica applied "
            f"{_k(rep['applied_rate'])}/s ({g['applied_vs_300k']:.2f}x the 300 k/s goal), "
            f"persisted {_k(rep['persisted_rate'])}/s; a replica started after the writes "
            f"caught up at {_k(rep['catchup_rate'])}/s; lag p50 {rep['lag_p50_ms']:.2f} ms, "
            f"p99 {rep['lag_p99_ms']:.2f} ms (goal 5 ms: {g['lag_5ms_vs_p99']:.2f}x)"
        )
        for name, b in (rep.get("beside") or {}).items():
            if b["mutations_per_s"]:
                console.print(
                    f"  beside {name} {_k(b['mutations_per_s'])}/s: replica applies at "
                    f"{b['applied_vs_stream']:.2f}x that"
                )
    lat = doc["results"].get("latency")
    if lat:
        for side in ("ours", "peer"):
            s = lat.get(side)
            if s:
                console.print(
                    f"latency {side}: p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f}"
                    f" ms, p99.9 {s['p999_ms']:.2f} ms, max {s['max_ms']:.2f} ms"
                )


def markdown_table(doc: dict[str, Any]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    for row in rows(doc["results"]):
        lines.append("| " + " | ".join(c.replace("|", "/") for c in row) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------- plot


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = doc["results"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax = axes[0][0]
    names = [n for n in ("stream-memory", "stream-disk", "ingest", "ceiling") if n in res]
    xs = range(len(names))
    ours = [(res[n]["ours"]["median"] or 0) / 1e3 for n in names]
    peer = [((res[n].get("peer") or {}).get("median") or 0) / 1e3 for n in names]
    ax.bar([x - 0.2 for x in xs], ours, 0.4, label="ours (dcp-server + SDK)", color="#1f77b4")
    ax.bar(
        [x + 0.2 for x in xs], peer, 0.4, label="Redis Streams + redis-py/hiredis", color="#d62728"
    )
    for x, n in zip(xs, names, strict=True):
        for dx, s in ((-0.2, res[n]["ours"]), (0.2, res[n].get("peer"))):
            if not s or s.get("median") is None:
                continue
            ax.errorbar(
                x + dx,
                s["median"] / 1e3,
                yerr=[[(s["median"] - s["min"]) / 1e3], [(s["max"] - s["median"]) / 1e3]],
                color="k",
                capsize=3,
            )
            ax.text(
                x + dx,
                s["max"] / 1e3,
                f"{s['median'] / 1e3:,.0f}",
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("k items/s (median, bars = min-max)")
    ax.set_title("Throughput per scenario")
    ax.legend()

    ax = axes[0][1]
    fo = res.get("fanout")
    if fo:
        ns = [r["consumers"] for r in fo["rows"]]
        ax.plot(ns, [r["ours"]["median"] for r in fo["rows"]], "o-", label="ours")
        if all(r.get("peer") for r in fo["rows"]):
            ax.plot(
                ns, [r["peer"]["median"] for r in fo["rows"]], "s-", color="#d62728", label="Redis"
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("consumers")
        ax.set_ylabel("server CPU us per delivered mutation")
        ax.set_title("Fan-out")
        ax.legend()

    ax = axes[1][0]
    lat = res.get("latency")
    if lat:
        qs = ["p50", "p99", "p999", "max"]
        for i, (side, color) in enumerate((("ours", "#1f77b4"), ("peer", "#d62728"))):
            s = lat.get(side)
            if s:
                ax.bar(
                    [x + (i - 0.5) * 0.4 for x in range(len(qs))],
                    [s[q + "_ms"] for q in qs],
                    0.4,
                    color=color,
                    label="ours" if side == "ours" else "Redis",
                )
        ax.set_xticks(range(len(qs)), ["p50", "p99", "p99.9", "max"])
        ax.set_yscale("log")
        ax.set_ylabel("write ack -> delivery, ms")
        ax.set_title(f"Latency at {lat['params']['rate']:,}/s")
        ax.axhline(2.0, ls="--", color="gray", lw=1)
        ax.legend()

    ax = axes[1][1]
    slow = res.get("slow-consumer")
    if slow:
        run = slow["ours"]["runs"][0]
        samples = run["rss_samples"]
        ts = [s[0] for s in samples]
        ax.plot(ts, [s[1] for s in samples], label="server RSS")
        if samples and len(samples[0]) >= 5:
            ax.plot(ts, [s[3] for s in samples], lw=1, label="  anonymous (Python heap)")
            ax.plot(ts, [s[4] for s in samples], lw=1, label="  file-backed (LMDB map)")
        ax.axhline(slow["quota_mib"], ls="--", color="gray", lw=1, label="checkpoint quota")
        ax.axhline(slow["limit_mib"], ls=":", color="r", lw=1, label="quota + 150 MiB")
        if run.get("checkpoint_memory_mib_after_writes") is not None:
            ax.plot(
                [ts[-1]],
                [run["checkpoint_memory_mib_after_writes"]],
                "kx",
                label="checkpoint memory (accounted) after writes",
            )
        t = next((s[0] for s in samples if s[2] == "drain"), None)
        if t is not None:
            ax.axvline(t, color="k", lw=0.5)
            ax.text(t, slow["limit_mib"] * 1.02, "resume ", fontsize=8, ha="right")
        ax.set_xlabel("seconds")
        ax.set_ylabel("MiB")
        ax.set_title(
            f"Slow consumer: {slow['params']['items']:,} writes, "
            f"{slow['params']['keys']:,} keys, consumer stalled"
        )
        ax.legend(loc="lower right", fontsize=7)
    m = doc.get("machine", {})
    fig.suptitle(
        f"dcp bench on {m.get('cores')} cores, {m.get('cpu', '')} "
        f"(medians of {doc.get('options', {}).get('reps')} reps)",
        fontsize=10,
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
