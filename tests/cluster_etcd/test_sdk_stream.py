"""One cluster-aware ``DcpClient`` (a bootstrap list, every vbucket) across a rebalance and
a kill -9 failover, with writes going on through both: what it ends with is exactly what
the cluster holds, and it is told to roll back only where the branch it had streamed
diverged (vbuckets whose active was killed), never through the rebalance.

Rules of this module: real processes and a throwaway etcd on loopback (``harness.py``);
writes go through a ``KvClient`` on the same bootstrap list; every loop is bounded by an
event or a deadline. One test function, one cluster (the module's budget is about 60 s).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import trio

from dcp.consumer import DcpClient, DcpClientError, KvClient, RollbackEvent, SnapshotBatch
from dcp.protocol.errors import StatusError

from .harness import EtcdCluster, until
from .traffic import keys_for, read_all

pytestmark = pytest.mark.slow

DOC = Path(__file__).resolve().parents[2] / "docs" / "sdk.md"
#: docs/sdk.md's cluster examples (the single-node ones: tests/consumer/test_docs_examples.py)
CLUSTER_EXAMPLES = [
    b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S) if "DCP_BOOTSTRAP" in b
]


class View:
    """What the consumer has applied: per vbucket, each key's (seqno, value) history, so a
    rollback to R drops exactly what is above R."""

    def __init__(self) -> None:
        self.vbs: dict[int, dict[bytes, list[tuple[int, bytes | None]]]] = {}
        self.rollbacks: list[tuple[float, RollbackEvent]] = []
        self.batches = 0
        self.stats: dict = {}  # the client's statistics when it stopped

    def apply(self, batch: SnapshotBatch) -> None:
        keys = self.vbs.setdefault(batch.vbucket, {})
        for e in batch.events:
            v = getattr(e, "value", None)
            keys.setdefault(bytes(e.key), []).append((e.seqno, None if v is None else bytes(v)))
        self.batches += 1

    def roll_back(self, ev: RollbackEvent) -> None:
        self.rollbacks.append((trio.current_time(), ev))
        for hist in self.vbs.get(ev.vbucket, {}).values():
            hist[:] = [(s, v) for s, v in hist if s <= ev.rollback_seqno]

    def state(self) -> dict[bytes, bytes | None]:
        return {k: h[-1][1] for keys in self.vbs.values() for k, h in keys.items() if h}


async def consume(bootstrap: str, view: View, stop: trio.Event) -> None:
    async with DcpClient(
        bootstrap,
        noop_interval=1.0,
        retry_timeout=40.0,
        connect_timeout=2.0,
        config_poll_interval=0.5,
        name="sdk-stream-test",
    ) as client:
        while not stop.is_set():
            with trio.move_on_after(0.2):
                item = await client.__anext__()
                if isinstance(item, RollbackEvent):
                    view.roll_back(item)
                else:
                    view.apply(item)
                await item.commit()
        view.stats = client.statistics()


async def write(kv: KvClient, items: dict[bytes, bytes], give_up: float = 30) -> None:
    """Each item acknowledged once (retried through refusals while the map moves)."""
    left = dict(items)
    with trio.fail_after(give_up):
        while left:
            for k, v in list(left.items()):
                try:
                    await kv.set(k, v)
                except (DcpClientError, StatusError, OSError):
                    await trio.sleep(0.05)
                else:
                    del left[k]


async def test_one_client_follows_a_rebalance_and_a_failover_to_the_exact_final_state(
    etcd_cluster: EtcdCluster,
) -> None:
    c = etcd_cluster
    await c.start("n1", "n2")
    await c.wait_settled(["n1", "n2"], timeout=40)
    bootstrap = f"{c.address('n1')},{c.address('n2')}"
    keys = keys_for(240, "sdk")
    view, stop = View(), trio.Event()
    async with KvClient(bootstrap, timeout=5.0) as kv, trio.open_nursery() as nursery:
        await write(kv, {k: b"a|" + k for k in keys[:120]})
        nursery.start_soon(consume, bootstrap, view, stop)

        # a third node joins: the orchestrator rebalances onto it while writes go on
        await c.start("n3")
        await write(kv, {k: b"b|" + k for k in keys[60:180]})
        await c.wait_settled(["n1", "n2", "n3"], timeout=40)
        assert view.rollbacks == [], "a rebalance (takeovers) must not roll anything back"

        # kill -9 a node that is not the orchestrator, with writes in flight
        status = await until(c.status, "the orchestrator's status", 10)
        victim = next(n for n in ("n1", "n2", "n3") if n != status["orchestrator"])
        vbmap, _ = await c.read_map()
        assert vbmap is not None
        victims_vbs = {vb for vb in range(c.num_vbuckets) if vbmap.active(vb) == victim}
        async with trio.open_nursery() as writers:
            writers.start_soon(write, kv, {k: b"c|" + k for k in keys[120:]})
            await trio.sleep(0.2)
            c.kill(victim)
            killed_at = trio.current_time()

        async def failed_over() -> bool:
            vbmap, _ = await c.read_map()
            return vbmap is not None and all(
                victim not in vbmap.names(vb) and vbmap.active(vb) for vb in range(c.num_vbuckets)
            )

        await until(failed_over, f"{victim}'s vbuckets to be failed over", 30)
        await write(kv, {k: b"d|" + k for k in keys[200:]})

        found = await read_all(c, keys)

        def same() -> bool:
            got = view.state()
            return all(got.get(k) == found[k] for k in keys)

        await until(same, "the consumer to hold the cluster's final state", 20)
        stop.set()

    got = view.state()
    assert {k: got.get(k) for k in keys} == found
    # it followed the map: n3 streams its actives now, the victim nothing
    stats = view.stats
    final, _ = await c.read_map()
    assert final is not None and stats["config_rev"] >= 1
    n3_actives = sum(1 for vb in range(c.num_vbuckets) if final.active(vb) == "n3")
    if victim != "n3":
        assert stats["nodes"][c.address("n3")]["vbuckets"] == n3_actives > 0
    assert stats["nodes"].get(c.address(victim), {"vbuckets": 0})["vbuckets"] == 0
    assert stats["stream_requests"] > c.num_vbuckets  # moved streams were requested again
    assert found[keys[-1]] == b"d|" + keys[-1]
    for t, ev in view.rollbacks:
        # only a branch that diverged: the killed active's vbuckets, after the kill
        assert t >= killed_at and ev.vbucket in victims_vbs, ev
        assert ev.rollback_seqno < ev.seqno
    c.assert_no_crash()


async def test_the_docs_cluster_example_runs_on_two_nodes(
    etcd_cluster: EtcdCluster, tmp_path: Path
) -> None:
    assert CLUSTER_EXAMPLES, "docs/sdk.md has no cluster example"
    c = etcd_cluster
    await c.start("n1", "n2")
    await c.wait_settled(["n1", "n2"], timeout=40)
    env = dict(
        os.environ,
        DCP_BOOTSTRAP=f"{c.address('n1')},{c.address('n2')}",
        PYTHONPATH=str(DOC.parents[1]),
    )
    for i, example in enumerate(CLUSTER_EXAMPLES):
        script = tmp_path / f"cluster_example_{i}.py"
        script.write_text(example)
        with trio.fail_after(30):
            proc = await trio.run_process(
                [sys.executable, str(script)],
                env=env,
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
        assert proc.returncode == 0, proc.stderr.decode()[-2000:]
        # it streamed from both nodes: each holds actives of a settled two-node map
        out = proc.stdout.decode()
        assert c.address("n1") in out and c.address("n2") in out, out
