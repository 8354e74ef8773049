"""The connector on a cluster, without Spark: planning per node, tasks grouped per node,
and ranges that follow their vbucket to a new owner (re-read on its branch, the rollback
policy off it).

Two real in-process servers stand for two nodes (``cluster_helpers``): the test sets
vbucket states on them (a replica really replicates) and serves the map from a config
server of its own, so it decides exactly when the map moves a vbucket.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dcp.spark.batch_plan import VbRange, branch_uuid, group_by_node, plan_ranges
from dcp.spark.changes import OP_ROLLBACK
from dcp.spark.cluster import Topology
from dcp.spark.driver import Planner
from dcp.spark.errors import RangeUnavailableError, RollbackDetectedError
from dcp.spark.executor import read_ranges
from dcp.spark.offsets import VbPosition, earliest
from dcp.spark.options import SourceConfig, parse_options

from .cluster_helpers import (
    ACTIVE,
    DEAD,
    REPLICA,
    ConfigServer,
    bucket_config,
    failover_log,
    high_seqnos,
    keys_in,
    replicate,
    set_state,
)
from .helpers import ThreadServer
from .test_executor import _rows

NVB = 4


class Pair:
    """Nodes ``a`` and ``b``; by the map (rev 10) vbuckets 0, 1 are active on ``a`` and
    2, 3 on ``b``, each node's other vbuckets dead."""

    def __init__(self, root: Path) -> None:
        self.a = ThreadServer(root / "a", num_vbuckets=NVB)
        self.b = ThreadServer(root / "b", num_vbuckets=NVB)
        self.ports = [self.a.port, self.b.port]
        self.config = ConfigServer(bucket_config(10, self.ports, [0, 0, 1, 1]))
        for vb in (2, 3):
            set_state(self.a, vb, DEAD)
        for vb in (0, 1):
            set_state(self.b, vb, DEAD)

    def addr(self, server: ThreadServer) -> tuple[str, int]:
        return ("127.0.0.1", server.port)

    def cfg(self, **opts: str) -> SourceConfig:
        base = {"host": f"127.0.0.1:{self.config.port}", "retryTimeout": "5"}
        return parse_options({**base, **opts}, streaming=True)

    def move(self, vb: int, to: int, rev: int) -> None:
        """The map now says ``vb`` is active on server index ``to``."""
        actives = [c[0] for c in self.config.config["vBucketServerMap"]["vBucketMap"]]
        actives[vb] = to
        self.config.config = bucket_config(rev, self.ports, actives)

    def close(self) -> None:
        self.config.close()
        self.a.stop()
        self.b.stop()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    p = Pair(tmp_path)
    yield p
    p.close()


def _write(server: ThreadServer, vb: int, n: int, value: bytes, start: int = 0) -> None:
    with server.kv() as kv:
        kv.set_many({k: value for k in keys_in(vb, start + n, NVB)[start:]})


def _state(rows: list[tuple]) -> dict[bytes, bytes | None]:
    out: dict[bytes, bytes | None] = {}
    for _vb, _s, op, key, value, *_ in sorted(rows, key=lambda r: (r[0], r[1])):
        out[key] = value if op == 0 else None
    return out


def test_planning_asks_each_node_for_its_actives_and_tasks_read_on_their_node(pair):
    _write(pair.a, 0, 20, b"a0")
    _write(pair.a, 1, 30, b"a1")
    _write(pair.b, 2, 40, b"b2")
    _write(pair.b, 3, 50, b"b3")
    cfg = pair.cfg(numPartitions="3")
    planner = Planner(cfg)
    try:
        highs, logs = planner.refresh(force=True)
        owners = planner.owners()
    finally:
        planner.close()
    # each vbucket's high seqno and failover log are its active node's (the dead copies
    # on the other node hold nothing and must not be asked)
    assert highs == {0: 20, 1: 30, 2: 40, 3: 50}
    assert [list(logs[vb]) for vb in (0, 1)] == [failover_log(pair.a, vb) for vb in (0, 1)]
    assert [list(logs[vb]) for vb in (2, 3)] == [failover_log(pair.b, vb) for vb in (2, 3)]
    a, b = pair.addr(pair.a), pair.addr(pair.b)
    assert owners == {0: a, 1: a, 2: b, 3: b}
    start = earliest(range(NVB))
    end = {vb: VbPosition(logs[vb][0][0], h) for vb, h in highs.items()}
    tasks = group_by_node(plan_ranges(start, end), owners, cfg.partitions)
    nodes = [node for node, _ in tasks]
    assert (nodes.count(a), nodes.count(b)) == (1, 2)  # 3 tasks by weight: b has 90 of 140
    for node, ranges in tasks:
        assert {owners[r.vbucket] for r in ranges} == {node}
    rows = [r for node, rs in tasks for r in _rows(list(read_ranges(cfg, rs, "t", node)))]
    state = _state(rows)
    assert len(state) == 140
    assert {v for k, v in state.items() if k.startswith(b"k")} == {b"a0", b"a1", b"b2", b"b3"}


