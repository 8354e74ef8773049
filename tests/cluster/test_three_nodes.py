"""Three nodes: two replicas of one active, at different points when the active dies.

A is active, B and C its replicas. B is killed, so W2 reaches A and C only; A is killed;
B (which never saw W2) is promoted and takes W3; C is pointed at B and must roll back its
W2 tail — the copy that saw *more* than the promoted one — and converge to B byte for
byte; A then rejoins as B's replica and converges too. W2 both creates keys and updates
keys of W1, so the rollbacks undo updates: with the history window the older versions are
on disk and the rollbacks are exact; without it the vbuckets concerned re-sync from 0.

Rules of this module: real processes on loopback (``nodes.py``), 16 vbuckets, every
wait bounded.
"""

from __future__ import annotations

import pytest

from dcp.consumer import KvClient
from dcp.protocol import codec

from .conftest import Cluster
from .nodes import HOST, assert_same, dcpctl, dump, until, wait_caught_up
from .test_divergence import HISTORY, NO_HISTORY, NVB, keys_in


@pytest.mark.parametrize("history", [True, False], ids=["history", "no-history"])
async def test_the_replica_that_saw_more_rolls_back_to_the_promoted_one(
    cluster: Cluster, history: bool
) -> None:
    args = HISTORY if history else NO_HISTORY
    a = await cluster.node("a", NVB, args).start()
    b = await cluster.node("b", NVB, [*args, "--replica-of", a.address]).start()
    c = await cluster.node("c", NVB, [*args, "--replica-of", a.address]).start()
    w1 = keys_in(range(NVB), 4, "w1")
    async with KvClient(HOST, a.port, num_vbuckets=NVB) as kv:
        await kv.set_many({k: b"one:" + k for k in w1})
    h_b = await wait_caught_up(a, b)
    await wait_caught_up(a, c)
    await until(b.persisted, "B to persist W1")
    b.kill()

    w2_new = keys_in(range(0, NVB, 2), 2, "w2")
    w2_upd = [k for k in w1 if codec.vbucket_for_key(k, NVB) % 2 == 0][::2]
    async with KvClient(HOST, a.port, num_vbuckets=NVB, timeout=30) as kv:
        await kv.set_many({k: b"lost:" + k for k in w2_new + w2_upd})
    await wait_caught_up(a, c)
    await until(c.persisted, "C to persist W2")
    a.kill()

    await b.start()
    assert await b.high_seqnos() == h_b
    await dcpctl("--port", b.port, "promote")
    w3 = keys_in(range(NVB), 2, "w3")
    async with KvClient(HOST, b.port, num_vbuckets=NVB) as kv:
        await kv.set_many({k: b"three:" + k for k in w3})

    await dcpctl("--port", c.port, "set-state", f"0-{NVB - 1}", "replica", "--source", b.address)
    await wait_caught_up(b, c)
    rolled = c.rollbacks_logged()
    assert set(rolled) == set(range(0, NVB, 2))  # exactly the vbuckets W2 reached
    for vb, (reached, asked) in rolled.items():
        assert asked == h_b[vb]
        assert reached == (h_b[vb] if history else 0), (vb, reached, asked)
    await a.start("--replica-of", b.address)
    await wait_caught_up(b, a)

    live = set(w1) | set(w3)
    assert await assert_same(b, c) == len(live)
    assert await assert_same(b, a) == len(live)
    for node in (a, c):
        rows = [r for d in (await dump(node)).values() for r in d.items]
        assert not [r for r in rows if r[8] is not None and r[8].startswith(b"lost:")]
    cluster.assert_no_crash()
