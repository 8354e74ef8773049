"""Rejoining after an unclean shutdown (cluster/rejoin.py): who waits to be failed over,
for how long, what it logs; on trio's MockClock with a stand-in for etcd's prefix read,
and ``Membership.join`` holding its registration while it waits.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import trio

from dcp.producer.cluster.election import map_key
from dcp.producer.cluster.membership import Membership
from dcp.producer.cluster.rejoin import MARKER, UncleanRejoin, held_actives
from dcp.producer.cluster.store import Entry, Snapshot, StoreUnavailable
from dcp.producer.cluster.vbmap import VBucketMap
from dcp.producer.config import ConfigError, ServerConfig, add_arguments, load_config

from .fakes import FakeHooks, FakeStore

ME = "n1"
#: vb 0 active here with a copy on n2, vb 1 a replica here, vb 2 active with no other
#: copy, vb 3 active with a copy on n3
CHAINS: list[list[str | None]] = [["n1", "n2"], ["n2", "n1"], ["n1", None], ["n1", "n3"]]
#: after the failover of n1: its actives promoted where a copy was, vb 2 left to it
FAILED_OVER: list[list[str | None]] = [["n2", None], ["n2", None], ["n1", None], ["n3", None]]


@pytest.fixture(autouse=True)
def _file_io_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the wait's marker-file work inline instead of in a worker thread: while a task
    waits on a thread the autojump clock sees the run idle and jumps to the next deadline,
    so on a loaded machine a ``move_on_after`` of the test could fire before the marker
    was written (a fresh-clone run failed that way). The file operations are tiny."""

    async def run_sync(fn: Callable[..., object], *args: object, **_kwargs: object) -> object:
        await trio.lowlevel.checkpoint()
        return fn(*args)

    monkeypatch.setattr(trio.to_thread, "run_sync", run_sync)


def vbmap(chains: Sequence[Sequence[str | None]]) -> VBucketMap:
    return VBucketMap.from_names(1, chains)


class PrefixStore:
    """etcd's prefix read as the wait uses it: the map (None: no map), or down. ``at``:
    {seconds after the first read: what happens then} ("down", or new chains). Changes
    are timed by the reads, not by a task of the test: the autojump clock would jump to
    such a task's deadline while the wait writes its marker file in a thread."""

    def __init__(
        self, chains: Sequence[Sequence[str | None]] | None, at: dict[float, object] | None = None
    ) -> None:
        self.chains = chains
        self.at = dict(at or {})
        self.down = False
        self.reads = 0
        self.revision = 10
        self.first = 0.0
        self.marked: list[bool] = []
        self.marker: Path | None = None

    def set(self, chains: Sequence[Sequence[str | None]] | None) -> None:
        self.chains = chains
        self.revision += 1

    async def get_prefix(self, prefix: str) -> Snapshot:
        now = trio.current_time()
        if not self.reads:
            self.first = now
        self.reads += 1
        for when in sorted(self.at):
            if now - self.first >= when:
                what = self.at.pop(when)
                if what == "down":
                    self.down = True
                else:
                    self.set(what)  # type: ignore[arg-type]
        if self.marker is not None:
            self.marked.append(self.marker.exists())
        if self.down:
            raise StoreUnavailable("fake etcd is down")
        entries = {}
        if self.chains is not None:
            key = map_key("c")
            assert key.startswith(prefix)
            value = vbmap(self.chains).to_json()
            entries[key] = Entry(key, value, self.revision, 2)
        return Snapshot(self.revision, entries)


def rejoin(
    store: PrefixStore, tmp_path: Path, *, unclean: bool = True, limit: float = 40.0
) -> UncleanRejoin:
    return UncleanRejoin(
        store,
        cluster="c",
        node_name=ME,
        data_dir=tmp_path,
        unclean=unclean,
        limit=limit,
        interval=0.25,
    )


def test_held_actives_are_the_actives_with_another_copy() -> None:
    assert held_actives(vbmap(CHAINS), ME) == [0, 3]
    assert held_actives(vbmap(CHAINS), "n2") == [1]
    assert held_actives(vbmap(FAILED_OVER), ME) == []  # vb 2: no other copy, no wait
    assert held_actives(None, ME) == []
    three = [["n1", None, "n3"], ["n1", None, None], ["n2", "n1", "n3"]]
    assert held_actives(VBucketMap.from_names(2, three), ME) == [0]


async def test_an_unclean_restart_waits_until_failed_over_and_says_so(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "dcp.cluster")
    store = PrefixStore(CHAINS, at={65.0: FAILED_OVER})
    store.marker = tmp_path / MARKER
    r = rejoin(store, tmp_path, limit=100)
    start = trio.current_time()
    await r.hold()
    waited = trio.current_time() - start
    assert 65 <= waited <= 65.5, waited
    assert r.outcome == "failed over"
    assert store.marked[0] is False and all(store.marked[1:])  # set while it waits
    assert r.read is not None and r.read.revision == store.revision  # what it reconciles with
    assert not (tmp_path / MARKER).exists()
    lines = [(rec.levelname, rec.getMessage()) for rec in caplog.records]
    assert (
        lines[0][0] == "WARNING" and "active for 2 vbuckets with other copies (0,3)" in lines[0][1]
    )
    waiting = [m for lv, m in lines if lv == "INFO" and "still waiting" in m]
    assert len(waiting) == 2, lines  # one every 30 s
    assert lines[-1] == ("INFO", "cluster: n1 was failed over after 65.0 s: rejoining")


