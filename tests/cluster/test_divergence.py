"""The classic divergence: writes the replica never saw, a failover, the old active
rejoining as the new active's replica with exact rollback seqnos.

A is active and B its replica. W1 reaches both and B's disk; B is killed (SIGKILL) so W2
reaches A only, durably (persisted); A is killed; B restarts (same arguments: A is gone,
so it gets nothing more) and is promoted; W3 is written to B; A restarts with
``--replica-of B``. (Freezing B with SIGSTOP instead is not enough: what A sent while B
was frozen waits in B's socket buffer and B reads it once continued, before it sees the
connection end, so B would hold W2 too.) Every vbucket of A that took W2 must roll back to
exactly the seqno B had (H_B) when it was killed, when W2 only created keys (each
undone version has revision 1: nothing older to restore), or when W2 changed keys that
existed before and A keeps a history window (the older versions are still on disk);
without history A cannot restore changed keys and resets those vbuckets to 0 and
re-syncs in full. Either way A then holds B's history byte for byte.

Rules of this module: real processes on loopback (``nodes.py``), 16 vbuckets, every
wait bounded.
"""

from __future__ import annotations

import itertools

import pytest

from dcp.consumer import KvClient
from dcp.protocol import codec

from .conftest import Cluster
from .nodes import HOST, assert_same, dcpctl, dump, until, wait_caught_up

NVB = 16
W2_VBS = range(0, NVB, 2)  # the even vbuckets take W2; the odd ones must not roll back
#: superseded versions kept on disk (a history window) or not: only with them can a
#: rollback undo an update of a key that existed before the rollback seqno
HISTORY = ["--history-seconds", "3600", "--history-bytes", str(1 << 30)]
NO_HISTORY = ["--history-seconds", "0", "--history-bytes", "0"]


def keys_in(vbs: range | list[int], per_vb: int, prefix: str) -> list[bytes]:
    want = set(vbs)
    count = dict.fromkeys(want, 0)
    out = []
    for i in itertools.count():
        k = f"{prefix}-{i}".encode()
        vb = codec.vbucket_for_key(k, NVB)
        if vb in want and count[vb] < per_vb:
            count[vb] += 1
            out.append(k)
            if len(out) == per_vb * len(want):
                return out
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    ("w2_updates_existing_keys", "history", "exact"),
    [(False, False, True), (True, False, False), (True, True, True)],
    ids=["new-keys", "updates-no-history", "updates-history"],
)
async def test_old_active_rolls_back_its_unreplicated_tail_and_converges_to_the_new_active(
    cluster: Cluster, w2_updates_existing_keys: bool, history: bool, exact: bool
) -> None:
    args = HISTORY if history else NO_HISTORY
    a = await cluster.node("a", NVB, args).start()
    b = await cluster.node("b", NVB, [*args, "--replica-of", a.address]).start()
    w1 = keys_in(range(NVB), 6, "w1")
    async with KvClient(HOST, a.port, num_vbuckets=NVB) as kv:
        await kv.set_many({k: b"one:" + k for k in w1})
        await kv.set_many({k: b"two:" + k for k in w1[::3]})  # some keys at rev 2
    h_b = await wait_caught_up(a, b)
    await until(b.persisted, "B to persist W1")
    # and A: an update in W2 can only be undone exactly if the version it superseded is
    # on A's disk (in its history window); a version superseded in memory never is
    await until(a.persisted, "A to persist W1")
    b.kill()
    if w2_updates_existing_keys:
        w2 = [
            k for vb in W2_VBS for k in [k for k in w1 if codec.vbucket_for_key(k, NVB) == vb][:3]
        ]
    else:
        w2 = keys_in(W2_VBS, 3, "w2")
    async with KvClient(HOST, a.port, num_vbuckets=NVB, timeout=30) as kv:
        await kv.set_many({k: b"lost:" + k for k in w2}, durable=True)  # on A's disk
    h_a = await a.high_seqnos()
    for vb in range(NVB):
        assert h_a[vb] == h_b[vb] + (len(w2) // len(W2_VBS) if vb in W2_VBS else 0)
    a.kill()
    await b.start()
    assert await b.high_seqnos() == h_b

    await dcpctl("--port", b.port, "promote")
    assert set((await b.states()).values()) == {"active"}
    b_logs = await b.failover_logs()
    for vb in range(NVB):
        assert b_logs[vb][0][1] == h_b[vb]  # the new branch starts at B's last snapshot
    w3 = keys_in(range(NVB), 2, "w3")
    async with KvClient(HOST, b.port, num_vbuckets=NVB) as kv:
        await kv.set_many({k: b"three:" + k for k in w3})

    await a.start("--replica-of", b.address)
    await wait_caught_up(b, a)
    await until(_no_lag(a), "A's replication of B to settle", 30)
    expected = {vb: (h_b[vb] if exact else 0, h_b[vb]) for vb in W2_VBS}
    assert a.rollbacks_logged() == expected
    st = await a.stats("replication")
    # ROLLBACK answers from B: one per vbucket for the failover entry A's own warm-up after
    # the kill added (B never knew it: A drops it, keeps its data and asks again with the
    # previous branch), then one per vbucket with W2 items
    assert int(st[f"source:{b.address}:rollbacks"]) == NVB + len(W2_VBS)
    assert await assert_same(b, a) == len(set(w1) | set(w3))
    rows = [r for d in (await dump(a)).values() for r in d.items]
    assert not [r for r in rows if r[8] is not None and r[8].startswith(b"lost:")]
    assert {r[1] for r in rows} == set(w1) | set(w3)
    cluster.assert_no_crash()


def _no_lag(node):
    async def check() -> bool:
        st = await node.stats("replication")
        lags = [v for k, v in st.items() if k.endswith(":lag")]
        return bool(lags) and set(lags) == {"0"}

    return check
