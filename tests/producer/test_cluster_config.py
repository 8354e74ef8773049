"""The cluster's face on one node, without etcd: GET_CLUSTER_CONFIG on a single node, the
write gate on every KV write path, and the cluster settings' checks (config and CLI).

The gate tests close the gate by hand (``server.write_gate``): what closes it in a
cluster (fencing, no map yet) is tested against a real etcd in tests/etcd/test_agent*.py.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from dcp.producer.config import ConfigError, ServerConfig, load_config
from dcp.producer.server import DcpServer
from dcp.protocol import Opcode, Status, codec
from dcp.protocol.opcodes import DurabilityLevel

from .conftest import client_of, running_server

SERVER = [sys.executable, "-m", "dcp.producer"]

VECTORS = Path(__file__).resolve().parents[2] / "protocol_spec" / "vectors"


def _vector(name: str) -> dict:
    return json.loads((VECTORS / f"{name}.json").read_text())


#: the golden request (protocol_spec/vectors): opaque 0x2a, no key, extras or value
REQUEST = bytes.fromhex(_vector("get_cluster_config_request")["hex"])


async def _raw_call(port: int, request: bytes) -> tuple[bytes, bytes]:
    """Send ``request`` on a fresh connection; the answer's header and body bytes."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        data = b""
        with trio.fail_after(10):
            while len(data) < 24 or len(data) < 24 + struct.unpack_from(">I", data, 8)[0]:
                data += await stream.receive_some(65536)
    return data[:24], data[24:]


async def test_single_node_config_names_this_node_active_for_every_vbucket(
    server: DcpServer,
) -> None:
    assert REQUEST == bytes.fromhex("80b5000000000000000000000000002a0000000000000000")
    header, body = await _raw_call(server.port, REQUEST)
    golden = bytes.fromhex(_vector("get_cluster_config_response")["hex"])
    assert header[:8] == golden[:8]  # the same fixed fields as the golden answer
    # response, opcode 0xb5, no key/extras, datatype JSON, SUCCESS, body, opaque 0x2a, no CAS
    assert header == bytes.fromhex("81b5000000010000") + struct.pack(">II8x", len(body), 0x2A)
    doc = json.loads(body)
    address = f"127.0.0.1:{server.port}"
    assert doc["rev"] == 1
    assert doc["numVBuckets"] == 4
    assert doc["nodeLocator"] == "vbucket"
    assert doc["vBucketServerMap"]["serverList"] == [address]
    assert doc["vBucketServerMap"]["numReplicas"] == 0
    assert doc["vBucketServerMap"]["vBucketMap"] == [[0]] * 4
    assert doc["nodesExt"] == [
        {
            "hostname": "127.0.0.1",
            "services": {"kv": server.port},
            "nodeName": address,
            "thisNode": True,
        }
    ]


async def test_get_cluster_config_with_a_body_is_einval(server: DcpServer) -> None:
    async with client_of(server) as c:
        r = await c.call(codec.request(Opcode.GET_CLUSTER_CONFIG, opaque=9, key=b"x"), 9)
        assert r.status == Status.EINVAL
        r = await c.call(REQUEST, 0x2A)  # the connection is still served
        assert r.status == Status.SUCCESS


async def test_single_node_not_my_vbucket_keeps_its_error_context(server: DcpServer) -> None:
    async with client_of(server) as c:
        wrong = (c.vb(b"k") + 1) % 4
        r = await c.store(Opcode.SET, b"k", b"v", vb=wrong)
    assert r.status == Status.NOT_MY_VBUCKET
    assert "error" in json.loads(bytes(r.value))


