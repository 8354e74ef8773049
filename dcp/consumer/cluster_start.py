"""Where a cluster-aware ``DcpClient`` starts (and, ``to_latest``, ends) each vbucket, and
the small requests the cluster runner asks of nodes.

Rules of this module:
- ``resolve_positions`` runs once, before any stream: explicit and saved offsets need no
  request; ``StartFrom.NOW`` and ``to_latest`` read each active's high seqnos (and
  failover logs) from the node the map names, retried with backoff (refreshing the map)
  until the client's ``retry_timeout``. The positions themselves are the supervisor's
  (``Supervisor.resolve``), exactly as against one node.
- ``to_latest``: each node's failover logs are read *before* its seqnos, so a failover
  in between makes the end lower (``Session.clamp_end`` finds the branch) rather than
  hiding the branch that lost the tail behind a reference log that already has it.
- The requests (``failover_logs``, ``seqnos_in``, ``cluster_config``...) are named
  functions, not lambdas, so the runner's generic ``ask`` is typed end to end.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from dcp.protocol.cluster_config import format_address

from .connection import DcpConnection
from .errors import RetryTimeoutError, TransientError, UsageError
from .offset import FailoverLog, StartFrom
from .routing import backoff

if TYPE_CHECKING:  # the runner calls in
    from .cluster import ClusterRunner

__all__ = [
    "ACTIVE",
    "REPLICA",
    "NoActiveError",
    "active_and_replica_seqnos",
    "cluster_config",
    "failover_logs",
    "resolve_positions",
    "seqnos_in",
]

ACTIVE, REPLICA = 1, 2  #: vbucket states of GET_ALL_VB_SEQNOS


class NoActiveError(TransientError):
    """The map names no active node for a vbucket (a failover has not happened yet)."""


async def resolve_positions(runner: ClusterRunner) -> None:
    """Start positions from the nodes the map names (see the module rules)."""
    sup = runner.sup
    n = runner.config.num_vbuckets
    vbs = sup.vbuckets if sup.vbuckets is not None else list(range(n))
    bad = [vb for vb in vbs if vb >= n]
    if bad:
        raise UsageError(f"vbuckets {bad[:5]} not in the cluster's {n}")
    if not (sup.to_latest or sup.start is StartFrom.NOW):  # the map lists the vbuckets
        await sup.resolve(vbs, {}, None)
        return
    since = trio.current_time()
    attempts = 0
    while True:
        try:
            high, end_logs = await _seqnos_and_logs(runner, vbs)
            await sup.resolve(vbs, high, _logs_of(runner, end_logs), end_logs or None)
            return
        except Exception as exc:
            if not sup.transient(exc):
                raise
            attempts += 1
            now = trio.current_time()
            if now - since >= sup.retry_timeout:
                err = RetryTimeoutError(
                    "connect", attempts=attempts, elapsed=now - since, last_error=exc
                )
                raise err from exc
            await trio.sleep(backoff(attempts))
            await runner.refresh()


async def _seqnos_and_logs(
    runner: ClusterRunner, vbs: list[int]
) -> tuple[dict[int, int], dict[int, FailoverLog]]:
    """The actives' high seqnos of ``vbs`` and, ``to_latest``, their failover logs."""
    config = runner.config
    missing = config.without_active(vbs)
    if missing:
        raise NoActiveError(f"the map names no active for vbuckets {missing[:8]}")
    high: dict[int, int] = {}
    logs: dict[int, FailoverLog] = {}
    for addr, mine in config.actives_by_node(vbs).items():
        if runner.sup.to_latest:
            logs.update(await runner.ask(addr, failover_logs(mine)))
        got = dict(await runner.ask(addr, seqnos_in(ACTIVE)))
        stale = [vb for vb in mine if vb not in got]
        if stale:  # the map moved them on: refresh, ask again
            raise NoActiveError(
                f"{format_address(addr)} holds no active vbuckets {stale[:8]} (map rev "
                f"{config.rev})"
            )
        high.update((vb, got[vb]) for vb in mine)
    return high, logs


def _logs_of(
    runner: ClusterRunner, known: dict[int, FailoverLog]
) -> Callable[[list[int]], Awaitable[dict[int, FailoverLog]]]:
    """Failover logs of vbuckets (``StartFrom.NOW``) from their actives, reusing those
    already read."""

    async def logs(now_vbs: list[int]) -> dict[int, FailoverLog]:
        out = {vb: known[vb] for vb in now_vbs if vb in known}
        rest = [vb for vb in now_vbs if vb not in out]
        for addr, mine in runner.config.actives_by_node(rest).items():
            out.update(await runner.ask(addr, failover_logs(mine)))
        return out

    return logs


def failover_logs(vbs: list[int]) -> Callable[[DcpConnection], Awaitable[dict[int, FailoverLog]]]:
    """The request: failover logs of ``vbs``."""

    async def ask(c: DcpConnection) -> dict[int, FailoverLog]:
        return await c.get_failover_logs(vbs)

    return ask


def seqnos_in(state: int) -> Callable[[DcpConnection], Awaitable[list[tuple[int, int]]]]:
    """The request: (vb, high seqno) of the node's vbuckets in ``state``."""

    async def ask(c: DcpConnection) -> list[tuple[int, int]]:
        return await c.get_all_vb_seqnos(state)

    return ask


async def cluster_config(c: DcpConnection) -> bytes | None:
    """The request: the node's config JSON (None: it does not know the command)."""
    return await c.get_cluster_config()


async def active_and_replica_seqnos(
    c: DcpConnection,
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The request: the node's active and replica high seqnos (one connection for both)."""
    return await c.get_all_vb_seqnos(ACTIVE), await c.get_all_vb_seqnos(REPLICA)
