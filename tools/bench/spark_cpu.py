"""CPU seconds by process class for ``python -m tools.bench.spark`` (tools/bench/spark.py).

Rules of this module:
- Four classes, read with psutil (Linux ``/proc``) and summed over each process tree:
  ``server`` (the DCP server or the ``--replay`` stand-in, with any children), ``python``
  (Spark's Python workers: every process below the JVM, which are the ``pyspark.daemon``
  processes and the workers they fork), ``jvm`` (the Spark JVM's own threads) and
  ``driver`` (this process: the bench, py4j, the ``foreachBatch`` callbacks).
- A process's total is user + system of all its threads plus its reaped children's
  (``children_user``/``children_system``). That keeps a worker that ran and exited
  between two samples in the total of whoever reaped it; the JVM's reaped children are
  Python workers, so the JVM's children share is booked to ``python``, not to ``jvm``.
- Sampling never raises: a process that vanished between listing and reading counts
  0, which can only lose CPU of a process that both started and ended inside one
  sample (a few milliseconds), never invent any.
"""

from __future__ import annotations

import statistics

import psutil

CLASSES = ("server", "python", "jvm", "driver")


def _own(p: psutil.Process) -> float:
    try:
        t = p.cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system


def _reaped(p: psutil.Process) -> float:
    try:
        t = p.cpu_times()
    except psutil.Error:
        return 0.0
    return t.children_user + t.children_system


def _tree(p: psutil.Process) -> float:
    """CPU of ``p`` and every live descendant, with what each of them reaped."""
    try:
        procs = [p, *p.children(recursive=True)]
    except psutil.Error:
        return 0.0
    return sum(_own(q) + _reaped(q) for q in procs)


def sample(server_pid: int) -> dict[str, float]:
    """Cumulative CPU seconds per class now; subtract two samples for a run's share."""
    me = psutil.Process()
    out = dict.fromkeys(CLASSES, 0.0)
    out["driver"] = _own(me)
    try:
        out["server"] = _tree(psutil.Process(server_pid))
    except (psutil.Error, ValueError):  # gone, or no such pid (ValueError: below 0)
        pass
    try:
        kids = me.children()
    except psutil.Error:
        kids = []
    for k in kids:
        try:
            is_jvm = k.pid != server_pid and k.name() == "java"
        except psutil.Error:
            continue
        if not is_jvm:
            continue
        out["jvm"] += _own(k)
        out["python"] += _reaped(k)
        try:
            below = k.children(recursive=True)
        except psutil.Error:
            below = []
        out["python"] += sum(_own(q) + _reaped(q) for q in below)
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds per class spent between two samples (never below 0: a tree that lost a
    process without reaping it can read lower afterwards)."""
    return {c: max(0.0, after[c] - before[c]) for c in CLASSES}


def per_million(runs: list[dict[str, float]], rows: int) -> dict[str, float]:
    """Median over runs of CPU seconds per 1M rows, per class and in ``total``."""
    scale = 1e6 / rows
    out = {c: statistics.median(r[c] for r in runs) * scale for c in CLASSES}
    out["total"] = statistics.median(sum(r.values()) for r in runs) * scale
    return {k: round(v, 3) for k, v in out.items()}