async def test_a_closed_gate_refuses_every_write_path_with_etmpfail(tmp_path: Path) -> None:
    async with running_server(tmp_path / "d") as server:
        async with client_of(server) as c:
            await c.set(b"kept", b"v0")
            open_gate = True
            server.write_gate = lambda: open_gate
            await c.set(b"a", b"1")  # open: writes go through the gate
            open_gate = False
            for op in (Opcode.SET, Opcode.ADD, Opcode.REPLACE):
                r = await c.store(op, b"kept", b"v1")
                assert r.status == Status.ETMPFAIL, (op, r)
            r = await c.store(
                Opcode.SET, b"kept", b"v1", durability=DurabilityLevel.PERSIST_TO_MAJORITY
            )
            assert r.status == Status.ETMPFAIL
            r = await c.delete(b"kept")
            assert r.status == Status.ETMPFAIL
            # a pipelined run of plain SETs: the reader's fast path (kv_handlers.set_run)
            buf = b"".join(
                codec.request(
                    Opcode.SET,
                    vbucket=c.vb(b"p%d" % i),
                    opaque=100 + i,
                    extras=codec.store_extras(0, 0),
                    key=b"p%d" % i,
                    value=b"x",
                )
                for i in range(50)
            )
            await c.send(buf)
            answers = [await c.next_frame() for _ in range(50)]
            assert [a.status for a in answers] == [Status.ETMPFAIL] * 50
            assert [a.opaque for a in answers] == list(range(100, 150))
            r = await c.get(b"kept")  # reads are not gated
            assert r.status == Status.SUCCESS and bytes(r.value) == b"v0"
            open_gate = True
            await c.set_many([(b"p%d" % i, b"y") for i in range(50)])
        assert all(
            server.bucket.get(codec.vbucket_for_key(b"p%d" % i, 4), b"p%d" % i).value == b"y"
            for i in range(50)
        )


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"cluster": "http://127.0.0.1:2379"}, "needs node_name"),
        (
            {"cluster": "http://127.0.0.1:2379", "node_name": "n1", "replica_of": "h:1"},
            "not both",
        ),
        ({"cluster": "127.0.0.1:2379", "node_name": "n1"}, "etcd URL"),
        ({"node_name": "n 1"}, "node_name"),
        ({"cluster_name": ""}, "cluster_name"),
        ({"cluster_name": "a/b"}, "cluster_name"),
        ({"cluster_lease_ttl": 1}, "cluster_lease_ttl"),
        ({"num_replicas": 4}, "num_replicas"),
        ({"num_replicas": -1}, "num_replicas"),
        ({"auto_failover_timeout": 0}, "auto_failover_timeout"),
        ({"auto_failover_timeout": 5, "cluster_lease_ttl": 5}, "must exceed cluster_lease_ttl"),
        ({"auto_failover_max_count": -1}, "auto_failover_max_count"),
        ({"rebalance_moves": 0}, "rebalance_moves"),
        ({"move_timeout": -1}, "move_timeout"),
    ],
)
def test_bad_cluster_settings_are_refused(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ServerConfig(**settings).validate()  # type: ignore[arg-type]


def test_cluster_settings_come_from_the_environment_too() -> None:
    cfg = load_config(
        None,
        environ={
            "DCP_CLUSTER": "http://127.0.0.1:2379",
            "DCP_NODE_NAME": "n7",
            "DCP_CLUSTER_NAME": "blue",
            "DCP_NUM_REPLICAS": "2",
            "DCP_AUTO_FAILOVER_TIMEOUT": "3.5",
            "DCP_CLUSTER_LEASE_TTL": "2",  # the timeout must exceed it
        },
    )
    assert (cfg.cluster, cfg.node_name, cfg.cluster_name) == ("http://127.0.0.1:2379", "n7", "blue")
    assert (cfg.num_replicas, cfg.auto_failover_timeout) == (2, 3.5)


def test_cli_refuses_cluster_without_node_name_in_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [*SERVER, "--port", "0", "--data-dir", str(tmp_path), "--cluster", "http://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "dcp-server: cluster needs node_name (this node's unique name)"
    ]


def test_the_golden_config_answers_are_what_the_server_code_builds() -> None:
    """The vectors of protocol_spec/ are not hand-made: ``bucket_config`` encoded as the
    node encodes it gives the golden value, and the node's answer framing (a SUCCESS with
    datatype JSON; a NOT_MY_VBUCKET carrying the config) gives the golden frames."""
    from dcp.producer.cluster.vbmap import VBucketMap, bucket_config
    from dcp.protocol.opcodes import Datatype

    vbmap = VBucketMap.from_names(1, [["n1", "n2"], ["n2", "n1"]], servers=["n1", "n2"])
    doc = bucket_config(vbmap, {"n1": "10.0.0.1:11210", "n2": "10.0.0.2:11210"}, 7, "n1")
    value = json.dumps(doc, separators=(",", ":")).encode()
    answer = codec.response(
        Opcode.GET_CLUSTER_CONFIG, opaque=0x2A, datatype=Datatype.JSON, value=value
    )
    assert answer.hex() == _vector("get_cluster_config_response")["hex"]
    nmvb = codec.response(
        Opcode.GET, Status.NOT_MY_VBUCKET, opaque=0x2B, datatype=Datatype.JSON, value=value
    )
    assert nmvb.hex() == _vector("get_response_not_my_vbucket_config")["hex"]
