"""``dcpctl cluster`` against a real throwaway etcd, with the cluster's keys written here in
the shapes docs/cluster.md documents (no nodes needed): the views (nodes, map), the
requests dcpctl writes (create-only), waits completed by a status the test writes as the
orchestrator would, and the one-line errors."""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from dcp.producer.cluster.store import EtcdStore
from dcp.producer.cluster.vbmap import VBucketMap
from tests.etcd.conftest import ETCD, EtcdProcess

from .support import DCPCTL, fails, free_port, ok, ok_json

NODES = ("n1", "n2", "n3")
# vb 0-2 on n1 (replica n2), 3-5 on n2 (replica n3), 6 on n3 (replica n1), 7 lost its active
CHAINS: list[list[str | None]] = [["n1", "n2"]] * 3 + [["n2", "n3"]] * 3 + [["n3", "n1"]]
CHAINS.append([None, "n1"])


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdProcess]:
    if ETCD is None:
        pytest.skip("etcd is not installed (make test installs Debian's etcd-server)")
    e = EtcdProcess(Path(tempfile.mkdtemp(prefix="dcp-etcd-ctl-")))
    try:
        e.start()
        yield e
    finally:
        e.remove()


_n = iter(range(10**6))


@pytest.fixture
def name() -> str:
    return f"c{next(_n)}"


def _call(endpoint: str, method: str, *args: Any, **kw: Any) -> Any:
    async def run() -> Any:
        store = EtcdStore(endpoint)
        try:
            return await getattr(store, method)(*args, **kw)
        finally:
            await store.aclose()

    return trio.run(run)


def put(etcd: EtcdProcess, name: str, rel: str, doc: Any) -> None:
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    _call(etcd.endpoint, "put", f"/dcp/{name}/{rel}", raw)


def get(etcd: EtcdProcess, name: str, rel: str) -> Any:
    got = _call(etcd.endpoint, "get", f"/dcp/{name}/{rel}")
    return json.loads(got.value) if got is not None else None


def record(name: str, port: int) -> dict[str, Any]:
    return {
        "name": name,
        "address": f"127.0.0.1:{port}",
        "uuid": f"u-{name}",
        "num_vbuckets": 8,
        "cluster_id": "cid",
    }


def seed(
    etcd: EtcdProcess,
    name: str,
    *,
    live: tuple[str, ...] = ("n1", "n2"),
    forward: list[list[str | None]] | None = None,
    status: dict[str, Any] | None = None,
) -> None:
    """A three-node cluster: n3 down for 12.5 s (by a fresh status), vb 7 unavailable,
    one automatic failover used, n1 orchestrator."""
    put(etcd, name, "meta", {"cluster_id": "cid", "num_vbuckets": 8})
    for i, n in enumerate(NODES):
        put(etcd, name, f"members/{n}", record(n, 11210 + i))
        if n in live:
            put(etcd, name, f"nodes/{n}", record(n, 11210 + i))
    vbmap = VBucketMap.from_names(1, CHAINS, servers=list(NODES), forward=forward)
    put(etcd, name, "map", vbmap.to_json())
    put(etcd, name, "orchestrator", {"node": "n1", "uuid": "u-n1"})
    put(etcd, name, "autofailover", {"count": 1, "failed_over": ["n3"]})
    base = {
        "orchestrator": "n1",
        "term": 5,
        "updated": time.time(),
        "down": {"n3": 12.5},
        "unavailable": [7],
        "rebalance": {"id": None, "state": "idle", "total": 0, "done": 0, "message": ""},
        "failover": {"id": None, "node": None, "state": "idle", "message": "", "auto": False},
        "autofailover": {"count": 1, "max": 1},
    }
    put(etcd, name, "status", {**base, **(status or {})})


def cluster(etcd: EtcdProcess, name: str, *args: Any) -> list[str]:
    return ["cluster", "--etcd", etcd.endpoint, "--cluster-name", name, *map(str, args)]


# ---------------------------------------------------------------------- views


