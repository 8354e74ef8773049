"""Test support for replication: an in-memory ``ReplicaTarget``, a cuttable TCP proxy,
a real in-process source server and the oracle that reads what that source holds.

Rules of this module:
- ``FakeTarget`` checks what it is given as strictly as the engine promises to
  (api: ``ReplicaTarget`` in dcp/producer/replication/target.py): whole snapshots only,
  seqnos strictly increasing, above its high seqno, inside the snapshot, for its
  vbucket; a replica or pending vbucket only. A refused snapshot changes nothing and
  is recorded in ``refused``. Its restore points for ``rollback`` are its snapshot ends.
- The oracle is the SDK (``dcp.consumer``), an independent DCP client: what it streams
  from the source is what the replica must hold.
- Everything here runs on loopback and is closed by the test that opened it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import trio

from dcp.consumer import DcpClient, Deletion, Expiration, SnapshotBatch
from dcp.producer.engine.item import Item, ItemOp
from dcp.producer.server import DcpServer, ServerConfig
from dcp.protocol.errors import NotMyVbucket
from dcp.protocol.opcodes import Status, VBucketState

Row = tuple  # (seqno, op, key, value, rev, cas, flags, expiry, datatype, delete_time)


def item_row(it: Item) -> Row:
    return (
        it.seqno,
        int(it.op),
        it.key,
        it.value,
        it.rev_seqno,
        it.cas,
        it.flags,
        it.expiry,
        it.datatype,
        it.delete_time,
    )


class FakeTarget:
    """An in-memory replica node (see the module rules)."""

    def __init__(self, num_vbuckets: int = 4, node_name: str = "127.0.0.1:7777") -> None:
        self.node_name = node_name
        self.states = dict.fromkeys(range(num_vbuckets), VBucketState.ACTIVE)
        self.items: dict[int, list[Item]] = {vb: [] for vb in range(num_vbuckets)}
        self.snapshots: dict[int, list[tuple[int, int, int, list[Item]]]] = {
            vb: [] for vb in range(num_vbuckets)
        }
        self.high = dict.fromkeys(range(num_vbuckets), 0)
        #: what "disk" holds: tests move it (and call the manager's flush listener)
        self.persisted = dict.fromkeys(range(num_vbuckets), 0)
        self.snap = {vb: (0, 0) for vb in range(num_vbuckets)}
        self.failover: dict[int, list[tuple[int, int]]] = {vb: [] for vb in range(num_vbuckets)}
        self.calls: list[tuple] = []  # ("set_state"|"rollback"|"adopt", vb, ...)
        self.refused: list[tuple[int, str]] = []
        #: called before a snapshot is applied; may raise to refuse it
        self.before_apply: Callable[[int, int, int, list[Item]], None] | None = None

    def state(self, vb: int) -> VBucketState:
        return self.states[vb]

    def set_state(self, vb: int, state: VBucketState, *, takeover: bool = False) -> None:
        self.calls.append(("set_state", vb, VBucketState(state), takeover))
        self.states[vb] = VBucketState(state)

    def position(self, vb: int) -> tuple[int, int, int, int]:
        uuid = self.failover[vb][0][0] if self.failover[vb] else 0
        s, e = self.snap[vb]
        return self.high[vb], s, e, uuid

    def persisted_seqno(self, vb: int) -> int:
        return self.persisted[vb]

    def adopt_failover_log(self, vb: int, entries: list[tuple[int, int]]) -> None:
        self.calls.append(("adopt", vb, list(entries)))
        self.failover[vb] = list(entries)

    def apply_snapshot(self, vb: int, start: int, end: int, flags: int, items: list[Item]) -> None:
        if self.states[vb] not in (VBucketState.REPLICA, VBucketState.PENDING):
            raise NotMyVbucket(Status.NOT_MY_VBUCKET, f"vb {vb} is {self.states[vb].name}")
        if self.before_apply is not None:
            self.before_apply(vb, start, end, items)
        lo = self.high[vb]
        why = None
        if not start <= end or end <= lo:
            why = f"snapshot [{start}, {end}] at high seqno {lo}"
        for it in items:
            if it.vbucket != vb or not (max(lo, start - 1) < it.seqno <= end):
                why = why or f"item {it!r} in [{start}, {end}] above {lo}"
            lo = max(lo, it.seqno)
        if why is not None:
            self.refused.append((vb, why))
            raise ValueError(why)
        self.items[vb].extend(items)
        self.snapshots[vb].append((start, end, flags, list(items)))
        self.high[vb] = end
        self.snap[vb] = (start, end)

    async def rollback(self, vb: int, seqno: int) -> int:
        await trio.sleep(0)
        self.calls.append(("rollback", vb, seqno))
        snaps = [s for s in self.snapshots[vb] if s[1] <= seqno]
        self.snapshots[vb] = snaps
        to = snaps[-1][1] if snaps else 0
        self.items[vb] = [it for it in self.items[vb] if it.seqno <= to]
        self.high[vb] = to
        self.persisted[vb] = min(self.persisted[vb], to)
        self.snap[vb] = (snaps[-1][0], to) if snaps else (0, 0)
        self.failover[vb] = [(u, s) for u, s in self.failover[vb] if s <= to]
        return to

    def rows(self, vb: int) -> list[Row]:
        return [item_row(it) for it in self.items[vb]]

    def set_calls(self) -> list[tuple]:
        return [c for c in self.calls if c[0] == "set_state"]


# --------------------------------------------------------------------------- the source


@contextlib.asynccontextmanager
async def source_server(data_dir: Path, num_vbuckets: int = 4) -> AsyncIterator[DcpServer]:
    cfg = ServerConfig(
        host="127.0.0.1",
        port=0,
        data_dir=str(data_dir),
        num_vbuckets=num_vbuckets,
        log_level="WARNING",
    )
    async with DcpServer(cfg) as server:
        yield server


def address(server: DcpServer) -> str:
    return f"127.0.0.1:{server.port}"


def oracle_row(e: Any) -> Row:
    if isinstance(e, Deletion):
        return (
            e.seqno, int(ItemOp.DELETION), e.key, e.value, e.rev_seqno, e.cas, 0, 0,
            e.datatype, e.delete_time or 0,
        )  # fmt: skip
    if isinstance(e, Expiration):
        return (
            e.seqno, int(ItemOp.EXPIRATION), e.key, b"", e.rev_seqno, e.cas, 0, 0, 0,
            e.delete_time,
        )  # fmt: skip
    return (
        e.seqno, int(ItemOp.MUTATION), e.key, e.value, e.rev_seqno, e.cas, e.flags, e.expiry,
        e.datatype, 0,
    )  # fmt: skip


async def oracle(server: DcpServer, vbuckets: list[int]) -> dict[int, list[Row]]:
    """Every change the source holds now, per vbucket, as the SDK streams it."""
    out: dict[int, list[Row]] = {vb: [] for vb in vbuckets}
    async with DcpClient(
        "127.0.0.1",
        server.port,
        vbuckets=vbuckets,
        to_latest=True,
        include_delete_times=True,
        include_expirations=True,
        noop_interval=None,
    ) as client:
        async for batch in client:
            if isinstance(batch, SnapshotBatch):
                out[batch.vbucket].extend(oracle_row(e) for e in batch)
    return out


def latest(rows: list[Row]) -> dict[bytes, Row]:
    """The newest change of each key (what survives deduplication)."""
    return {r[2]: r for r in rows}


async def wait_until(cond: Callable[[], bool], timeout: float = 15.0, what: str = "") -> None:
    with trio.fail_after(timeout):
        while not cond():
            await trio.sleep(0.02)


# --------------------------------------------------------------------------- a cuttable proxy


class Proxy:
    """A loopback TCP proxy in front of ``port``: ``cut_after`` bytes from the server on
    the next connection, then that connection is dropped (both sides)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.connections = 0
        self.cut_after: int | None = None
        self.cuts = 0

    async def open_stream(self, host: str, port: int) -> trio.SocketStream:
        """The ``open_stream`` a manager is given: connects through the proxy."""
        self.connections += 1
        client, inner = await _socketpair()
        server = await trio.open_tcp_stream("127.0.0.1", self.port)
        limit, self.cut_after = self.cut_after, None
        self._nursery.start_soon(self._pipe, inner, server, limit)
        return client

    async def _pipe(
        self, inner: trio.SocketStream, server: trio.SocketStream, limit: int | None
    ) -> None:
        async with inner, server, trio.open_nursery() as n:

            async def up() -> None:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    while data := await inner.receive_some(65536):
                        await server.send_all(data)
                n.cancel_scope.cancel()

            async def down() -> None:
                sent = 0
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    while data := await server.receive_some(65536):
                        if limit is not None and sent + len(data) >= limit:
                            await inner.send_all(data[: limit - sent])
                            self.cuts += 1
                            break
                        sent += len(data)
                        await inner.send_all(data)
                n.cancel_scope.cancel()

            n.start_soon(up)
            n.start_soon(down)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Proxy]:
        async with trio.open_nursery() as n:
            self._nursery = n
            yield self
            n.cancel_scope.cancel()


async def _socketpair() -> tuple[trio.SocketStream, trio.SocketStream]:
    import socket

    a, b = socket.socketpair()
    return trio.SocketStream(trio.socket.from_stdlib_socket(a)), trio.SocketStream(
        trio.socket.from_stdlib_socket(b)
    )
