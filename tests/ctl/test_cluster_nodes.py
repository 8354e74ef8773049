"""dcpctl through any node of a cluster, against fake nodes that serve a cluster config
(GET_CLUSTER_CONFIG): aggregation with a node column, the node a one-node command asks,
an unreachable node (shown, exit status 3), ``dcpctl map``, and the single-node path left
as it was (one-server config, UNKNOWN_COMMAND, a malformed config ignored with a warning).

The same commands against a real cluster on etcd, with a kill -9, are in
tests/cluster_etcd/test_dcpctl_cluster.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from dcp.protocol import Status, VBucketState

from .fake_node import FakeNode, make_config
from .support import ctl, fails, free_port, ok, ok_json, table_header, table_rows

A, R, D = VBucketState.ACTIVE, VBucketState.REPLICA, VBucketState.DEAD
CHAINS = [[0, 1], [0, 1], [1, 0], [1, 0]]


def _serve(node: FakeNode, config: bytes) -> None:
    node.cluster_config = (Status.SUCCESS, config)


@pytest.fixture
def pair() -> Iterator[tuple[FakeNode, FakeNode]]:
    """n1 holds vb 0-1 active and 2-3 replica; n2 the other way round (map rev 7)."""
    peers: dict[str, FakeNode] = {}
    a, b = FakeNode(4, peers), FakeNode(4, peers)
    b.uuid_base = 2000
    a.states.update({0: A, 1: A, 2: R, 3: R})
    b.states.update({0: R, 1: R, 2: A, 3: A})
    a.high.update({0: 4, 1: 1, 2: 3, 3: 0})
    b.high.update({0: 4, 1: 1, 2: 5, 3: 0})
    a.replication[2] = {"source": b.address, "stream": "streaming", "source_seqno": 5}
    config = make_config([a.address, b.address], CHAINS)
    _serve(a, config)
    _serve(b, config)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _host(*nodes: FakeNode | str) -> list[str]:
    return ["--host", ",".join(n if isinstance(n, str) else n.address for n in nodes)]


def test_vbuckets_shows_every_copy_on_every_node_with_a_node_column(pair) -> None:
    a, b = pair
    doc = ok_json(*_host(a), "vbuckets")  # one address: the config names two nodes
    got = [(r["vbucket"], r["node_name"], r["state"], r["vb_uuid"]) for r in doc["vbuckets"]]
    assert got == [
        (0, "n1", "active", 1000),
        (0, "n2", "replica", 2000),
        (1, "n1", "active", 1001),
        (1, "n2", "replica", 2001),
        (2, "n2", "active", 2002),
        (2, "n1", "replica", 1002),
        (3, "n2", "active", 2003),
        (3, "n1", "replica", 1003),
    ]
    assert {r["node"] for r in doc["vbuckets"]} == {a.address, b.address}
    assert doc["map_rev"] == 7 and doc["unreachable"] == []
    assert doc["totals"]["nodes"] == 2 and doc["totals"]["states"] == {"active": 4, "replica": 4}
    # the replica's source is n2, already asked: its lag is against n2's high seqno
    (rep,) = [r for r in doc["vbuckets"] if r["vbucket"] == 2 and r["node_name"] == "n1"]
    assert (rep["source"], rep["source_high_seqno"], rep["lag"]) == (b.address, 5, 2)

    text = ok(*_host(a), "vbuckets")
    assert "4 vbuckets, 8 copies on 2 nodes, map rev 7" in text
    assert table_header(text)[:3] == ["vb", "node", "state"]
    assert [r[:3] for r in table_rows(text)][:2] == [["0", "n1", "active"], ["0", "n2", "replica"]]

    actives = ok_json(*_host(b, a), "vbuckets", "--active")["vbuckets"]
    assert [(r["vbucket"], r["node_name"]) for r in actives] == [
        (0, "n1"),
        (1, "n1"),
        (2, "n2"),
        (3, "n2"),
    ]
    assert "vbucket 4 does not exist (the cluster has 0..3)" in fails(
        *_host(a), "vbuckets", "--vb", "4"
    )


def test_a_node_that_does_not_answer_is_shown_and_the_exit_status_says_partial(pair) -> None:
    a, b = pair
    dead = f"127.0.0.1:{free_port()}"
    config = make_config([a.address, b.address, dead], [[0, 1], [2, 0], [1, 2], [2, 1]])
    _serve(a, config)
    _serve(b, config)
    r = ctl(*_host(a), "vbuckets")
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [
        f"dcpctl: partial output: 1 of 3 nodes did not answer (n3 ({dead}))"
    ]
    assert (
        f"n3 ({dead}) unreachable: cannot connect to {dead}: connection refused "
        "(active in the map for vb 1,3)" in r.stdout
    )
    assert "3 vbuckets" not in r.stdout and "on 2 nodes, map rev 7" in r.stdout

    r = ctl(*_host(a), "vbuckets", "--json")
    assert r.returncode == 3
    doc = json.loads(r.stdout)
    (gone,) = doc["unreachable"]
    assert (gone["node"], gone["node_name"], gone["actives_in_map"]) == (dead, "n3", [1, 3])
    assert "connection refused" in gone["error"]

    for cmd in ("streams", "connections"):
        r = ctl(*_host(a), cmd)
        assert r.returncode == 3 and f"n3 ({dead}) unreachable: cannot connect" in r.stdout
    # a one-node command asked about a vbucket whose active is gone fails with one line
    assert fails(*_host(a), "failover-log", "1") == (
        f"dcpctl: n3 ({dead}): cannot connect to {dead}: connection refused"
    )


def test_streams_and_connections_of_every_node_carry_the_node(pair) -> None:
    a, b = pair
    for node, conn_id in ((a, 5), (b, 9)):
        conn = {
            "id": conn_id,
            "name": "app",
            "peer": "127.0.0.1:5000",
            "agent": "sdk",
            "streams": 1,
            "flow_control": "space_available",
            "window": 100,
            "unacked_bytes": 0,
            "noop_enabled": False,
            "bytes_out": 10,
            "paused": False,
        }
        vb = 0 if node is a else 2
        stream = {
            "connection": "app",
            "connection_id": conn_id,
            "vbucket": vb,
            "state": "in-memory",
            "start_seqno": 0,
            "end_seqno": 2**64 - 1,
            "last_sent_seqno": 1,
            "high_seqno": 4,
            "lag": 3,
            "items_sent": 1,
            "backfills": 0,
            "cursor_drops": 0,
        }
        node.dcp_streams = [
            (f"conn:{conn_id}", json.dumps(conn)),
            (f"stream:{conn_id}:{vb}", json.dumps(stream)),
        ]
    streams = ok_json(*_host(a), "streams")["streams"]
    assert [(s["node_name"], s["vbucket"], s["node"]) for s in streams] == [
        ("n1", 0, a.address),
        ("n2", 2, b.address),
    ]
    conns = ok_json(*_host(a), "connections")["connections"]
    assert [(c["node_name"], c["id"], c["stream_list"]) for c in conns] == [
        ("n1", 5, [0]),
        ("n2", 9, [2]),
    ]
    text = ok(*_host(a), "streams")
    assert table_header(text)[:2] == ["node", "connection"]
    assert "2 DCP streams on 2 nodes" in text
    assert table_header(ok(*_host(a), "connections"))[:2] == ["node", "id"]


def test_one_node_commands_ask_the_vbuckets_active_or_the_node_named(pair) -> None:
    a, b = pair
    a.general, b.general = {"who": "a"}, {"who": "b"}
    doc = ok_json(*_host(a), "failover-log", "2")  # vb 2 is active on n2
    assert (doc["node_name"], doc["entries"][0]["vb_uuid"]) == ("n2", 2002)
    assert f"vb 2, active copy on n2 ({b.address})" in ok(*_host(a), "failover-log", "2")
    doc = ok_json(*_host(a), "failover-log", "2", "--node", "n1")
    assert (doc["node"], doc["entries"][0]["vb_uuid"]) == (a.address, 1002)
    assert f"vb 2, replica copy on n1 ({a.address})" in ok(
        *_host(a), "failover-log", "2", "--node", a.address
    )
    assert ok_json(*_host(a), "checkpoints", "3")["node_name"] == "n2"

    assert ok_json(*_host(a), "stats")["stats"]["who"] == "a"  # the node that answered
    doc = ok_json(*_host(a), "stats", "--node", "n2")
    assert (doc["node"], doc["stats"]["who"]) == (b.address, "b")
    assert f"from n2 ({b.address})" in ok(*_host(a), "stats", "--node", b.address)
    assert "no node of that name" in fails(*_host(a), "stats", "--node", "n7", code=2)

    _serve(a, make_config([a.address, b.address], [[0, 1], [0, 1], [-1, 0], [1, 0]], rev=8))
    line = fails(*_host(a), "failover-log", "2")
    assert "vb 2 has no active copy in map rev 8" in line and f"n1 ({a.address})" in line


def test_map_shows_nodes_actives_replicas_and_each_nodes_own_revision(pair) -> None:
    a, b = pair
    doc = ok_json(*_host(a), "map")
    assert (doc["rev"], doc["from"], doc["num_vbuckets"], doc["num_replicas"]) == (
        7,
        a.address,
        4,
        1,
    )
    nodes = [(n["node_name"], n["actives"], n["replicas"], n["rev"]) for n in doc["nodes"]]
    assert nodes == [("n1", [0, 1], [2, 3], 7), ("n2", [2, 3], [0, 1], 7)]
    text = ok(*_host(a), "map")
    assert f"map rev 7 from n1 ({a.address}): 2 nodes, 4 vbuckets, 1 replica per vbucket" in text
    assert table_rows(text) == [
        ["n1", a.address, "2", "2", "0-1", "serves rev 7"],
        ["n2", b.address, "2", "2", "2-3", "serves rev 7"],
    ]

    # n1 lags behind: the newest map is shown (from n2), n1's own revision says so
    _serve(a, make_config([a.address, b.address], CHAINS, rev=6))
    _serve(b, make_config([a.address, b.address], [[0, 1], [1, 0], [1, 0], [1, 0]], rev=9))
    doc = ok_json(*_host(a), "map")
    assert (doc["rev"], doc["from"]) == (9, b.address)
    assert [n["actives"] for n in doc["nodes"]] == [[0], [1, 2, 3]]
    assert table_rows(ok(*_host(a), "map"))[0][-1] == "serves rev 6 (older)"


def test_map_after_a_failover_names_the_gone_node_absent_not_partial(pair) -> None:
    a, b = pair
    gone = f"127.0.0.1:{free_port()}"
    # the map no longer names the failed node; the operator still lists it in --host
    r = ctl(*_host(gone, a), "map")
    assert r.returncode == 0, r.stderr
    rows = table_rows(r.stdout)
    assert rows[-1][:2] == ["-", gone]
    assert (
        rows[-1][-1] == f"not in the map; unreachable: cannot connect to {gone}: connection refused"
    )
    doc = ok_json(*_host(gone, a), "map")
    assert [(n["node"], n["in_map"], n["reachable"]) for n in doc["nodes"]][-1] == (
        gone,
        False,
        False,
    )
    # while the map still names it, the node is unreachable and the output partial
    config = make_config([a.address, b.address, gone], [[0, 2], [2, 0], [1, 0], [1, 2]], rev=8)
    _serve(a, config)
    _serve(b, config)
    r = ctl(*_host(a), "map")
    assert r.returncode == 3 and "Traceback" not in r.stderr
    assert table_rows(r.stdout)[2][:5] == ["n3", gone, "1", "2", "1"]
    assert "unreachable: cannot connect" in table_rows(r.stdout)[2][5]


def test_a_single_node_is_shown_as_before_whatever_it_answers(pair) -> None:
    a, _b = pair
    plain = ok_json(*_host(a), "vbuckets", "--vb", "0")  # the pair's map first
    assert plain["vbuckets"][0]["node"] == a.address
    for answer in (
        None,  # an older server: UNKNOWN_COMMAND
        (Status.SUCCESS, make_config(["0.0.0.0:11210"], [[0]] * 4, rev=1)),  # unusable text
        (Status.ETMPFAIL, b""),  # a cluster node without a map yet
    ):
        a.cluster_config = answer
        r = ctl(*_host(a), "vbuckets", "--json")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert [v["vbucket"] for v in doc["vbuckets"]] == [0, 1, 2, 3]
        assert "node" not in doc["vbuckets"][0] and "unreachable" not in doc
        assert f"4 vbuckets on {a.address}" in ok(*_host(a), "vbuckets")
        assert "node" not in ok_json(*_host(a), "stats")
        assert ("no cluster map yet" in r.stderr) == (answer is not None and answer[0] != 0)
    # in a list, a one-server map names the node reached, not its serverList text
    a.cluster_config = (Status.SUCCESS, make_config(["0.0.0.0:11210"], [[0]] * 4, rev=1))
    doc = ok_json(*_host(a, _b), "vbuckets")
    assert {r["node"] for r in doc["vbuckets"]} == {a.address} and len(doc["vbuckets"]) == 4
    assert ok_json(*_host(a, _b), "map")["nodes"][0]["node"] == a.address


def test_a_malformed_config_is_ignored_with_a_warning(pair) -> None:
    a, b = pair
    a.cluster_config = (Status.SUCCESS, b'{"rev": 9, "vBucketServerMap": {"serverList": []}}')
    r = ctl(*_host(a), "vbuckets", "--json")
    assert r.returncode == 0 and "Traceback" not in r.stderr
    assert f"dcpctl: warning: {a.address} sent a malformed cluster config" in r.stderr
    assert "node" not in json.loads(r.stdout)["vbuckets"][0]  # single node, as before
    # with a list, the next node's config is used
    r = ctl(*_host(a, b), "vbuckets", "--json")
    assert r.returncode == 0 and "malformed" in r.stderr
    assert len(json.loads(r.stdout)["vbuckets"]) == 8


def test_bootstrap_lists_the_user_gets_wrong_or_that_do_not_answer() -> None:
    assert "--host" in fails("--host", "a:1,b:x", "vbuckets", code=2)
    assert "talks to one node" in fails("--host", "a:1,b:2", "set-state", "0", "active", code=2)
    p1, p2 = free_port(), free_port()
    line = fails("--host", f"127.0.0.1:{p1},127.0.0.1:{p2}", "vbuckets")
    assert line.startswith("dcpctl: no node of 2 answered: cannot connect to 127.0.0.1:")
    assert str(p1) in line and str(p2) in line
    # a bare host takes --port; one address keeps its usual error
    assert fails("--host", "127.0.0.1", "--port", str(p1), "vbuckets") == (
        f"dcpctl: cannot connect to 127.0.0.1:{p1}: connection refused"
    )
