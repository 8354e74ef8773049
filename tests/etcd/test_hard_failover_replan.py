"""A manual hard failover of a LIVE node chooses the replica to promote from seqnos read
once the node's actives are dead (cluster/failover_ops.py), not from those read before.

Until its actives are set dead the node takes writes and counts its replicas' acks
(dcp/producer/durability.py): a replica that led when first read may fall behind
another, which then holds writes answered at MAJORITY (the node and it). Promoting the
first one would lose them as soon as its catch-up gives up. Here, with fake nodes
(tests/etcd/orchestrator_fakes.py), the replica first in each chain stops copying right
after the first read, while the other keeps up until the node is dead."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from dcp.producer.cluster import failover_ops

from .conftest import EtcdProcess
from .orchestrator_fakes import A, D
from .test_orchestrator import harness, one_active_each


async def _ok(value: bool) -> bool:
    return value


async def test_a_live_node_hard_failed_over_promotes_the_replica_ahead_once_it_is_dead(
    etcd_server: EtcdProcess, cluster_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(failover_ops, "CATCH_UP_WAIT", 0.5)  # a lagging copy never catches up
    async with harness(etcd_server, cluster_name, ["n1", "n2", "n3"], num_replicas=2) as h:
        m = await h.settled_map(lambda m: len(m.servers) == 3)
        await h.until(lambda: _ok(one_active_each(h, m)))
        await trio.sleep(0.1)  # every copy holds data
        nodes = h.nodes
        mine = [vb for vb in range(16) if m.active(vb) == "n2"]
        laggard = m.replicas(mine[0])[0]  # first in the chain: the tie-break's choice
        other = next(n for n in ("n1", "n3") if n != laggard)
        tails: dict[int, dict[str, int]] = {}
        real_logs = nodes.failover_logs
        real_seqnos = nodes.seqnos

        async def logs_then_lag(address: str, vbs: list[int]) -> Any:
            # the plan's reads are done (both replicas caught up: a tie); from now on the
            # laggard copies nothing while n2 takes writes and the other copies them
            if not nodes.nodes[laggard].lagging:
                nodes.nodes[laggard].lagging = True
                await trio.sleep(0.15)
            return await real_logs(address, vbs)

        async def seqnos(address: str, state: Any) -> dict[int, int]:
            if state == D and not tails:  # n2's tail, read once its actives are dead
                tails.update(
                    {vb: {n: nodes.nodes[n].seqno[vb] for n in (laggard, other)} for vb in mine}
                )
            return await real_seqnos(address, state)

        nodes.failover_logs = logs_then_lag  # type: ignore[method-assign]
        nodes.seqnos = seqnos  # type: ignore[method-assign]
        key = h.prefix + "requests/failover"
        doc = {"id": "f5", "node": "n2", "graceful": False}
        assert await h.store.compare_and_put(key, json.dumps(doc).encode(), mod_revision=0)

        async def answered() -> dict[str, Any] | None:
            st = await h.status()
            part = st.get("failover", {}) if st else {}
            return part if part.get("id") == "f5" and part.get("state") == "done" else None

        await h.until(answered)
        new, _ = await h.map()
        assert new is not None and "n2" not in new.servers
        assert tails, "n2's actives were never read dead"
        ahead = [vb for vb in mine if tails[vb][other] > tails[vb][laggard]]
        assert ahead, f"{other} never got ahead of {laggard}: {tails}"
        lost = {vb: tails[vb] for vb in ahead if new.active(vb) != other}
        assert not lost, f"promoted {laggard}, behind {other} when n2 was dead: {lost}"
        assert all(nodes.nodes[new.active(vb) or ""].state[vb] == A for vb in mine)
        assert nodes.violations == []