def test_nodes_shows_health_copies_and_the_orchestrator(etcd: EtcdProcess, name: str) -> None:
    seed(etcd, name)
    doc = ok_json(*cluster(etcd, name, "nodes"))
    rows = {r["node"]: r for r in doc["nodes"]}
    assert [r["node"] for r in doc["nodes"]] == ["n1", "n2", "n3"]
    assert rows["n1"] | {} == {
        "node": "n1",
        "address": "127.0.0.1:11210",
        "state": "up",
        "member": True,
        "actives": 3,
        "replicas": 2,
        "orchestrator": True,
        "down_for": None,
    }
    assert (rows["n2"]["actives"], rows["n2"]["replicas"], rows["n2"]["orchestrator"]) == (
        3,
        3,
        False,
    )
    assert rows["n3"]["state"] == "down"
    assert 12.5 <= rows["n3"]["down_for"] < 30  # aged by the status's "updated"
    assert doc["unavailable"] == "7"
    assert doc["autofailover"] == {"count": 1, "failed_over": ["n3"], "max": 1}
    text = ok(*cluster(etcd, name, "nodes"))
    assert re.search(r"n3\s+│\s+127\.0\.0\.1:11212\s+│\s+down\s+│\s+1\s+│\s+3\s+│", text), text
    assert "cluster " + name + ": 3 nodes, 2 up" in text
    assert "orchestrator n1 (term" in text
    assert "unavailable vbuckets (no active copy): 7" in text
    assert "auto-failover: 1 of 1 used (failed over: n3)" in text


def test_map_compact_with_a_move_in_flight(etcd: EtcdProcess, name: str) -> None:
    forward = [["n3", "n2"]] * 2 + CHAINS[2:]  # vb 0 and 1 move their active to n3
    seed(etcd, name, forward=forward)
    doc = ok_json(*cluster(etcd, name, "map", "--chains"))
    assert doc["revision"] > 0 and doc["num_vbuckets"] == 8 and doc["num_replicas"] == 1
    assert {n["node"]: (n["actives"], n["replicas"]) for n in doc["nodes"]} == {
        "n1": (3, 2),
        "n2": (3, 3),
        "n3": (1, 3),
    }
    assert {n["node"]: (n["actives_after"], n["replicas_after"]) for n in doc["nodes"]} == {
        "n1": (1, 2),
        "n2": (3, 3),
        "n3": (3, 3),
    }
    assert (doc["unavailable"], doc["moving"]) == ("7", "0-1")
    assert doc["moves"] == [{"from": "n1,n2", "to": "n3,n2", "count": 2, "vbuckets": "0-1"}]
    assert doc["chains"][:3] == [
        {"chain": "n1,n2", "count": 3, "vbuckets": "0-2"},
        {"chain": "n2,n3", "count": 3, "vbuckets": "3-5"},
        {"chain": "n3,n1", "count": 1, "vbuckets": "6"},
    ]
    assert doc["chains"][3] == {"chain": "-,n1", "count": 1, "vbuckets": "7"}
    text = ok(*cluster(etcd, name, "map"))
    assert "unavailable (no active copy): 1 vbuckets: 7" in text
    assert "moving: 2 vbuckets: 0-1" in text
    assert re.search(r"n1,n2\s+│\s+n3,n2\s+│\s+2\s+│\s+0-1", text), text


def test_no_cluster_no_map_and_a_bad_map(etcd: EtcdProcess, name: str) -> None:
    line = fails(*cluster(etcd, name, "nodes"))
    assert line == (
        f"dcpctl: no cluster '{name}' in etcd at {etcd.endpoint} "
        f"(no /dcp/{name}/meta; --cluster-name?)"
    )
    put(etcd, name, "meta", {"cluster_id": "cid", "num_vbuckets": 8})
    assert (
        ok(*cluster(etcd, name, "map")).strip()
        == f"cluster {name} has no map yet (the orchestrator writes the first)"
    )
    put(etcd, name, "map", b'{"numVBuckets": 2}')
    assert "unreadable map" in fails(*cluster(etcd, name, "map"))
    assert "warning: map (revision" in ok(*cluster(etcd, name, "nodes"))  # still a view


