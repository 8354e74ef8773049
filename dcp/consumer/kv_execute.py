"""Running a batch of ``KvClient`` requests across the nodes: one pipelined roundtrip per
node per attempt, retries until the client's deadline.

Rules of this module:
- Each attempt groups the pending requests by their vbucket's node (``KvRouter.group``)
  and sends each node its group with one ``send_all``; the nodes are asked concurrently.
  With one node (always, against a single server) the roundtrip runs inline, and a first
  attempt whose answers are all successful writes returns them as they came: the hot
  path of a one-node client is what it was before clusters.
- Retried until the deadline: NOT_MY_VBUCKET (the map moved: the config in its answer
  is adopted when newer, else the client refreshes its map), ETMPFAIL/EBUSY/ENOMEM,
  a vbucket without an active node (the map is polled), and a lost or unreachable node
  (the map is refreshed). Against a single server no map is fetched: its answers are
  retried with backoff, as they were before clusters. Of the requests a lost
  connection leaves unanswered only GET and plain SET are re-sent (same key, same
  value: safe to repeat); ADD/REPLACE/DELETE and CAS writes fail with
  ``ConnectionLostError`` because whether they were applied is unknown. Other
  statuses are answers, handed back for the caller to raise.
- A batch a silent node may have given up on (``KvNodes.watch``: all GET/plain SET,
  unanswered for ``PATIENCE``, its vbuckets moved by the map) comes back with its
  missing answers None and ``abandoned`` set: they are re-sent by the new map. A
  connection (or its HELLO) not open after as long is checked the same way here (in
  cluster mode only), and since nothing was sent yet any request may then move; the
  connect itself is never cut short for being slow (``KvNodes.connection``).
- Between attempts the client backs off (10 ms doubling to 0.5 s) unless a newer map
  came in, which is a reason to go again at once; a map only counts as newer when its
  rev is higher, so this cannot loop. What is still pending at the deadline gets a
  ``RetryTimeoutError`` naming the first such vbucket and the last error seen.
- Durable writes (any level but none: ``durable`` is true) carry the time left as their
  durability timeout, rewritten per attempt (``kv_requests.with_durability_timeout``);
  without extended errors a durable write's ETMPFAIL is the server's deadline answer:
  ``SyncWriteAmbiguous``, not retried. DURABILITY_IMPOSSIBLE is an answer like any
  other status (``DurabilityImpossibleError``): retrying cannot add copies to the map.
"""

from __future__ import annotations

from typing import cast

import trio

from dcp.protocol.cluster_config import Address
from dcp.protocol.errors import for_status
from dcp.protocol.frames import Frame
from dcp.protocol.opcodes import HelloFeature, Status

from .errors import ConnectionLostError, RetryTimeoutError, SyncWriteAmbiguous, TransientError
from .kv_connection import Batch, KvConnection, Op, WriteOk
from .kv_nodes import PATIENCE, KvNodes
from .kv_requests import durability_timeout_ms, with_durability_timeout

__all__ = ["Result", "execute"]

#: One answer of ``execute``: the response, a successful write's tuple, or the error.
Result = Frame | WriteOk | BaseException
#: What asking one node gave: its connection and answers, or the error that kept it
#: from answering (``retry``: the requests were not sent or may be re-sent as a group).
_Outcome = tuple[KvConnection, Batch] | tuple[None, BaseException]

_RETRIABLE = frozenset((Status.NOT_MY_VBUCKET, Status.ETMPFAIL, Status.EBUSY, Status.ENOMEM))
_NMVB = int(Status.NOT_MY_VBUCKET)
_TRANSIENT = (OSError, trio.TooSlowError, ConnectionLostError)


async def _ask(nodes: KvNodes, addr: Address, ops: list[Op], deadline: float) -> _Outcome:
    """One roundtrip of ``ops`` to ``addr``; a transient failure is returned, not raised.
    Only one cancel scope on the way when the connection is open: the hot path."""
    try:
        with trio.fail_after(max(0.001, deadline - trio.current_time())):
            conn = nodes.ready(addr)
            if conn is None:
                conn = await _connect(nodes, addr, ops, deadline)
                if conn is None:
                    return None, nodes.silent(addr)
            return conn, await conn.roundtrip_batch(ops)
    except _TRANSIENT as exc:
        return None, exc


async def _connect(
    nodes: KvNodes, addr: Address, ops: list[Op], deadline: float
) -> KvConnection | None:
    """``addr``'s connection, however long opening it takes; or, in cluster mode, None
    when it is not open after ``PATIENCE`` and the refreshed map moved a vbucket of
    ``ops`` elsewhere: nothing was sent, so every request may go by the new map. Only the
    waiting stops: the attempt runs on as a task of the client (``KvNodes.connection``),
    and a single server's map cannot move, so it is never looked at there."""
    if nodes.router.single is not None:
        return await nodes.connection(addr)
    while True:
        with trio.move_on_after(PATIENCE):
            return await nodes.connection(addr)
        if await nodes.moved_away(addr, ops, deadline):
            return None


