"""``dcpctl cluster`` with real processes: ``lag`` asks real dcp-server nodes (one replicating
from the other) registered in a real etcd, and ``make cluster``'s tool starts etcd and three
``dcp-server --cluster`` nodes on free loopback ports, refuses to start them twice, and
stops them all (``make cluster-down``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dcp.producer.cluster.vbmap import VBucketMap
from tests.etcd.conftest import ETCD, EtcdProcess

from .support import NUM_VBUCKETS, ServerProcess, Wire, ctl, free_port, keys_for_vb, ok_json
from .test_cluster_cmd import put, record

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def etcd() -> Iterator[EtcdProcess]:
    if ETCD is None:
        pytest.skip("etcd is not installed (make test installs Debian's etcd-server)")
    e = EtcdProcess(Path(tempfile.mkdtemp(prefix="dcp-etcd-ctl-")))
    try:
        e.start()
        yield e
    finally:
        e.remove()


def test_lag_from_real_nodes(etcd: EtcdProcess, tmp_path: Path) -> None:
    """n2 replicates every vbucket from n1 and catches up; the map also names n1 as the
    replica of vb 6-7, which it is not (reported as not replicating); n3 is registered
    live at an address where nothing listens (reported, not fatal)."""
    a = ServerProcess(tmp_path / "a").start()
    b: ServerProcess | None = None
    try:
        b = ServerProcess(tmp_path / "b", "--replica-of", f"127.0.0.1:{a.port}").start()
        dead = free_port()
        put(etcd, "lagc", "meta", {"cluster_id": "cid", "num_vbuckets": NUM_VBUCKETS})
        for n, port in (("n1", a.port), ("n2", b.port), ("n3", dead)):
            put(etcd, "lagc", f"members/{n}", record(n, port))
            put(etcd, "lagc", f"nodes/{n}", record(n, port))
        chains: list[list[str | None]] = [["n1", "n2"]] * 6 + [["n2", "n1"]] * 2
        put(etcd, "lagc", "map", VBucketMap.from_names(1, chains).to_json())
        w = Wire(a.port)
        try:
            w.set_many([(k, b"v") for vb in range(6) for k in keys_for_vb(vb, 5)])
        finally:
            w.close()
        args = ["cluster", "--etcd", etcd.endpoint, "--cluster-name", "lagc", "lag", "--top", "0"]
        deadline = time.monotonic() + 20
        while True:
            doc = ok_json(*args, "--timeout", "3")
            nodes = {n["node"]: n for n in doc["nodes"]}
            if nodes["n2"]["caught_up"] == NUM_VBUCKETS or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert nodes["n2"] | {} == {
            "node": "n2",
            "state": "up",
            "error": None,
            "replicas": NUM_VBUCKETS,
            "caught_up": NUM_VBUCKETS,
            "behind": 0,
            "not_replicating": 0,
            "max_lag": 0,
            "total_lag": 0,
        }
        copies = {(c["vb"], c["node"]): c for c in doc["copies"]}
        assert copies[(3, "n2")]["source"] == "n1"
        assert copies[(3, "n2")]["high_seqno"] == copies[(3, "n2")]["source_high_seqno"] == 5
        assert copies[(3, "n2")]["measured"] == "source"
        assert nodes["n1"]["not_replicating"] == 2
        assert [copies[(vb, "n1")]["stream"] for vb in (6, 7)] == ["not replicating"] * 2
        assert nodes["n3"]["state"] == "unreachable"
        assert f"127.0.0.1:{dead}" in nodes["n3"]["error"]
        r = ctl(*args[:-2])
        assert r.returncode == 0, r.stderr
        assert "copies behind (worst first)" in r.stdout  # the two copies not replicating
        assert f"n3: cannot connect to 127.0.0.1:{dead}" in r.stdout
    finally:
        if b is not None:
            b.kill()
        a.kill()


def _tool(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tools.local_cluster", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def _pids(root: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text()) for p in root.glob("*.pid")}


def _running(pid: int) -> bool:
    try:  # a zombie (exited, not yet reaped) has an empty command line
        return bool(Path(f"/proc/{pid}/cmdline").read_bytes())
    except OSError:
        return False


def test_make_cluster_targets_use_the_tool() -> None:
    r = subprocess.run(
        ["make", "-n", "cluster", "cluster-down"], capture_output=True, text=True, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr
    assert "-m tools.local_cluster up --dir ./dcp-cluster" in r.stdout
    assert "-m tools.local_cluster down --dir ./dcp-cluster" in r.stdout
    assert "etcd-server" in r.stdout  # the etcd install rule `make test` uses


def _two_free_ports() -> int:
    """A free port whose next one is free too (etcd's peer port, node n2's port)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two free consecutive ports")


def test_local_cluster_up_twice_and_down(tmp_path: Path) -> None:
    if ETCD is None:
        pytest.skip("etcd is not installed (make test installs Debian's etcd-server)")
    root = tmp_path / "dcp-cluster"
    etcd_port, first = _two_free_ports(), _two_free_ports()
    ports = ["--etcd-port", str(etcd_port), "--first-port", str(first)]
    pids: dict[str, int] = {}
    try:
        r = _tool("up", "--dir", str(root), "--nodes", "2", *ports)
        pids = _pids(root)
        assert r.returncode == 0, (
            r.stdout,
            r.stderr,
            {p.name: p.read_text()[-800:] for p in root.glob("*.log")},
        )
        assert set(pids) == {"etcd", "n1", "n2"}
        argv = Path(f"/proc/{pids['n2']}/cmdline").read_bytes().split(b"\0")
        flags = {
            "--cluster": f"http://127.0.0.1:{etcd_port}",
            "--node-name": "n2",
            "--port": str(first + 1),
            "--data-dir": str(root / "n2"),
        }
        for flag, value in flags.items():
            assert argv[argv.index(flag.encode()) + 1] == value.encode(), (flag, argv)
        assert f"n1  127.0.0.1:{first}" in r.stdout and "make cluster-down" in r.stdout
        env = {"DCP_CLUSTER": f"http://127.0.0.1:{etcd_port}"}
        doc = ok_json("cluster", "nodes", env=env)
        assert [(n["node"], n["state"]) for n in doc["nodes"]] == [("n1", "up"), ("n2", "up")]
        again = _tool("up", "--dir", str(root), "--nodes", "2", *ports)
        assert again.returncode == 0, again.stderr
        for name in ("etcd", "n1", "n2"):
            assert (
                f"{name} already running (pid {pids[name]}), not starting it again" in again.stdout
            )
        assert _pids(root) == pids
        down = _tool("down", "--dir", str(root), timeout=60)
        assert down.returncode == 0, down.stderr
        assert not any(_running(p) for p in pids.values())
        assert list(root.glob("*.pid")) == []
        assert (root / "n1").is_dir() and (root / "etcd").is_dir()  # data kept
        assert "nothing running" in _tool("down", "--dir", str(root)).stdout
    finally:
        for pid in pids.values():
            if _running(pid):
                os.kill(pid, 9)