def test_group_by_node_without_a_cluster_is_the_single_server_grouping():
    ranges = [VbRange(vb, 1, 0, 10 + vb) for vb in range(8)]
    assert [n for n, _ in group_by_node(ranges, None, 3)] == [None, None, None]
    one = {vb: ("h", 1) for vb in range(8)}
    two = {vb: ("h", 1 + vb % 2) for vb in range(8)}
    assert len(group_by_node(ranges, one, 3)) == 3
    got = group_by_node(ranges, two, 1)  # one task per node at least
    assert [n for n, _ in got] == [("h", 1), ("h", 2)]
    assert [[r.vbucket for r in g] for _, g in got] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_the_planner_follows_a_vbucket_to_its_new_active(pair):
    _write(pair.a, 0, 30, b"v1")
    planner = Planner(pair.cfg(planCacheMs="0"))
    try:
        highs, logs = planner.refresh(force=True)
        assert highs[0] == 30 and len(logs[0]) == 1
        replicate(pair.a, pair.b, 0)
        set_state(pair.b, 0, ACTIVE)  # promoted: a new branch at seqno 30
        set_state(pair.a, 0, DEAD)
        pair.move(0, 1, rev=11)
        _write(pair.b, 0, 5, b"v2", start=30)
        served = pair.config.served
        highs, logs = planner.refresh(force=True)
        assert highs[0] == 35  # asked of b, where the map now has it
        assert list(logs[0]) == failover_log(pair.b, 0) and len(logs[0]) == 2
        assert planner.owners()[0] == pair.addr(pair.b)
        assert pair.config.served > served  # a refreshes the map; no guessing
    finally:
        planner.close()


def test_a_node_that_disagrees_with_the_map_forever_is_a_clear_error_not_a_busy_loop(pair):
    # the map (never updated) still says a holds vb 0 active; a holds a replica copy, so
    # only asking for active vbuckets tells them apart
    set_state(pair.a, 0, REPLICA)
    planner = Planner(pair.cfg(retryTimeout="1"))
    t0 = time.monotonic()
    with pytest.raises(RangeUnavailableError) as info:
        planner.refresh(force=True)
    took = time.monotonic() - t0
    planner.close()
    assert "does not hold vbuckets [0] active" in str(info.value)
    assert "retryTimeout=1" in str(info.value) and "DCP cluster" in str(info.value)
    assert took < 5
    assert pair.config.served <= took / 0.1 + 3  # config fetches are rate-limited


def test_config_refreshes_are_rate_limited_and_a_newer_nmvb_config_is_used_at_once(pair):
    now = [100.0]
    topo = Topology(pair.cfg(), clock=lambda: now[0])
    topo.refresh()
    assert topo.cluster and topo.config is not None and topo.config.rev == 10
    served = pair.config.served
    for _ in range(50):  # a stale node answering NOT_MY_VBUCKET in a loop
        assert not topo.refresh(b"no vbucket 0")
    assert pair.config.served == served
    now[0] += 0.2
    assert not topo.refresh()  # asks again (nothing newer) after the interval
    assert pair.config.served == served + 1
    pair.move(0, 1, rev=12)
    import json

    assert topo.refresh(json.dumps(pair.config.config).encode())  # the NMVB's own config
    assert topo.config.rev == 12 and topo.owner(0) == pair.addr(pair.b)
    assert pair.config.served == served + 1
    assert not topo.refresh(json.dumps(bucket_config(11, pair.ports, [0] * NVB)).encode())
    assert topo.owner(0) == pair.addr(pair.b)  # an older config never replaces a newer one


def _planned(pair: Pair, vb: int) -> VbRange:
    planner = Planner(pair.cfg())
    try:
        highs, logs = planner.refresh(force=True)
    finally:
        planner.close()
    return VbRange(vb, logs[vb][0][0], 0, highs[vb], None, branch_uuid(logs[vb], highs[vb]))


def test_a_range_whose_vbucket_moved_is_read_whole_from_the_new_owner(pair):
    _write(pair.a, 0, 40, b"old")
    _write(pair.a, 0, 10, b"new")  # rewrites: the range holds versions, not just keys
    replicate(pair.a, pair.b, 0)
    rng = _planned(pair, 0)
    set_state(pair.b, 0, ACTIVE)  # failover: b's branch starts at the planned end
    set_state(pair.a, 0, DEAD)  # a answers NOT_MY_VBUCKET from now on
    pair.move(0, 1, rev=11)
    served = pair.config.served
    rows = _rows(list(read_ranges(pair.cfg(), [rng], "t", pair.addr(pair.a))))
    want = {k.encode(): (b"new" if i < 10 else b"old") for i, k in enumerate(keys_in(0, 40, NVB))}
    assert _state(rows) == want
    assert max(r[1] for r in rows) == rng.end == 50
    assert pair.config.served > served


def _read_in_thread(cfg: SourceConfig, rng: VbRange, node: tuple[str, int]) -> dict:
    out: dict = {}

    def run() -> None:
        try:
            out["rows"] = _rows(list(read_ranges(cfg, [rng], "t", node)))
        except Exception as exc:
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    out["thread"] = t
    return out


