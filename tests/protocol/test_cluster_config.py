"""ClusterConfig: the bucket config clients route with (protocol_spec §6.9), parsed from
the golden vector's bytes and from what the server's own ``bucket_config`` builds; every
malformed shape refused with ConfigError (the caller keeps its old map)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dcp.protocol.cluster_config import (
    ClusterConfig,
    ConfigError,
    format_address,
    parse_address,
    parse_addresses,
)

VECTORS = Path(__file__).resolve().parents[2] / "protocol_spec" / "vectors"


def _vector_config() -> bytes:
    v = json.loads((VECTORS / "get_cluster_config_response.json").read_text())
    frame = bytes.fromhex(v["hex"])
    return frame[24:]  # header only: no extras or key, the value is the config


def test_the_golden_config_parses_and_routes() -> None:
    cfg = ClusterConfig.from_json(_vector_config())
    obj = json.loads(_vector_config())
    smap = obj["vBucketServerMap"]
    assert cfg.rev == obj["rev"]
    assert [format_address(a) for a in cfg.servers] == smap["serverList"]
    assert cfg.num_vbuckets == len(smap["vBucketMap"])
    for vb, chain in enumerate(smap["vBucketMap"]):
        want = parse_address(smap["serverList"][chain[0]]) if chain[0] >= 0 else None
        assert cfg.active(vb) == want
        assert cfg.replicas(vb) == [
            parse_address(smap["serverList"][i]) for i in chain[1:] if i >= 0
        ]
    by_node = cfg.actives_by_node()
    assert sorted(vb for vbs in by_node.values() for vb in vbs) == [
        vb for vb in range(cfg.num_vbuckets) if cfg.chains[vb][0] >= 0
    ]


def _config(**over: object) -> dict:
    base = {
        "rev": 7,
        "numVBuckets": 4,
        "vBucketServerMap": {
            "numReplicas": 1,
            "serverList": ["127.0.0.1:11210", "127.0.0.1:11211"],
            "vBucketMap": [[0, 1], [1, 0], [0, -1], [-1, 1]],
        },
        "nodesExt": [
            {"hostname": "127.0.0.1", "services": {"kv": 11210}, "nodeName": "n1"},
            {
                "hostname": "127.0.0.1",
                "services": {"kv": 11211},
                "nodeName": "n2",
                "thisNode": True,
            },
        ],
    }
    base.update(over)
    return base


def test_a_config_names_actives_replicas_and_the_answering_node() -> None:
    cfg = ClusterConfig.from_json(json.dumps(_config()))
    a, b = ("127.0.0.1", 11210), ("127.0.0.1", 11211)
    assert cfg.active(0) == a and cfg.replicas(0) == [b]
    assert cfg.active(3) is None and cfg.without_active() == [3]
    assert cfg.actives_by_node() == {a: [0, 2], b: [1]}
    assert cfg.this_node == b and cfg.name_of(a) == "n1"
    assert cfg.newer_than(ClusterConfig.from_json(_config(rev=6)))
    assert not cfg.newer_than(ClusterConfig.from_json(_config(rev=7)))


@pytest.mark.parametrize(
    "bad",
    [
        b"not json",
        b"[1, 2]",
        json.dumps(_config(rev="7")).encode(),
        json.dumps(_config(rev=-1)).encode(),
        json.dumps(_config(numVBuckets=3)).encode(),
        json.dumps(_config(vBucketServerMap={"serverList": [], "vBucketMap": []})).encode(),
        json.dumps(
            _config(vBucketServerMap={"serverList": ["h:1"], "vBucketMap": [[0]] * 3})
        ).encode(),
        json.dumps(  # a chain naming a server that is not in serverList
            _config(vBucketServerMap={"serverList": ["h:1"], "vBucketMap": [[0], [1], [0], [0]]})
        ).encode(),
        json.dumps(
            _config(vBucketServerMap={"serverList": ["h"], "vBucketMap": [[0]] * 4})
        ).encode(),
        json.dumps(
            _config(
                vBucketServerMap={
                    "serverList": ["h:1"],
                    "vBucketMap": [[0]] * 4,
                    "vBucketMapForward": [[0]] * 2,
                }
            )
        ).encode(),
    ],
)
def test_malformed_configs_are_refused(bad: bytes) -> None:
    with pytest.raises(ConfigError):
        ClusterConfig.from_json(bad)


def test_bootstrap_lists() -> None:
    assert parse_addresses("127.0.0.1:11210, 127.0.0.1:11211") == [
        ("127.0.0.1", 11210),
        ("127.0.0.1", 11211),
    ]
    assert parse_addresses("localhost", 11210) == [("localhost", 11210)]
    assert parse_addresses(("h", 5)) == [("h", 5)]
    assert parse_addresses([("h", 5), "h:6", ("h", 5)]) == [("h", 5), ("h", 6)]
    assert parse_addresses("[::1]:11210") == [("::1", 11210)]
    assert format_address(("::1", 11210)) == "[::1]:11210"
    for bad in ("", "h:0", "h:x", "h", [("h", 70000)], [3]):
        with pytest.raises(ConfigError):
            parse_addresses(bad)


def test_a_lone_server_is_routed_at_the_address_that_answered() -> None:
    lone = ClusterConfig.from_json(
        _config(
            rev=1,
            vBucketServerMap={"serverList": ["0.0.0.0:11210"], "vBucketMap": [[0]] * 4},
            nodesExt=[{"hostname": "0.0.0.0", "nodeName": "0.0.0.0:11210", "thisNode": True}],
        )
    )
    reached = ("127.0.0.1", 11210)
    seen = lone.seen_from(reached)
    assert seen.servers == (reached,) and seen.active(3) == reached
    assert seen.this_node == reached and seen.chains == lone.chains
    # a cluster's map (rev from etcd), even of one node, is routed as the node advertises
    one_node_cluster = ClusterConfig.from_json(
        _config(rev=42, vBucketServerMap={"serverList": ["n1:11210"], "vBucketMap": [[0]] * 4})
    )
    assert one_node_cluster.seen_from(reached) is one_node_cluster
    two = ClusterConfig.from_json(_config(rev=1))
    assert two.seen_from(reached) is two
