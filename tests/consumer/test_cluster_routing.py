"""The cluster-aware DcpClient's pure rules (``dcp.consumer.routing``) and its argument
checks: which node a vbucket streams from, when a config is used, refresh rate limits,
bootstrap list errors."""

from __future__ import annotations

import json
import logging

import pytest

from dcp.consumer import DcpClient, UsageError
from dcp.consumer.routing import RefreshGate, assign, backoff, is_cluster, newer_config, pick
from dcp.protocol.cluster_config import ClusterConfig

A, B, C = ("10.0.0.1", 11210), ("10.0.0.2", 11210), ("10.0.0.3", 11210)


def config_json(rev: int, servers: list[tuple[str, int]], chains: list[list[int]]) -> bytes:
    """A bucket config as a cluster node sends it (only the fields clients read)."""
    return json.dumps(
        {
            "rev": rev,
            "numVBuckets": len(chains),
            "vBucketServerMap": {
                "serverList": [f"{h}:{p}" for h, p in servers],
                "vBucketMap": chains,
                "numReplicas": max(len(c) for c in chains) - 1,
            },
        }
    ).encode()


def cfg(rev: int, chains: list[list[int]]) -> ClusterConfig:
    return ClusterConfig.from_json(config_json(rev, [A, B, C], chains))


def test_one_address_and_a_lone_node_config_is_a_single_node() -> None:
    lone = ClusterConfig.from_json(config_json(1, [A], [[0], [0]]))
    assert not is_cluster([A], None)  # UNKNOWN_COMMAND: an old server
    assert not is_cluster([A], lone)
    assert is_cluster([A, B], lone)  # a bootstrap list always routes by the map
    assert is_cluster([A], cfg(1, [[0], [1]]))  # the map names two servers
    # a one-node cluster's map (an etcd revision, not a lone node's rev 1)
    assert is_cluster([A], ClusterConfig.from_json(config_json(40, [A], [[0], [0]])))


def test_a_vbucket_streams_from_its_active_or_waits_without_one() -> None:
    c = cfg(3, [[0, 1], [1, 0], [-1, 2], [2, -1]])
    assert assign(c, range(4)) == {0: A, 1: B, 2: None, 3: C}


def test_prefer_replica_takes_the_most_current_replica_within_the_lag() -> None:
    c = cfg(3, [[0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 1, 2]])
    active = {0: 5000, 1: 5000, 2: 5000, 3: 5000}
    replica = {B: {0: 4500, 1: 3000, 2: 4900}, C: {0: 4800, 1: 3900, 2: 4900}}
    got = assign(
        c, range(4), prefer_replica=True, max_lag=1000, active_high=active, replica_high=replica
    )
    # vb 0: both within 1000, C more current; vb 1: both lag > 1000: the active;
    # vb 2: a tie, first in chain order; vb 3: no replica seqnos known: the active
    assert got == {0: C, 1: A, 2: B, 3: A}
    # a tie keeps the replica already streaming (a refresh moves nothing still good)
    assert (
        pick(
            c,
            2,
            current=C,
            prefer_replica=True,
            max_lag=1000,
            active_high=active,
            replica_high=replica,
        )
        == C
    )
    # without prefer_replica the seqnos do not matter
    assert assign(c, range(4), active_high=active, replica_high=replica) == dict.fromkeys(
        range(4), A
    )


def test_a_config_is_used_only_when_it_parses_and_is_newer(caplog) -> None:
    cur = cfg(5, [[0], [1]])
    assert newer_config(cur, config_json(6, [A, B], [[1], [1]])).rev == 6
    assert newer_config(cur, config_json(5, [A, B], [[1], [1]])) is None  # not newer
    assert newer_config(cur, config_json(4, [A, B], [[1], [1]])) is None  # older
    assert newer_config(None, config_json(1, [A], [[0], [0]])).rev == 1
    with caplog.at_level(logging.WARNING, logger="dcp.consumer.routing"):
        assert newer_config(cur, b'{"rev": 9, "vBucketServerMap": ') is None
        assert newer_config(cur, config_json(9, [A, B], [[5], [1]])) is None  # index 5
        assert newer_config(cur, config_json(9, [A], [[0], [0], [0], [0]])) is None  # 4 vbs
    assert len(caplog.records) == 3
    assert "keeping rev 5" in caplog.records[0].getMessage()


def test_refreshes_are_one_at_a_time_and_rate_limited() -> None:
    gate = RefreshGate(0.1)
    assert gate.wait_time(10.0) == 0
    gate.start(10.0)
    assert gate.wait_time(10.5) == float("inf")  # one in flight
    gate.done()
    assert gate.wait_time(10.04) == pytest.approx(0.06)
    assert gate.wait_time(10.2) == 0
    assert [backoff(n) for n in (1, 2, 3, 10)] == [0.05, 0.1, 0.2, 2.0]


@pytest.mark.parametrize(
    ("host", "kw", "match"),
    [
        ("127.0.0.1:11210,127.0.0.1:x", {}, "not a number"),
        ("127.0.0.1:0", {}, "1..65535"),
        ([("127.0.0.1", 70000)], {}, "1..65535"),
        ([42], {}, "HOST:PORT"),
        (" , ", {}, "no address"),
        ("", {}, "non-empty"),
        ("a:1,b:2", {"cluster": False}, "one address"),
        ("a:1", {"max_replica_lag": -1}, "max_replica_lag"),
        ("a:1", {"config_poll_interval": 0}, "config_poll_interval"),
    ],
)
def test_bad_bootstrap_lists_and_settings_are_usage_errors(host, kw, match) -> None:
    with pytest.raises(UsageError, match=match):
        DcpClient(host, **kw)


def test_bootstrap_lists_are_accepted_in_every_form() -> None:
    for host in ("127.0.0.1:1,127.0.0.1:2", [("127.0.0.1", 1), ("127.0.0.1", 2)], ["h:1"]):
        c = DcpClient(host)
        assert c._supervisor.routing.addresses[0][1] == 1
    assert DcpClient("h", 99)._supervisor.routing.addresses == [("h", 99)]
