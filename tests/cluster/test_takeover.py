"""Takeover under write load: ``dcpctl move V --to B`` while a writer keeps writing to vb
V on A; not one acknowledged write is lost.

The writer is a raw memcached-binary client (``tools/chaos/procs.py``), so what it
does with each answer is explicit: SUCCESS records (key, value, CAS) as acknowledged,
ETMPFAIL (the vbucket is pending during the hand-over) is retried, and NOT_MY_VBUCKET
from A sends the writes of V to B from then on (where NOT_MY_VBUCKET is retried until B
is active). Afterwards B must hold every key's last acknowledged value with its CAS, B
has V active with A's failover log unchanged (a takeover adds no entry), and A reports V
replica (``move`` makes it B's replica).

Rules of this module: real processes on loopback (``nodes.py``), 16 vbuckets, the writer
bounded by an operation count and a deadline.
"""

from __future__ import annotations

import itertools

import trio

from dcp.protocol import Status, codec
from tools.chaos.procs import RawClient

from .conftest import Cluster
from .nodes import Node, assert_same, dcpctl, until, wait_caught_up

NVB = 16
V = 5


def keys_of(vb: int, n: int, prefix: str) -> list[bytes]:
    it = (f"{prefix}-{i}".encode() for i in itertools.count())
    return list(itertools.islice((k for k in it if codec.vbucket_for_key(k, NVB) == vb), n))


class Writer:
    """Writes ``keys`` round-robin with unique values; see the module docstring."""

    def __init__(self, keys: list[bytes], vb: int, a: Node, b: Node) -> None:
        self.keys, self.vb, self.a, self.b = keys, vb, a, b
        self.acked: dict[bytes, tuple[bytes, int]] = {}
        self.done = 0
        self.on_b = 0
        self.switched = False
        self.etmpfail = 0
        self.nmvb_from_b = 0
        self.stop = trio.Event()

    async def run(self, max_ops: int = 200_000) -> None:
        ca = await RawClient.connect(self.a.port)
        cb = await RawClient.connect(self.b.port)
        try:
            for i in range(max_ops):
                if self.stop.is_set():
                    return
                key = self.keys[i % len(self.keys)]
                value = b"value-%d" % i
                while True:
                    f = await (cb if self.switched else ca).store(key, value, self.vb)
                    if f.status == Status.SUCCESS:
                        self.acked[key] = (value, f.cas)
                        self.done += 1
                        self.on_b += self.switched
                        break
                    if f.status == Status.ETMPFAIL:
                        self.etmpfail += 1
                    elif f.status == Status.NOT_MY_VBUCKET and not self.switched:
                        self.switched = True
                        continue
                    elif f.status == Status.NOT_MY_VBUCKET:
                        self.nmvb_from_b += 1  # B not active yet: the hand-over is in flight
                    else:
                        raise AssertionError(f"{key!r}: status 0x{f.status:02x}")
                    await trio.sleep(0.001)
            raise AssertionError(f"writer reached {max_ops} operations")
        finally:
            await ca.aclose()
            await cb.aclose()


async def test_move_under_write_load_loses_no_acknowledged_write(cluster: Cluster) -> None:
    a = await cluster.node("a", NVB).start()
    b = await cluster.node("b", NVB, ["--replica-of", a.address]).start()
    moving = Writer(keys_of(V, 40, "m"), V, a, b)
    others = [Writer(keys_of(vb, 10, "o"), vb, a, b) for vb in (0, 9, 15)]
    log_before = (await a.failover_logs())[V]
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for w in (moving, *others):
                nursery.start_soon(w.run)
            await until(_acked(moving, 500), "writes to vb V before the move", 30, 0.01)
            out = await dcpctl("--port", a.port, "move", V, "--to", b.address)
            assert out.strip().splitlines()[-1].startswith(f"moved vb {V} from {a.address}")
            await until(_on_b(moving, 300), "writes to vb V on B after the move", 30, 0.01)
            for w in (moving, *others):
                w.stop.set()
    assert moving.switched and not any(w.switched for w in others)

    states_a, states_b = await a.states(), await b.states()
    assert states_b[V] == "active" and states_a[V] == "replica"
    assert {vb for vb, s in states_b.items() if s == "active"} == {V}
    assert {vb for vb, s in states_a.items() if s == "active"} == set(range(NVB)) - {V}
    assert (await b.failover_logs())[V] == log_before  # no new branch

    cb = await RawClient.connect(b.port)
    try:
        for key, (value, cas) in moving.acked.items():
            f = await cb.get(key, V)
            assert (f.status, bytes(f.value), f.cas) == (Status.SUCCESS, value, cas), key
    finally:
        await cb.aclose()
    ca = await RawClient.connect(a.port)
    try:
        for w in others:
            for key, (value, cas) in w.acked.items():
                f = await ca.get(key, w.vb)
                assert (f.status, bytes(f.value), f.cas) == (Status.SUCCESS, value, cas), key
        f = await ca.get(moving.keys[0], V)
        assert f.status == Status.NOT_MY_VBUCKET
    finally:
        await ca.aclose()

    # each node now replicates the other's active vbuckets: both converge, item for item
    await wait_caught_up(b, a)
    await assert_same(a, b)
    cluster.assert_no_crash()


def _acked(w: Writer, n: int):
    async def check() -> bool:
        return w.done >= n

    return check


def _on_b(w: Writer, n: int):
    async def check() -> bool:
        return w.on_b >= n

    return check
