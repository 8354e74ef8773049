"""kill -9 of the replica or of the active at random points under write load, 20 rounds,
with the convergence check after each.

Each round a writer runs against the active A; after a random delay one node gets
SIGKILL and is restarted with the same data directory and arguments. A killed active
may lose writes it acknowledged but had not flushed (non-durable writes allow that),
and its replica B may have received some of them: B must then roll back, because after
convergence B holds exactly A's history (high seqnos, failover logs, items), never
something A's history does not. Between rounds a sample of vbuckets is compared item by
item; after the last round all of them. Twice: without a history window (B's rollbacks
of updated keys cannot be exact and reset those vbuckets to 0, a full re-sync) and with
one (superseded versions are on disk: every rollback of B must be exact).

The RNG is seeded: ``DCP_CLUSTER_SEED=N`` replays a run (the seed is printed and named
in every failure).

Rules of this module: real processes on loopback (``nodes.py``), 32 vbuckets, the writer
bounded per round, every wait bounded.
"""

from __future__ import annotations

import os
import random

import pytest
import trio

from .conftest import Cluster
from .nodes import Load, assert_same, wait_caught_up

NVB = 32
ROUNDS = 20


async def _write(load: Load, port: int, ops: int) -> None:
    """A round's writes; a lost connection (the active killed under it) ends them."""
    try:
        await load.run(port, ops, NVB, batch=50, timeout=5)
    except Exception:  # whatever the kill caused: acknowledged writes are what count
        pass


@pytest.mark.parametrize(
    ("history", "rounds"), [(False, ROUNDS), (True, 10)], ids=["no-history", "history"]
)
async def test_kill_9_of_replica_or_active_at_random_points_then_exact_convergence(
    cluster: Cluster, history: bool, rounds: int
) -> None:
    seed = int(os.environ.get("DCP_CLUSTER_SEED", "1414"))
    print(f"kill rounds: DCP_CLUSTER_SEED={seed}")
    rng = random.Random(seed)
    args = ["--history-seconds", "3600" if history else "0"]
    args += ["--history-bytes", str(1 << 30) if history else "0"]
    a = await cluster.node("a", NVB, args).start()
    b = await cluster.node("b", NVB, [*args, "--replica-of", a.address]).start()
    load = Load(random.Random(rng.getrandbits(64)), keys=600)
    kills = {"active": 0, "replica": 0}
    for rnd in range(rounds):
        victim_name = rng.choice(("active", "replica"))
        victim = a if victim_name == "active" else b
        delay = rng.uniform(0.02, 0.4)
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_write, load, a.port, 3000)
                await trio.sleep(delay)
                victim.kill()
                kills[victim_name] += 1
                if victim is a:
                    nursery.cancel_scope.cancel()  # its writes now go nowhere
                else:
                    await victim.start()  # the writer goes on meanwhile
            if victim is a:
                await victim.start()
        where = f"seed {seed} round {rnd} ({victim_name} killed after {delay:.2f} s)"
        try:
            await wait_caught_up(a, b, timeout=60)
            sample = rng.sample(range(NVB), 4)
            await assert_same(a, b, sample)
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}") from exc
    assert min(kills.values()) >= rounds // 5, kills
    rollbacks = b.rollbacks_logged()  # vb -> (reached, asked), the replica's last per vb
    assert rollbacks, f"seed {seed}: no round made the replica roll back"
    if history:
        # the superseded versions are on disk: every rollback is exact, never a reset
        assert all(reached == asked for reached, asked in rollbacks.values()), rollbacks
    await wait_caught_up(a, b, timeout=60)
    assert await assert_same(a, b) > 100, f"seed {seed}"
    assert load.acked > 5000
    cluster.assert_no_crash()
