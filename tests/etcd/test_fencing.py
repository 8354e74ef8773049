"""Fencing on trio's MockClock with the fake store: the node stops writes before etcd
could expire its lease, whatever happens to its keepalives."""

from __future__ import annotations

from pathlib import Path

import trio
import trio.testing

from dcp.producer.cluster.membership import Membership

from .fakes import FakeHooks, FakeStore


def member(store: FakeStore, hooks: FakeHooks, tmp_path: Path, **kw: object) -> Membership:
    return Membership(
        store,
        hooks,
        cluster="c",
        node_name="n1",
        address="127.0.0.1:11210",
        num_vbuckets=16,
        data_dir=tmp_path,
        **kw,  # type: ignore[arg-type]
    )


async def wait_for(hooks: FakeHooks, kind: str, limit: float = 60) -> float:
    with trio.fail_after(limit):
        while kind not in hooks.kinds():
            await trio.sleep(0.01)
    return next(t for t, k in hooks.events if k == kind)


async def test_fences_before_etcd_can_expire_the_lease(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    store, hooks = FakeStore(), FakeHooks()
    m = member(store, hooks, tmp_path, lease_ttl=5)
    await m.join()
    async with trio.open_nursery() as nursery:
        await nursery.start(m.run)
        await trio.sleep(30)  # healthy keepalives: no fence
        assert hooks.events == [] and m.writes_allowed()
        assert len(store.keepalives) >= 15
        store.hang = True  # keepalives never answer from now on
        expiry = store.lease_expires_at(m.lease)
        fenced = await wait_for(hooks, "fence")
        assert fenced < expiry  # before etcd could drop the node
        assert fenced >= expiry - m.fence_margin - 1e-6  # and not needlessly early
        assert not m.writes_allowed()
        nursery.cancel_scope.cancel()


async def test_fence_point_counts_from_when_the_keepalive_was_sent(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """A keepalive whose answer comes back late: etcd extended the lease when it handled
    it, so a fence point counted from the answer would come after the expiry."""
    store, hooks = FakeStore(), FakeHooks()
    m = member(store, hooks, tmp_path, lease_ttl=5)  # margin 1 s
    await m.join()
    async with trio.open_nursery() as nursery:
        await nursery.start(m.run)
        await trio.sleep(3)
        store.reply_delay = 1.5  # longer than the margin
        await trio.sleep(2.5)
        n = len(store.keepalives)
        while len(store.keepalives) == n:  # one slow keepalive handled...
            await trio.sleep(0.01)
        store.hang = True  # ...then nothing answers any more
        expiry = store.lease_expires_at(m.lease)
        fenced = await wait_for(hooks, "fence")
        assert fenced < expiry, (fenced, expiry)
        nursery.cancel_scope.cancel()


async def test_lapsed_lease_registers_again_and_stays_fenced(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    store, hooks = FakeStore(), FakeHooks()
    m = member(store, hooks, tmp_path, lease_ttl=3)
    await m.join()
    first = m.lease
    async with trio.open_nursery() as nursery:
        await nursery.start(m.run)
        await trio.sleep(5)
        store.down = True
        await trio.sleep(10)  # far past the TTL
        store.down = False
        await wait_for(hooks, "rejoined")
        assert hooks.kinds() == ["fence", "rejoined"]
        assert m.lease != first and store.kv["/dcp/c/nodes/n1"].lease == m.lease
        await trio.sleep(5)
        assert not m.writes_allowed()  # until the node has read the map: resume()
        assert m.resume() and m.writes_allowed()
        nursery.cancel_scope.cancel()


async def test_keepalive_after_the_fence_on_the_same_lease_restores(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    store, hooks = FakeStore(), FakeHooks()
    m = member(store, hooks, tmp_path, lease_ttl=6, fence_margin=3)  # keepalive every 2 s
    await m.join()
    async with trio.open_nursery() as nursery:
        await nursery.start(m.run)
        await trio.sleep(1)
        store.down = True
        fenced = await wait_for(hooks, "fence")
        store.down = False
        restored = await wait_for(hooks, "restored")
        assert fenced < restored < fenced + 3
        assert m.writes_allowed() and m.lease == store.kv["/dcp/c/nodes/n1"].lease
        nursery.cancel_scope.cancel()


async def test_a_frozen_process_refuses_writes_before_its_watchdog_runs(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """SIGSTOP then SIGCONT: the clock has moved past the fence point and a request may be
    served before the watchdog task is scheduled; the synchronous gate already says no."""
    store, hooks = FakeStore(), FakeHooks()
    m = member(store, hooks, tmp_path, lease_ttl=5)
    await m.join()
    async with trio.open_nursery() as nursery:
        await nursery.start(m.run)
        await trio.sleep(2)
        assert m.writes_allowed()
        autojump_clock.jump(20)  # frozen for 20 s; no task has run since
        assert hooks.events == []  # the watchdog has not run yet...
        assert not m.writes_allowed()  # ...and writes are refused all the same
        await wait_for(hooks, "fence")
        nursery.cancel_scope.cancel()
