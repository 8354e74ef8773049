"""The orchestrator decodes the map only when its entry changed (orchestrator.py
``_map_of``): every poll still reads etcd, but an unchanged map revision is not parsed
again, a changed one is, and a malformed map is refused every time."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import trio

from dcp.producer.cluster.membership import cluster_prefix
from dcp.producer.cluster.orchestrator import Orchestrator, OrchestratorSettings
from dcp.producer.cluster.placement import compute_map
from dcp.producer.cluster.store import Entry, Snapshot
from dcp.producer.cluster.vbmap import VBucketMap

from .conftest import EtcdProcess
from .test_orchestrator import harness

CLUSTER = "c"
P = cluster_prefix(CLUSTER)


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The file of the caller of every ``VBucketMap.from_json`` call made from now on
    (the real decoder runs)."""
    calls: list[str] = []
    real = VBucketMap.from_json.__func__  # type: ignore[attr-defined]

    def counting(cls: type[VBucketMap], data: Any, known: Any = None) -> VBucketMap:
        calls.append(os.path.basename(sys._getframe(1).f_code.co_filename))
        return real(cls, data, known)

    monkeypatch.setattr(VBucketMap, "from_json", classmethod(counting))
    return calls


def _orchestrators(parses: list[str]) -> int:
    """The parses made for the orchestrator's views (now in orchestrator.py; before the
    cache, in view.py), not the test's or the fake nodes' own reads of the map."""
    return sum(1 for f in parses if f in ("orchestrator.py", "view.py"))


class _Store:
    """A stub of the one store call ``refresh`` makes: the snapshot the test set."""

    def __init__(self) -> None:
        self.snap = Snapshot(0, {})
        self.reads = 0

    async def get_prefix(self, prefix: str) -> Snapshot:
        assert prefix == P
        self.reads += 1
        return self.snap

    def set_map(self, value: bytes, mod_revision: int) -> None:
        node = Entry(P + "nodes/n1", b"", mod_revision - 1, mod_revision - 1)
        entries = {P + "nodes/n1": node, P + "map": Entry(P + "map", value, mod_revision, 2)}
        self.snap = Snapshot(mod_revision, entries)


class _Leadership:
    node, term = "orch", 1


def _orchestrator(store: _Store) -> Orchestrator:
    settings = OrchestratorSettings(cluster=CLUSTER, num_vbuckets=16)
    return Orchestrator(store, _Leadership(), None, settings)  # type: ignore[arg-type]


async def test_an_unchanged_map_revision_is_not_parsed_again(parses: list[str]) -> None:
    store = _Store()
    orch = _orchestrator(store)
    first = compute_map(["n1", "n2"], 16, 1)
    store.set_map(first.to_json(), 10)
    v1 = await orch.refresh()
    v2 = await orch.refresh()
    v3 = await orch.refresh()
    assert store.reads == 3  # every refresh still reads etcd
    assert len(parses) == 1
    assert v1.vbmap == v2.vbmap == v3.vbmap == first
    assert v1 == v2 == v3 and v3.map_revision == 10
    # a new revision is parsed, even with the same bytes (a rewrite of the same map)
    store.set_map(first.to_json(), 11)
    v4 = await orch.refresh()
    assert len(parses) == 2 and v4.vbmap == first and v4.map_revision == 11
    # a changed map is parsed and acted on
    second = compute_map(["n1", "n2", "n3"], 16, 1, first)
    store.set_map(second.to_json(), 12)
    v5 = await orch.refresh()
    assert len(parses) == 3 and v5.vbmap == second and v5.map_revision == 12
    await orch.refresh()
    assert len(parses) == 3
    # the same revision with other bytes (no real etcd does it) is not trusted either
    store.set_map(first.to_json(), 12)
    assert (await orch.refresh()).vbmap == first
    assert len(parses) == 4


async def test_a_malformed_map_is_refused_at_every_read_and_never_kept(
    parses: list[str],
) -> None:
    store = _Store()
    orch = _orchestrator(store)
    good = compute_map(["n1"], 16, 1)
    store.set_map(good.to_json(), 5)
    await orch.refresh()
    store.set_map(b"{not json", 6)
    for _ in range(2):
        with pytest.raises(ValueError, match="not JSON"):
            await orch.refresh()
    assert len(parses) == 3
    store.set_map(good.to_json(), 7)
    assert (await orch.refresh()).vbmap == good


async def test_an_idle_orchestrator_on_etcd_parses_the_map_once_per_write(
    etcd_server: EtcdProcess, cluster_name: str, parses: list[str]
) -> None:
    """Polling every 0.05 s, the loop and the follower read the prefix ~40 times a
    second; only a map write makes either parse."""
    async with harness(etcd_server, cluster_name, ["n1", "n2"]) as h:
        m = await h.settled_map(lambda m: len(m.servers) == 2)
        await trio.sleep(0.3)  # the orchestrator reads the settled map
        before = _orchestrators(parses)
        await trio.sleep(1.0)
        assert _orchestrators(parses) == before, "an unchanged map was parsed again"
        await h.store.put(h.prefix + "map", m.to_json())  # the same map, a new revision

        async def seen() -> bool:
            return _orchestrators(parses) > before

        await h.until(seen, timeout=10)
        await trio.sleep(1.0)
        assert _orchestrators(parses) == before + 1