async def test_not_failed_over_in_time_it_joins_anyway_with_a_warning(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = PrefixStore(CHAINS)
    r = rejoin(store, tmp_path, limit=20)
    start = trio.current_time()
    await r.hold()
    assert 20 <= trio.current_time() - start <= 20.5
    assert r.outcome == "timed out" and not (tmp_path / MARKER).exists()
    last = caplog.records[-1]
    assert last.levelname == "WARNING"
    assert "not failed over within 20 s: rejoining anyway" in last.getMessage()
    assert "MAJORITY writes it had not persisted" in last.getMessage()


async def test_etcd_away_while_waiting_counts_toward_the_limit(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    store = PrefixStore(CHAINS, at={1.0: "down"})
    r = rejoin(store, tmp_path, limit=10)
    start = trio.current_time()
    await r.hold()
    assert 10 <= trio.current_time() - start <= 10.5 and r.outcome == "timed out"


@pytest.mark.parametrize(
    ("unclean", "chains", "limit"),
    [
        (False, CHAINS, 40.0),  # a clean shutdown: everything was persisted
        (True, FAILED_OVER, 40.0),  # already failed over; vb 2 has no other copy
        (True, None, 40.0),  # no map yet
        (True, CHAINS, 0.0),  # the operator turned the wait off
    ],
)
async def test_who_joins_at_once(
    autojump_clock: trio.testing.MockClock,
    tmp_path: Path,
    unclean: bool,
    chains: list[list[str | None]] | None,
    limit: float,
) -> None:
    store = PrefixStore(chains)
    r = rejoin(store, tmp_path, unclean=unclean, limit=limit)
    start = trio.current_time()
    await r.hold()
    assert trio.current_time() == start and r.outcome == "" and r.read is None
    assert store.reads <= 1 and not (tmp_path / MARKER).exists()


async def test_a_restart_during_a_wait_waits_again_even_when_clean(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    store = PrefixStore(CHAINS)
    first = rejoin(store, tmp_path, limit=100)
    with trio.move_on_after(5):  # stopped while waiting (SIGTERM, or kill -9)
        await first.hold()
    assert (tmp_path / MARKER).exists()
    store = PrefixStore(CHAINS, at={7.0: FAILED_OVER})
    again = rejoin(store, tmp_path, unclean=False, limit=100)
    start = trio.current_time()
    await again.hold()
    assert 7 <= trio.current_time() - start <= 7.5
    assert again.outcome == "failed over" and not (tmp_path / MARKER).exists()
    # once failed over, a marker left behind (a crash between) lets the next start join
    (tmp_path / MARKER).write_text("left over")
    last = rejoin(store, tmp_path, unclean=False)
    await last.hold()
    assert last.outcome == "" and not (tmp_path / MARKER).exists()


async def test_join_holds_its_registration_while_waiting(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """The old lease's key is left to lapse: the new one is registered only after the
    wait, so the orchestrator sees the node down meanwhile."""
    store = FakeStore()
    key = "/dcp/c/nodes/n1"

    def member() -> Membership:
        return Membership(
            store,
            FakeHooks(),
            cluster="c",
            node_name="n1",
            address="127.0.0.1:1",
            num_vbuckets=4,
            data_dir=tmp_path,
            lease_ttl=2,
        )

    await member().join()  # the run that was killed: its key stays until its lease lapses
    old = await store.get(key)
    assert old is not None
    seen: list[tuple[float, Entry | None]] = []

    async def hold() -> None:
        seen.append((trio.current_time(), await store.get(key)))
        await trio.sleep(10)  # waiting to be failed over
        seen.append((trio.current_time(), await store.get(key)))

    again = member()
    await again.join(hold=hold)
    assert seen[0][1] == old and seen[1][1] is None  # not re-registered: it lapsed
    now = await store.get(key)
    assert now is not None and now.lease == again.lease != old.lease


def test_the_wait_limit_setting_and_its_flag() -> None:
    assert ServerConfig().rejoin_wait() == 10.0 + 5 + 10  # failover timeout + TTL + margin
    derived = ServerConfig(auto_failover_timeout=3.0, cluster_lease_ttl=2)
    assert derived.rejoin_wait() == 15.0
    assert ServerConfig(unclean_rejoin_wait=0).rejoin_wait() == 0
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = load_config(parser.parse_args(["--unclean-rejoin-wait", "7.5"]), environ={})
    assert cfg.rejoin_wait() == 7.5
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="unclean_rejoin_wait"):
            ServerConfig(unclean_rejoin_wait=bad).validate()
