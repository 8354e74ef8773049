"""``python -m tools.bench scale`` keeps working: a tiny run, its output checked; and the
pure parts (CPU from /proc, the verdict on what limited a phase) on their own.

One run of ``python -m tools.bench scale --tiny --json`` (a 1-node cluster, 2-node
clusters with 0 and 1 replica, a plain dcp-server; 3000 items over 16 vbuckets) feeds
the slow tests. Nothing is asserted about speed: only that every configuration wrote and
streamed every item, each from where the map says (both nodes of a 2-node cluster served
a share), that each process's CPU is reported, and that the ratios are the rates'.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("psutil", reason="the bench tool needs psutil (the bench extra)")

from tools.bench.scale import limit_of, proc_cpu  # noqa: E402

needs_etcd = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed")


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "scale.json"
    cmd = [sys.executable, "-m", "tools.bench", "scale", "--tiny", "--json", "--no-install"]
    cmd += ["--timeout", "60", "--output", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout)
    assert printed == json.loads(out.read_text())
    return printed


def _rows(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["kind"], r["config"]): r for r in doc["results"]["scale"]["rows"]}


@pytest.mark.slow
@needs_etcd
def test_every_configuration_wrote_and_streamed_every_item(doc: dict[str, Any]) -> None:
    res = doc["results"]["scale"]
    rows = _rows(doc)
    confs = ["c1", "c2r0", "c2r1", "plain"]
    assert set(rows) == {(k, c) for k in ("ingest", "stream-memory") for c in confs}
    assert res["ok"] is True and doc["peer"] is None
    for (kind, conf), row in rows.items():
        (run,) = row["ours"]["runs"]
        assert run["ok"] is True and run["count"] == run["expected"] == 3000, (kind, conf)
        if kind == "ingest":
            assert run["held"] == 3000  # the servers hold every item written
        else:
            # each vbucket streamed from its active: both nodes of a 2-node cluster served
            nodes = run["per_node"]
            assert len(nodes) == (2 if conf.startswith("c2") else 1), (conf, nodes)
            assert all(n > 0 for n in nodes.values()) and sum(nodes.values()) == 3000


@pytest.mark.slow
@needs_etcd
def test_cpu_of_each_process_and_the_ratios_against_the_goals(doc: dict[str, Any]) -> None:
    res = doc["results"]["scale"]
    rows = _rows(doc)
    gens = {"ingest": ["writer0", "writer1"], "stream-memory": ["consumer0", "consumer1"]}
    servers = {"c1": ["n1", "etcd"], "c2r0": ["n1", "n2", "etcd"], "plain": ["server"]}
    for conf, names in servers.items():
        for kind in ("ingest", "stream-memory"):
            (run,) = rows[(kind, conf)]["ours"]["runs"]
            procs = run["cpu"]["procs"]
            assert sorted(procs) == sorted(names + gens[kind]), (kind, conf)
            for p in procs.values():
                assert p["cpu_s"] == pytest.approx(p["user_s"] + p["sys_s"], abs=0.002)
                assert p["pct_of_wall"] == pytest.approx(100 * p["cpu_s"] / run["wall_s"], abs=0.1)
            assert run["loadgen_cpu_s"] == pytest.approx(
                sum(procs[g]["cpu_s"] for g in gens[kind]), abs=0.002
            )
            assert run["limit"]
    for kind in ("ingest", "stream-memory"):
        base = rows[(kind, "c1")]["ours"]["median"]
        for conf in ("c2r0", "c2r1", "plain"):
            want = rows[(kind, conf)]["ours"]["median"] / base
            assert res["ratios"][kind][conf] == pytest.approx(want)
    assert res["goals_met"] == {
        "ingest": res["ratios"]["ingest"]["c2r0"] >= 1.6,
        "stream-memory": res["ratios"]["stream-memory"]["c2r0"] >= 1.3,
    }
    assert res["met"] == all(res["goals_met"].values())
    assert res["params"]["writers"] == 2 and res["params"]["consumers"] == 2
    assert any("goal >= 1.6x" in line for line in res["summary"])


# ---------------------------------------------------------------------- pure parts


def test_proc_cpu_counts_this_process_user_time() -> None:
    u0, s0 = proc_cpu(os.getpid())
    t = time.process_time()
    while time.process_time() - t < 0.3:
        pass
    u1, s1 = proc_cpu(os.getpid())
    assert u1 + s1 - u0 - s0 >= 0.2
    assert proc_cpu(2**22 + 7) == (0.0, 0.0)  # no such process: nothing, no error


def _cpu(wall: float, busy: float, **procs: float) -> dict[str, Any]:
    return {
        "wall_s": wall,
        "machine_busy_s": busy,
        "procs": {
            n: {"cpu_s": c, "user_s": c, "sys_s": 0.0, "pct_of_wall": 100 * c / wall}
            for n, c in procs.items()
        },
    }


def test_limit_names_the_machine_then_one_saturated_server() -> None:
    full = limit_of(_cpu(10, 19.5, n1=9.8, n2=8.0, writer0=1.0, etcd=0.2), 2)
    assert full["limit"].startswith("the machine: 1.95 of 2 cores")
    assert full["servers_cpu_s"] == 17.8 and full["loadgen_cpu_s"] == 1.0
    assert full["other_cores"] == pytest.approx(0.05)
    gil = limit_of(_cpu(10, 11.0, n1=9.6, writer0=1.0, etcd=0.2), 2)
    assert gil["limit"].startswith("one server process (n1 at 96%")
    idle = limit_of(_cpu(10, 6.0, server=5.0, consumer0=1.0), 2)
    assert idle["limit"].startswith("no CPU limit reached (0.60 of 2")
