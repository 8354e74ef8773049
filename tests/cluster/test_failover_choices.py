"""Which replica a failover promotes when seqnos tie, and which replicas an automatic
failover needs answers from (cluster/failover.py, cluster/failover_ops.py). Pure, or
against stand-ins of the orchestrator and its node control."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from dcp.producer.cluster.failover import plan_failover
from dcp.producer.cluster.failover_ops import auto_failover
from dcp.producer.cluster.vbmap import VBucketMap
from dcp.protocol.opcodes import VBucketState

#: vb uuids: the branch everyone started on, and the one a takeover began at seqno 5
U_OLD, U_NEW = 0x1111, 0x2222


def test_a_tie_goes_to_the_copy_on_the_newest_branch() -> None:
    """b and c both hold 5. c's log says a new branch began at 5 (the failed active's
    takeover, no item on it yet): c follows the failed active's history, b has not
    heard of it. Promoting b (first in chain order) would make c, and every copy on
    the new branch, roll back: b's log does not know U_NEW."""
    chains: list[list[str | None]] = [["a", "b", "c"]]
    vbmap = VBucketMap.from_names(2, chains, servers=["a", "b", "c"])
    seqnos = {"b": {0: 5}, "c": {0: 5}}
    logs = {"b": {0: [(U_OLD, 0)]}, "c": {0: [(U_NEW, 5), (U_OLD, 0)]}}
    assert plan_failover(vbmap, "a", {"b", "c"}, seqnos, logs).promoted == {0: "c"}
    # the other way round in the chain: the same choice
    swapped = VBucketMap.from_names(2, [["a", "c", "b"]], servers=["a", "b", "c"])
    assert plan_failover(swapped, "a", {"b", "c"}, seqnos, logs).promoted == {0: "c"}
    # not a tie: the higher seqno wins as before, whatever the branches
    ahead = {"b": {0: 6}, "c": {0: 5}}
    assert plan_failover(vbmap, "a", {"b", "c"}, ahead, logs).promoted == {0: "b"}
    # a tie on the same branch: chain order
    same = {"b": {0: [(U_NEW, 5), (U_OLD, 0)]}, "c": {0: [(U_NEW, 5), (U_OLD, 0)]}}
    assert plan_failover(vbmap, "a", {"b", "c"}, seqnos, same).promoted == {0: "b"}


class _Control:
    """Node control as the orchestrator uses it: seqnos and failover logs per node."""

    def __init__(self, seqnos: dict[str, dict[int, int]]) -> None:
        self._seqnos = seqnos
        self.log_requests: list[tuple[str, list[int]]] = []

    async def seqnos(self, address: str, state: VBucketState) -> dict[int, int]:
        assert state == VBucketState.REPLICA
        return dict(self._seqnos[address])

    async def failover_logs(self, address: str, vbs: list[int]) -> dict[int, list[Any]]:
        self.log_requests.append((address, vbs))
        return {vb: [(U_OLD, 0)] for vb in vbs}


class _Store:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    async def get(self, key: str) -> Any:
        value = self.values.get(key)
        return None if value is None else SimpleNamespace(value=value, mod_revision=1)

    async def compare_and_put(self, key: str, value: bytes, *, mod_revision: int) -> int:
        self.values[key] = value
        return 2


class _Board:
    def __init__(self) -> None:
        self.failovers: list[dict[str, Any]] = []

    def set_failover(self, **fields: Any) -> None:
        self.failovers.append(fields)


async def test_a_replica_holding_none_of_the_failed_nodes_vbuckets_does_not_block_it() -> None:
    """c is a replica of a's vb 0 in the map but answered its seqnos without vb 0 in
    replica state (its copy is not built yet): there is nothing to ask it a failover
    log for, and it must not count as a replica that did not answer (the automatic
    failover was refused at every poll)."""
    chains: list[list[str | None]] = [["a", "b", "c"], ["b", "c", "a"]]
    vbmap = VBucketMap.from_names(2, chains, servers=["a", "b", "c"])
    control = _Control({"b": {0: 7}, "c": {1: 3}})
    written: list[VBucketMap] = []

    async def write_map(new: VBucketMap, revision: int, guards: Any = None) -> int:
        written.append(new)
        return revision + 1

    async def refresh() -> None:
        pass

    orch = SimpleNamespace(
        settings=SimpleNamespace(auto_failover_timeout=1.0, auto_failover_max_count=3),
        down_for=lambda node: 10.0,
        control=control,
        board=_Board(),
        say=lambda text: None,
        store=_Store(),
        prefix="/c/",
        write_map=write_map,
        refresh=refresh,
    )
    view = SimpleNamespace(
        down=lambda: ["a"],
        live={"b", "c"},
        auto_count=0,
        address=lambda node: node,
        map_revision=5,
    )
    assert await auto_failover(orch, view, vbmap)  # type: ignore[arg-type]
    assert [f["state"] for f in orch.board.failovers] == ["done"], orch.board.failovers
    assert control.log_requests == [("b", [0])]  # c had nothing to be asked about
    (new,) = written
    assert new.names(0) == ("b", "c", None)
    assert json.loads(orch.store.values["/c/autofailover"])["count"] == 1
