"""VBucketMap's JSON: round trip, every malformed map refused with a message naming the
problem; bucket_config: the Couchbase-style config clients route with."""

from __future__ import annotations

import json
import zlib

import pytest

from dcp.producer.cluster.placement import compute_map
from dcp.producer.cluster.vbmap import VBucketMap, bucket_config, split_address


def doc(**over: object) -> bytes:
    d: dict[str, object] = {
        "numVBuckets": 2,
        "numReplicas": 1,
        "serverList": ["a", "b"],
        "vBucketMap": [[0, 1], [1, -1]],
    }
    d.update(over)
    return json.dumps(d).encode()


def test_round_trip_and_reading() -> None:
    m = VBucketMap.from_json(doc(), known={"a", "b", "c"})
    assert m.names(1) == ("b", None)
    assert m.active(0) == "a" and m.replicas(0) == ["b"] and m.replicas(1) == []
    assert m.counts() == {"a": (1, 0), "b": (1, 1)}
    assert VBucketMap.from_json(m.to_json()) == m
    holed = VBucketMap.from_json(doc(vBucketMap=[[-1, 1], [1, -1]]))
    assert holed.unavailable() == [0]


@pytest.mark.parametrize(
    ("data", "known", "message"),
    [
        (b"{not json", None, "not JSON"),
        (b"[]", None, "JSON object"),
        (json.dumps({"numVBuckets": 2}).encode(), None, "lacks numReplicas, serverList"),
        (doc(), {"a"}, "unknown node\\(s\\): b"),
        (doc(numVBuckets=3), None, "2 chains for numVBuckets 3"),
        (doc(numVBuckets="2"), None, "numVBuckets must be an integer"),
        (doc(numReplicas=-1), None, "numReplicas must be >= 0"),
        (doc(serverList=["a", "a"]), None, "duplicate"),
        (doc(serverList="ab"), None, "serverList must be a list"),
        (doc(vBucketMap=[[0, 1], [1]]), None, r"vb 1: chain \[1\] is not 2 long"),
        (doc(vBucketMap=[[0, 2], [1, 0]]), None, "vb 0: .* points outside the 2 servers"),
        (doc(vBucketMap=[[0, 0], [1, 0]]), None, "vb 0: .* repeats a node"),
        (doc(vBucketMap=[[0, 1.5], [1, 0]]), None, "vb 0: .* non-integer"),
        (doc(vBucketMap=[[0, True], [1, 0]]), None, "vb 0: .* non-integer"),
        (doc(vBucketMap={"0": [0, 1]}), None, "vBucketMap must be a list"),
    ],
)
def test_malformed_maps_are_refused(data: bytes, known: set[str] | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        VBucketMap.from_json(data, known=known)


def test_from_names_checks_servers() -> None:
    with pytest.raises(ValueError, match="not in servers: z"):
        VBucketMap.from_names(1, [["a", "z"]], servers=["a"])
    with pytest.raises(ValueError, match="3 copies, more than 2"):
        VBucketMap.from_names(1, [["a", "b", "c"]])


def test_split_address() -> None:
    assert split_address("127.0.0.1:11210") == ("127.0.0.1", 11210)
    assert split_address("[::1]:11210") == ("::1", 11210)
    for bad in ("host", "host:", ":1", "h:0", "h:70000", "h:x"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            split_address(bad)


def test_bucket_config_routes_a_key() -> None:
    m = compute_map(["n1", "n2", "n3"], 64, 1)
    addresses = {"n1": "127.0.0.1:11210", "n2": "127.0.0.1:11211", "n3": "127.0.0.1:11212"}
    cfg = json.loads(json.dumps(bucket_config(m, addresses, 42, "n2", bucket_uuid="u")))
    assert cfg["rev"] == 42 and cfg["nodeLocator"] == "vbucket" and cfg["uuid"] == "u"
    assert cfg["numVBuckets"] == 64
    sm = cfg["vBucketServerMap"]
    assert sm["hashAlgorithm"] == "CRC" and sm["numReplicas"] == 1
    assert sm["serverList"] == [addresses[n] for n in m.servers]
    assert [n["hostname"] for n in cfg["nodes"]] == sm["serverList"]
    assert [e["services"]["kv"] for e in cfg["nodesExt"]] == [11210, 11211, 11212]
    assert [e.get("thisNode", False) for e in cfg["nodesExt"]] == [False, True, False]
    # a client's routing: crc32 -> vbucket -> serverList[chain[0]]
    key = b"user::1"
    vb = ((zlib.crc32(key) >> 16) & 0x7FFF) % len(sm["vBucketMap"])
    assert sm["serverList"][sm["vBucketMap"][vb][0]] == addresses[m.active(vb) or ""]


def test_bucket_config_needs_every_address() -> None:
    m = compute_map(["n1", "n2"], 4, 1)
    with pytest.raises(ValueError, match="no address for map server\\(s\\): n2"):
        bucket_config(m, {"n1": "127.0.0.1:1"}, 1, None)


def test_forward_chains_round_trip_and_name_what_moves():
    m = VBucketMap.from_names(1, [("a", "b"), ("b", "a")], forward=[("a", "b"), ("c", "a")])
    assert m.servers == ("a", "b", "c")
    assert m.moving() == [1]
    assert m.forward_names(0) is None
    assert m.forward_names(1) == ("c", "a")
    back = VBucketMap.from_json(m.to_json())
    assert back == m and back.forward == ((0, 1), (2, 0))
    assert b'"vBucketMapForward":[[0,1],[2,0]]' in m.to_json()
    config = bucket_config(m, {"a": "h:1", "b": "h:2", "c": "h:3"}, 7, "a")
    assert config["vBucketServerMap"]["vBucketMapForward"] == [[0, 1], [2, 0]]
    plain = VBucketMap.from_names(1, [("a", "b"), ("b", "a")])
    assert plain.moving() == [] and b"Forward" not in plain.to_json()
    assert (
        "vBucketMapForward"
        not in bucket_config(plain, {"a": "h:1", "b": "h:2"}, 1, None)["vBucketServerMap"]
    )


def test_a_forward_chain_that_repeats_a_node_is_refused():
    with pytest.raises(ValueError, match="repeats a node"):
        VBucketMap.from_names(1, [("a", "b")], forward=[("a", "a")])
    doc = json.loads(VBucketMap.from_names(1, [("a", "b")]).to_json())
    doc["vBucketMapForward"] = [[0, 5]]
    with pytest.raises(ValueError, match="points outside"):
        VBucketMap.from_json(json.dumps(doc))