@pytest.mark.parametrize("policy", ["fail", "rewind"])
def test_a_range_off_the_new_owners_branch_goes_through_the_rollback_policy(pair, policy):
    """The stream is open on ``a`` when ``a`` gives the vbucket up (STATE_CHANGED); the map
    names ``b``, promoted at seqno 30 while ``a`` went on to 40: the rest of the range is
    not on ``b``'s branch, and the server says so (ROLLBACK), never a silent gap."""
    _write(pair.a, 0, 30, b"x")
    replicate(pair.a, pair.b, 0)
    set_state(pair.b, 0, ACTIVE)  # b's branch starts at 30
    _write(pair.a, 0, 10, b"y", start=30)  # a (still active for its clients) goes on to 40
    uuid_a = failover_log(pair.a, 0)[0][0]
    # a range planned past a's high seqno holds the stream open on a (an open-ended
    # stream waits for the planned end), so the move happens mid-read
    rng = VbRange(0, uuid_a, 0, 45, None, uuid_a)
    got = _read_in_thread(pair.cfg(onRollback=policy), rng, pair.addr(pair.a))
    time.sleep(1.0)
    assert "error" not in got and got["thread"].is_alive()
    pair.move(0, 1, rev=11)
    set_state(pair.a, 0, DEAD)  # ends a's stream: STATE_CHANGED
    got["thread"].join(20)
    assert not got["thread"].is_alive()
    if policy == "fail":
        err = got.get("error")
        assert isinstance(err, RollbackDetectedError), got
        assert (err.vbucket, err.vb_uuid, err.seqno, err.rollback_seqno) == (0, uuid_a, 40, 30)
        assert err.where == "reading"
    else:
        assert "error" not in got, got
        rows = got["rows"]
        assert [(r[0], r[2]) for r in rows] == [(0, OP_ROLLBACK)]  # the rollback row only
        assert rows[0][1] == 0  # to a change-set boundary at or below 30: the range start


def test_a_bootstrap_list_where_no_node_answers_names_every_address():
    ports = []
    for _ in range(2):
        with socket.socket() as s:  # ports nobody listens on
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    cfg = parse_options(
        {"host": f"127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}", "retryTimeout": "30"},
        streaming=True,
    )
    t0 = time.monotonic()
    with pytest.raises(RangeUnavailableError, match="refused the connection") as info:
        Planner(cfg).refresh(force=True)
    assert time.monotonic() - t0 < 5  # every address refused: at once, not after 30 s
    for p in ports:
        assert f"127.0.0.1:{p}" in str(info.value)


def test_a_single_server_is_read_as_before(tmp_path):
    """One address whose config names one server: no state filter, the given address."""
    s = ThreadServer(tmp_path / "d", num_vbuckets=NVB)
    try:
        set_state(s, 3, DEAD)
        planner = Planner(parse_options({"port": str(s.port)}, streaming=True))
        try:
            highs, _ = planner.refresh(force=True)
            assert sorted(highs) == [0, 1, 2] and planner.owners() is None
        finally:
            planner.close()
        assert high_seqnos(s) == highs
    finally:
        s.stop()


def test_a_single_server_reached_through_a_bootstrap_list_is_read_at_that_address(tmp_path):
    """The list's first address is dead; the second is a single server: planning and
    tasks go to the address that answered (a single server's map may name an address
    nobody can use, such as 0.0.0.0), and nothing waits on the dead one."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = sock.getsockname()[1]
    # the server's map names an address where nobody listens (as 0.0.0.0 would be)
    s = ThreadServer(tmp_path / "d", num_vbuckets=NVB, advertise=f"127.0.0.1:{dead}")
    try:
        _write(s, 1, 25, b"v")
        cfg = parse_options(
            {"host": f"127.0.0.1:{dead},127.0.0.1:{s.port}", "retryTimeout": "5"},
            streaming=True,
        )
        planner = Planner(cfg)
        try:
            highs, logs = planner.refresh(force=True)
            owners = planner.owners()
        finally:
            planner.close()
        assert highs == {0: 0, 1: 25, 2: 0, 3: 0}
        assert owners == dict.fromkeys(range(NVB), ("127.0.0.1", s.port))
        rng = VbRange(1, logs[1][0][0], 0, 25, None, logs[1][0][0])
        rows = _rows(list(read_ranges(cfg, [rng], "t", owners[1])))
        assert len(_state(rows)) == 25
    finally:
        s.stop()


def test_a_one_node_cluster_is_followed_when_a_node_joins(pair):
    # a cluster's map (rev from etcd) that names one node is still a cluster: a query
    # started on it must follow the map when a second node takes vbuckets over
    pair.config.config = bucket_config(10, [pair.a.port], [0] * NVB)
    now = [100.0]
    topo = Topology(pair.cfg(), clock=lambda: now[0])
    topo.refresh()
    assert topo.cluster and topo.owner(2) == pair.addr(pair.a)
    pair.config.config = bucket_config(11, pair.ports, [0, 0, 1, 0])  # vb 2 moved to b
    now[0] += 1.0
    assert topo.refresh()
    assert topo.config is not None and topo.config.rev == 11
    assert topo.owner(2) == pair.addr(pair.b)
