"""``python -m tools.bench durability`` keeps working: a tiny run, its output checked; and
the load generator's answer parsing on its own.

One run of ``python -m tools.bench durability --tiny --json`` (etcd + 3 nodes with
``num_replicas=2`` over 16 vbuckets, every level one second closed loop and one second
open loop at 2000/s; a Redis primary + replica beside none and majority) feeds the slow
tests. Nothing is asserted about speed: only that every level ran on our cluster, that
the levels this server always takes (none, majority) were answered write for write, that
each run's CPU and percentiles are reported, and that the ratios are the medians'. The
Redis half is skipped (and said so) when redis-server or the redis package is missing.
"""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
LEVELS = ["none", "majority", "majorityAndPersistActive", "persistToMajority", "persistActive"]

pytest.importorskip("psutil", reason="the bench tool needs psutil (the bench extra)")
pytest.importorskip("hiredis", reason="the durability load generator parses Redis with hiredis")

needs_etcd = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed")


def _redis_missing() -> str | None:
    if shutil.which("redis-server") is None:
        return "redis-server is not installed"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "the redis package is not installed"
    return None


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "durability.json"
    cmd = [sys.executable, "-m", "tools.bench", "durability", "--tiny", "--json", "--no-install"]
    cmd += ["--timeout", "60", "--output", str(out)]
    if _redis_missing():
        cmd.append("--no-peer")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout)
    assert printed == json.loads(out.read_text())
    return printed


def _rows(doc: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["mode"], r["level"]): r for r in doc["results"]["durability"]["rows"]}


@pytest.mark.slow
@needs_etcd
def test_every_level_ran_on_the_cluster_and_none_and_majority_were_answered(
    doc: dict[str, Any],
) -> None:
    res = doc["results"]["durability"]
    assert "-m tools.bench durability --tiny" in doc["command"]
    p = res["params"]
    assert p["nodes"] == 3 and p["num_replicas"] == 2 and p["connections"] == 3
    assert p["levels"] == LEVELS and p["rate"] == 2000 and p["seconds"] == 1.0
    rows = _rows(doc)
    assert set(rows) == {(m, lv) for m in ("throughput", "latency") for lv in LEVELS}
    for (mode, level), row in rows.items():
        (run,) = row["ours"]["runs"]
        assert run["side"] == "ours" and run["mode"] == mode and run["level"] == level
        # every write was answered, one way or another; the answers add up to the writes
        assert run["unanswered"] == 0, (mode, level)
        assert run["ok"] + sum(run["errors"].values()) == run["sent"] > 0, (mode, level)
        assert sorted(run["cpu"]["procs"]) == ["client", "etcd", "n1", "n2", "n3"]
        assert run["server_cpu_s"] == pytest.approx(
            sum(run["cpu"]["procs"][n]["cpu_s"] for n in ("n1", "n2", "n3"))
        )
        if mode == "latency":  # open loop: exactly rate x seconds writes, on schedule
            assert run["sent"] == 2000 and run["offered_rate"] == 2000
        else:  # closed loop: at least a window per connection
            assert run["sent"] >= 3 * 16
    for level in ("none", "majority"):  # always taken: a 3-copy map has a majority
        for mode in ("throughput", "latency"):
            (run,) = rows[(mode, level)]["ours"]["runs"]
            assert run["ok_run"] and run["errors"] == {} and run["ok"] == run["sent"]
            a = run["answer_ms"]
            assert 0 <= a["p50"] <= a["p99"] <= a["p999"] <= a["max"]
            assert run["p99_ms"] == a["p99"]
        # the latency row's figure is the p99, the throughput row's the rate
        assert rows[("latency", level)]["ours"]["median"] == rows[("latency", level)]["ours_p99_ms"]
        assert rows[("throughput", level)]["ours"]["median"] == pytest.approx(
            rows[("throughput", level)]["ours"]["runs"][0]["rate"]
        )