def test_etcd_not_answering_is_one_line() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    line = fails("cluster", "--etcd", url, "nodes")
    reason = "connection refused (--etcd URL or env DCP_CLUSTER)"
    assert line == f"dcpctl: etcd at {url} does not answer: {reason}"
    assert time.monotonic() - started < 15
    assert fails("cluster", "nodes", env={"DCP_CLUSTER": url}) == line
    assert "must be http://HOST:PORT" in fails("cluster", "--etcd", "nowhere", "map", code=2)


# ---------------------------------------------------------------------- requests


def test_rebalance_request_is_create_only(etcd: EtcdProcess, name: str) -> None:
    seed(etcd, name)
    out = ok(*cluster(etcd, name, "rebalance", "--eject", "n3", "--no-wait"))
    req = get(etcd, name, "requests/rebalance")
    assert set(req) == {"id", "eject"} and req["eject"] == ["n3"]
    assert re.fullmatch(r"[0-9a-f]{32}", req["id"])
    assert out.strip() == f"rebalance requested (id {req['id']}, ejecting n3)"
    line = fails(*cluster(etcd, name, "rebalance", "--no-wait"))
    assert line.startswith(f"dcpctl: a rebalance request is already pending (id {req['id']})")
    assert get(etcd, name, "requests/rebalance") == req  # the first one is kept
    assert f"pending request: rebalance (id {req['id']})" in ok(*cluster(etcd, name, "nodes"))


def test_rebalance_refuses_unknown_or_every_node(etcd: EtcdProcess, name: str) -> None:
    seed(etcd, name)
    line = fails(*cluster(etcd, name, "rebalance", "--eject", "n9", "--no-wait"))
    assert line == f"dcpctl: unknown node 'n9' in cluster {name} (nodes: n1, n2, n3)"
    line = fails(*cluster(etcd, name, "rebalance", "--eject", *NODES, "--no-wait"))
    assert line == "dcpctl: cannot eject every node of the cluster"
    assert get(etcd, name, "requests/rebalance") is None