async def _ask_all(
    nodes: KvNodes, groups: dict[Address, list[int]], ops: list[Op], deadline: float
) -> list[tuple[list[int], _Outcome]]:
    """``_ask`` every node of ``groups`` concurrently. A node that fails for a reason
    retrying cannot fix (refused credentials...) fails its own requests only."""
    out: list[tuple[list[int], _Outcome]] = []

    async def one(addr: Address, idxs: list[int]) -> None:
        try:
            got = await _ask(nodes, addr, [ops[i] for i in idxs], deadline)
        except Exception as exc:
            got = (None, _Fatal(exc))
        out.append((idxs, got))

    async with trio.open_nursery() as nursery:
        for addr, idxs in groups.items():
            nursery.start_soon(one, addr, idxs)
    return out


class _Fatal(Exception):
    """Wraps a node's non-retriable failure so that ``execute`` tells it from a lost one."""

    def __init__(self, error: Exception) -> None:
        super().__init__(repr(error))
        self.error = error


async def execute(
    nodes: KvNodes, ops: list[Op], timeout: float, durable: bool = False
) -> list[Result]:
    """Run ``ops``, retrying what is retriable until ``timeout`` (module rules)."""
    router = nodes.router
    results: list[Result | None] = [None] * len(ops)
    pending = list(range(len(ops)))
    start = trio.current_time()
    deadline = start + timeout
    attempts = 0
    backoff = 0.01
    last: BaseException | None = None
    while pending:
        attempts += 1
        groups = router.group(ops, pending)
        unrouted = groups.pop(None, None)
        if durable:
            ms = durability_timeout_ms(deadline - trio.current_time())
            for i in pending:
                ops[i].frame = with_durability_timeout(ops[i].frame, ms)
        if len(groups) == 1:
            ((addr, idxs),) = groups.items()
            got = await _ask(nodes, cast(Address, addr), [ops[i] for i in idxs], deadline)
            batch = got[1]
            if (
                attempts == 1
                and isinstance(batch, Batch)
                and batch.remaining == 0
                and batch.others == 0
                and len(idxs) == len(ops)
            ):
                # no None and no Frame: every answer is a successful write's tuple
                return cast(list[Result], batch.frames)
            asked = [(idxs, got)]
        else:
            asked = await _ask_all(nodes, cast(dict[Address, list[int]], groups), ops, deadline)
        retry: list[int] = []
        hints: set[bytes] = set()  # the values of NOT_MY_VBUCKET answers
        refresh = False
        if unrouted:
            retry += unrouted
            refresh = True
            last = TransientError(
                f"vbucket {ops[unrouted[0]].vbucket} has no active node in the cluster map"
                f" (rev {router.config.rev if router.config else '?'}); waiting for a newer map"
            )
        for idxs, (conn, answer) in asked:
            if not isinstance(answer, Batch):  # conn is None (_Outcome): not asked
                if isinstance(answer, _Fatal):
                    for i in idxs:
                        results[i] = answer.error
                    continue
                if last is None or not isinstance(answer, trio.TooSlowError):
                    last = answer  # a cut-short last attempt says less than what came before
                retry += idxs
                refresh = True
                continue
            assert conn is not None  # a Batch comes with its connection (_Outcome)
            for i, f in zip(idxs, answer.frames, strict=True):
                if isinstance(f, tuple):  # a successful write (kv_connection.py)
                    results[i] = f
                elif f is None:
                    err = answer.abandoned or conn.error or ConnectionLostError("connection lost")
                    refresh = True
                    if ops[i].safe_to_repeat:
                        last = err
                        retry.append(i)
                    else:
                        results[i] = ConnectionLostError(
                            f"connection lost before the answer to opcode "
                            f"0x{ops[i].opcode:02x} for key {ops[i].key!r}: it may or may "
                            f"not have been applied"
                        )
                elif (
                    durable
                    and f.status == Status.ETMPFAIL
                    and HelloFeature.XERROR not in conn.features
                ):
                    # without extended errors the server's deadline answer is ETMPFAIL
                    results[i] = SyncWriteAmbiguous(f.status, f"key {ops[i].key!r}")
                elif f.status in _RETRIABLE:
                    value = bytes(f.value)
                    last = for_status(f.status, value, f"vbucket {ops[i].vbucket}")
                    retry.append(i)
                    if f.status == _NMVB:
                        hints.add(value)
                else:
                    results[i] = f
        pending = retry
        if not pending:
            break
        newer = False
        for value in hints:
            config = router.from_answer(value)
            if config is not None and router.adopt(config):
                newer = True
        if router.single is None and ((hints and not newer) or refresh):
            # a single server's map cannot move: its NOT_MY_VBUCKET (an error context,
            # say while it warms up) and a lost connection are only retried
            newer = await nodes.refresh(deadline) or newer
        elapsed = trio.current_time() - start
        if elapsed >= timeout:
            if isinstance(last, trio.TooSlowError):
                nodes.refresh_soon()  # a silent node: its vbuckets may have moved
            err = RetryTimeoutError(
                f"opcode 0x{ops[pending[0]].opcode:02x}",
                vbucket=ops[pending[0]].vbucket,
                attempts=attempts,
                elapsed=elapsed,
                last_error=last,
            )
            err.__cause__ = last
            for i in pending:
                results[i] = err
            break
        if not newer:
            await trio.sleep(min(backoff, max(0.0, timeout - elapsed)))
            backoff = min(backoff * 2, 0.5)
    return cast(list[Result], results)  # every slot was filled above
