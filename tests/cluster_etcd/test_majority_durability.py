"""MAJORITY durability on a real 3-node cluster (num_replicas=2): the replicas acknowledge
(dcp/producer/replication/acks.py), so MAJORITY writes are answered; with both replicas
of a vbucket frozen one is answered SYNC_WRITE_AMBIGUOUS at its timeout; and after a kill
-9 of an active and the automatic failover every write answered at MAJORITY reads back
(the promoted replica is the one holding the most, cluster/failover.py).

Rules of this module: real processes and a throwaway etcd on loopback (``harness.py``);
every node is killed by the fixture (a SIGSTOPped one is continued first); every wait is
bounded; the frozen replicas are continued within about a second, well inside the lease.
"""

from __future__ import annotations

import pytest
import trio

from dcp.consumer import KvClient
from dcp.protocol import codec
from dcp.protocol.frames import FrameReader
from dcp.protocol.layout import vbucket_for_key
from dcp.protocol.opcodes import DurabilityLevel, HelloFeature, Opcode, Status

from .harness import EtcdCluster, until

NAMES = ["n1", "n2", "n3"]
KEYS = 160
WRITERS = 4

pytestmark = pytest.mark.slow


def _key_of(vb: int, nvb: int, tag: str) -> bytes:
    return next(k for i in range(100_000) if vbucket_for_key(k := f"{tag}-{i}".encode(), nvb) == vb)


async def _raw_majority_set(port: int, key: bytes, vb: int, timeout_ms: int) -> int:
    """A SET at MAJORITY with ``timeout_ms`` over a plain socket (HELLO with XERROR and
    alt requests): the answer's status."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        features = [int(HelloFeature.XERROR), int(HelloFeature.ALT_REQUEST_SUPPORT)]
        fe = codec.durability_frame_info(int(DurabilityLevel.MAJORITY), timeout_ms)
        await stream.send_all(
            codec.hello("majority-test", features, opaque=1)
            + codec.request(
                Opcode.SET,
                vbucket=vb,
                opaque=2,
                extras=codec.store_extras(0, 0),
                key=key,
                value=b"frozen",
                framing_extras=fe,
            )
        )
        reader = FrameReader()
        with trio.fail_after(timeout_ms / 1000 + 10):
            while True:
                data = await stream.receive_some(65536)
                assert data, "the node closed the connection"
                reader.feed(data)
                for f in reader.read_frames():
                    if f.opaque == 2:
                        return f.vbucket  # a response's status
    finally:
        await trio.aclose_forcefully(stream)


async def test_majority_writes_survive_an_active_killed_and_time_out_without_replicas(
    etcd_cluster: EtcdCluster,
) -> None:
    c = etcd_cluster
    base = c.node_args
    c.node_args = lambda name: [*base(name), "--num-replicas", "2"]  # type: ignore[method-assign]
    await c.start(*NAMES)
    vbmap, _ = await c.wait_settled(NAMES, timeout=45)
    assert all(None not in vbmap.names(vb) for vb in range(c.num_vbuckets))
    status = await until(c.status, "the orchestrator's status", 10)

    # -- both replicas of one vbucket frozen: its MAJORITY write is ambiguous at timeout
    head = status["orchestrator"]  # stays up: no election in the middle
    vb = next(vb for vb in range(c.num_vbuckets) if vbmap.active(vb) == head)
    replicas = [r for r in vbmap.replicas(vb) if r is not None]
    for r in replicas:
        c.pause(r)
    try:
        t0 = trio.current_time()
        got = await _raw_majority_set(c.port_of(head), _key_of(vb, c.num_vbuckets, "fz"), vb, 400)
        took = trio.current_time() - t0
    finally:
        for r in replicas:
            c.resume(r)
    assert got == Status.SYNC_WRITE_AMBIGUOUS, f"status 0x{got:02x}"
    assert took >= 0.35, f"answered after {took:.2f} s, before its 0.4 s timeout"
    vbmap, _ = await c.wait_settled(NAMES, timeout=30)  # nothing failed over meanwhile

    # -- MAJORITY writes, then kill -9 the active of some of them at once
    victim = next(n for n in NAMES if n != head)
    acked: dict[bytes, bytes] = {}
    bootstrap = ",".join(c.address(n) for n in NAMES)
    async with KvClient(bootstrap, timeout=30) as kv:

        async def write(keys: list[bytes]) -> None:
            for k in keys:
                value = b"v-" + k
                await kv.set(k, value, durability="majority")
                acked[k] = value

        keys = [f"maj-{i}".encode() for i in range(KEYS)]
        async with trio.open_nursery() as nursery:
            for i in range(WRITERS):
                nursery.start_soon(write, keys[i::WRITERS])
        assert len(acked) == KEYS
        victims_vbs = {vbucket_for_key(k, c.num_vbuckets) for k in keys} & {
            vb for vb in range(c.num_vbuckets) if vbmap.active(vb) == victim
        }
        assert victims_vbs, "no key on the victim's vbuckets"
        c.kill(victim)  # right after its last answers: some writes are on one replica only

        async def failed_over() -> bool:
            m, _ = await c.read_map()
            return m is not None and all(
                victim not in m.names(vb) and m.active(vb) for vb in range(c.num_vbuckets)
            )

        await until(failed_over, f"the automatic failover of {victim}", c.failover_timeout + 25)
        lost = {}
        for k, value in acked.items():
            got_value = (await kv.get(k)).value
            if got_value != value:
                lost[k] = got_value
        assert not lost, f"{len(lost)} MAJORITY writes lost after the failover: {list(lost)[:5]}"
    c.assert_no_crash()