@pytest.mark.slow
@needs_etcd
def test_ratios_goals_and_summary_are_the_medians(doc: dict[str, Any]) -> None:
    res = doc["results"]["durability"]
    rows = _rows(doc)
    none_t = rows[("throughput", "none")]["ours"]["median"]
    maj_t = rows[("throughput", "majority")]["ours"]["median"]
    maj_p99 = rows[("latency", "majority")]["ours"]["median"]
    assert res["ratios"]["majority_vs_none_throughput"] == pytest.approx(maj_t / none_t)
    assert res["ratios"]["majority_p99_ms"] == maj_p99
    assert res["goals_met"] == {
        "majority throughput >= 0.5x none": maj_t / none_t >= 0.5,
        "majority p99 <= 3 ms at the rate": maj_p99 <= 3.0,
    }
    assert res["met"] == all(res["goals_met"].values())
    text = "\n".join(res["summary"])
    for level in LEVELS:
        assert f"  {level} " in text
    assert "majority / none throughput" in text


@pytest.mark.slow
@needs_etcd
def test_redis_wait_1_beside_majority_and_set_beside_none(doc: dict[str, Any]) -> None:
    res = doc["results"]["durability"]
    rows = _rows(doc)
    why = _redis_missing()
    if why:
        assert res["peer_skipped"] and rows[("throughput", "none")]["peer"] is None
        pytest.skip(f"the Redis half did not run: {why}")
    assert res["peer_skipped"] is None
    for level, peer_level in (("none", "none"), ("majority", "wait1")):
        for mode in ("throughput", "latency"):
            row = rows[(mode, level)]
            (run,) = row["peer"]["runs"]
            assert run["side"] == "redis" and run["level"] == peer_level
            assert run["ok_run"] and run["ok"] == run["sent"] and run["errors"] == {}
            assert sorted(run["cpu"]["procs"]) == ["client", "primary", "replica"]
            assert row["ratio"] == pytest.approx(row["ours"]["median"] / row["peer"]["median"])
            key = f"{level}_vs_redis_{peer_level}_{mode}"
            assert res["ratios"][key] == row["ratio"]
    for level in ("majorityAndPersistActive", "persistToMajority", "persistActive"):
        assert rows[("throughput", level)]["peer"] is None  # nothing beside it in Redis
    # the same client concurrency on both sides
    ours = rows[("throughput", "majority")]["ours"]["runs"][0]
    peer = rows[("throughput", "majority")]["peer"]["runs"][0]
    assert ours["sent"] >= 48 and peer["sent"] >= 48


# ---------------------------------------------------------------------- answer parsing


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``durability_worker`` as its process sees it (script directory on the path)."""
    monkeypatch.syspath_prepend(str(ROOT / "tools" / "bench"))
    return importlib.import_module("durability_worker")


def test_binary_answers_survive_any_cut_and_carry_the_status(worker: ModuleType) -> None:
    from dcp.protocol import codec
    from dcp.protocol.opcodes import Opcode, Status

    wire = b"".join(
        [
            codec.response(Opcode.SET, opaque=7, cas=1),
            codec.response(Opcode.SET, Status.SYNC_WRITE_AMBIGUOUS, opaque=8, value=b"late"),
            codec.response(Opcode.SET, Status.DURABILITY_IMPOSSIBLE, opaque=9),
        ]
    )
    for cut in range(1, len(wire)):
        a = worker.BinaryAnswers()
        got = a.feed(wire[:cut]) + a.feed(wire[cut:])
        assert got == [(7, 0), (8, "0xa3"), (9, "0xa1")], cut


def test_resp_answers_group_set_and_wait_and_tell_a_wait_timeout(worker: ModuleType) -> None:
    a = worker.RespAnswers(per_write=2)
    wire = b"+OK\r\n:1\r\n+OK\r\n:0\r\n-ERR nope\r\n:1\r\n+OK\r\n"
    got = [st for i in range(len(wire)) for st in a.feed(wire[i : i + 1])]
    assert got == [0, "wait_timeout", "error"]  # the last SET still waits for its WAIT
    assert a.feed(b":2\r\n") == [0]
    plain = worker.RespAnswers()
    assert plain.feed(b"+OK\r\n+OK\r\n-ERR x\r\n") == [0, 0, "error"]