def _popen(etcd: EtcdProcess, name: str, *args: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*DCPCTL, *cluster(etcd, name, *args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _take(etcd: EtcdProcess, name: str, rel: str) -> dict[str, Any]:
    """What the orchestrator does first: read the request and delete it."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        req = get(etcd, name, rel)
        if req is not None:
            _call(etcd.endpoint, "delete", f"/dcp/{name}/{rel}")
            return dict(req)
        time.sleep(0.05)
    raise AssertionError(f"dcpctl wrote no {rel}")


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    return proc.returncode, out, err


def _status(etcd: EtcdProcess, name: str, **parts: Any) -> None:
    put(etcd, name, "status", {"orchestrator": "n1", "term": 5, "updated": time.time(), **parts})


def test_rebalance_follows_its_own_status_to_done(etcd: EtcdProcess, name: str) -> None:
    seed(etcd, name)
    proc = _popen(etcd, name, "rebalance")
    try:
        rid = _take(etcd, name, "requests/rebalance")["id"]
        other = {"id": "someone-else", "state": "done", "total": 1, "done": 1, "message": ""}
        _status(etcd, name, rebalance=other)  # not this request: the wait goes on
        time.sleep(1.0)
        assert proc.poll() is None
        running = {"id": rid, "state": "running", "total": 8, "done": 3, "message": "batch 1"}
        _status(etcd, name, rebalance={**running, "started": 100.0, "finished": None})
        time.sleep(1.0)
        assert proc.poll() is None
        done = {**running, "state": "done", "done": 8, "message": "", "started": 100.0}
        _status(etcd, name, rebalance={**done, "finished": 102.5})
        code, out, err = _finish(proc)
    finally:
        proc.kill()
    assert code == 0, (out, err)
    assert f"rebalance requested (id {rid}); following its progress" in out
    assert "rebalance: 3/8 vbuckets (batch 1)" in out  # piped: lines, not a bar
    assert out.strip().endswith("rebalance done: 8/8 vbuckets moved in 2.5 s")


def test_rebalance_failed_exits_1_with_the_reason(etcd: EtcdProcess, name: str) -> None:
    seed(etcd, name)
    proc = _popen(etcd, name, "rebalance", "--json")
    try:
        rid = _take(etcd, name, "requests/rebalance")["id"]
        failed = {"id": rid, "state": "failed", "total": 8, "done": 2, "message": "n2 unreachable"}
        _status(etcd, name, rebalance=failed)
        code, out, _ = _finish(proc)
    finally:
        proc.kill()
    assert code == 1 and json.loads(out) == failed
    proc = _popen(etcd, name, "rebalance")
    try:
        rid = _take(etcd, name, "requests/rebalance")["id"]
        _status(etcd, name, rebalance={**failed, "id": rid})
        code, _, err = _finish(proc)
    finally:
        proc.kill()
    assert code == 1 and err.strip() == "dcpctl: rebalance failed: n2 unreachable"


def test_failover_waits_for_its_own_outcome(etcd: EtcdProcess, name: str) -> None:
    seed(etcd, name)
    proc = _popen(etcd, name, "failover", "n3")
    try:
        req = _take(etcd, name, "requests/failover")
        assert req == {"id": req["id"], "node": "n3", "graceful": False}
        base = {"node": "n3", "auto": False}
        _status(etcd, name, failover={**base, "id": "old", "state": "done", "message": "x"})
        time.sleep(1.0)
        assert proc.poll() is None
        why = "vb 7 has no replica to promote"
        _status(etcd, name, failover={**base, "id": req["id"], "state": "refused", "message": why})
        code, out, err = _finish(proc)
    finally:
        proc.kill()
    assert code == 1 and err.strip() == f"dcpctl: hard failover of n3 refused: {why}"
    assert f"hard failover of n3 requested (id {req['id']}); waiting for it" in out
    assert f"last failover of n3: refused ({why})" in ok(*cluster(etcd, name, "nodes"))
    proc = _popen(etcd, name, "failover", "n1", "--graceful")
    try:
        req = _take(etcd, name, "requests/failover")
        assert (req["node"], req["graceful"]) == ("n1", True)
        msg = "3 actives handed over"
        _status(etcd, name, failover={**base, "id": req["id"], "state": "done", "message": msg})
        code, out, err = _finish(proc)
    finally:
        proc.kill()
    assert code == 0, err
    assert out.strip().endswith(f"graceful failover of n1 done: {msg}")


def test_failover_refusals_before_any_request(etcd: EtcdProcess, name: str) -> None:
    seed(etcd, name)
    assert "unknown node 'n7'" in fails(*cluster(etcd, name, "failover", "n7"))
    line = fails(*cluster(etcd, name, "failover", "n3", "--graceful"))
    assert line.startswith("dcpctl: a graceful failover needs n3 up (it is down)")
    assert get(etcd, name, "requests/failover") is None
    line = fails(*cluster(etcd, name, "failover", "n3", "--wait-timeout", "1.5"))  # no orchestrator
    assert line.startswith("dcpctl: no outcome within 1.5 s; the request may still be pending")
    assert get(etcd, name, "requests/failover")["node"] == "n3"
    line = fails(*cluster(etcd, name, "failover", "n2"))
    assert line.startswith("dcpctl: a failover request is already pending")


def test_reset_autofailover(etcd: EtcdProcess, name: str) -> None:
    seed(etcd, name)
    out = ok(*cluster(etcd, name, "reset-autofailover"))
    assert out.strip() == "auto-failover count reset to 0 (was 1; failed over: n3)"
    assert get(etcd, name, "autofailover") is None  # absent = count 0
    assert (
        ok(*cluster(etcd, name, "reset-autofailover")).strip() == "auto-failover count is already 0"
    )
    assert ok_json(*cluster(etcd, name, "nodes"))["autofailover"]["count"] == 0
