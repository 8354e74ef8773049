"""Real ``dcp-server`` processes on loopback for the replication tests, and the checks
that compare two nodes' vbuckets.

Rules of this module:
- A node is a child process (``tools/chaos/procs.py`` starts it as ``python -m
  dcp.producer --host 127.0.0.1``) with a fixed free port picked once, so a restart
  (same data dir, same arguments) is reachable at the same address its peers replicate
  from. The ``cluster`` fixture (conftest.py) kills every node it made when the test
  ends, whatever happened (a SIGSTOPped node is continued first so the kill lands).
- Every wait has a deadline and fails the test with what it last saw; every load loop is
  bounded by its operation count.
- Comparisons are exact: per vbucket the high seqno, the failover log (STAT failovers),
  and every item streamed from seqno 0 to the high seqno by the SDK (``DcpClient``), with
  key, seqno, revision, CAS, flags, expiry, datatype, value, deleted and delete time.
"""

from __future__ import annotations

import os
import random
import re
import signal
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import trio

from dcp.consumer import BatchWriteError, DcpClient, KeyNotFound, KvClient, MutationResult
from tools.chaos.procs import RawClient, ServerProcess, failover_logs, free_port, vb_seqnos

HOST = "127.0.0.1"
#: Item fields compared between nodes: (kind, key, seqno, rev, cas, flags, expiry,
#: datatype, value, delete_time); fields an event kind lacks are None.
ItemRow = tuple[
    str, bytes, int, int, int, int | None, int | None, int | None, bytes | None, int | None
]


class Node:
    """One ``dcp-server`` child: start, SIGTERM, SIGKILL, SIGSTOP/SIGCONT, its log."""

    def __init__(self, root: Path, name: str, num_vbuckets: int, args: Sequence[str] = ()) -> None:
        self.name = name
        self.port = free_port()
        self.num_vbuckets = num_vbuckets
        self.proc = ServerProcess(
            root / name,
            root / f"{name}.log",
            port=self.port,
            num_vbuckets=num_vbuckets,
            # a long noop interval would hide nothing here; a short one keeps a stopped
            # peer's connection from lingering for minutes
            args=["--log-level", "INFO", "--noop-interval", "2", *args],
        )
        self.paused = False

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    async def start(self, *extra: str) -> Node:
        await self.proc.start(extra, timeout=60)
        return self

    async def stop(self) -> None:
        """SIGTERM: a graceful stop (final flush)."""
        self.resume()
        await self.proc.terminate(30)

    def kill(self) -> None:
        """SIGKILL: what was acknowledged but not yet flushed may be lost."""
        self.resume()
        self.proc.kill()

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.paused and self.proc.alive():
            os.kill(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def log_text(self) -> str:
        try:
            return self.proc.log_path.read_text("utf-8", "replace")
        except OSError:
            return ""

    def rollbacks_logged(self) -> dict[int, tuple[int, int]]:
        """vb -> (reached, asked) of every "rolled back to seqno" line (the last per vb)."""
        out = {}
        for m in re.finditer(
            r"vb (\d+) rolled back to seqno (\d+) \(asked for (\d+)\)", self.log_text()
        ):
            out[int(m.group(1))] = (int(m.group(2)), int(m.group(3)))
        return out

    def tracebacks(self) -> list[str]:
        return self.proc.tracebacks()

    async def stats(self, group: str = "") -> dict[str, str]:
        c = await RawClient.connect(self.port)
        try:
            return await c.stats(group, timeout=30)
        finally:
            await c.aclose()

    async def high_seqnos(self) -> dict[int, int]:
        return {vb: t[0] for vb, t in (await vb_seqnos(self.port)).items()}

    async def persisted(self) -> bool:
        return all(h == p for h, _, p in (await vb_seqnos(self.port)).values())

    async def failover_logs(self) -> dict[int, list[tuple[int, int]]]:
        return await failover_logs(self.port)

    async def states(self) -> dict[int, str]:
        st = await self.stats("vbucket")
        return {int(k[3:]): v for k, v in st.items() if k.startswith("vb_") and k[3:].isdigit()}


async def until(check, what: str, timeout: float = 60.0, interval: float = 0.1) -> None:
    """Poll ``await check()`` until true; fail naming ``what`` after ``timeout`` s."""
    with trio.move_on_after(timeout):
        while not await check():
            await trio.sleep(interval)
        return
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


async def wait_caught_up(active: Node, replica: Node, timeout: float = 90.0) -> dict[int, int]:
    """Until the replica follows the active and holds what it holds: every replicated
    vbucket's stream is streaming, and the high seqnos and failover logs of every vbucket
    are equal (equal seqnos alone can be a replica that has not reconnected yet after its
    source restarted with a new failover entry). Returns the high seqnos."""
    last: dict[str, object] = {}

    async def same() -> bool:
        st = await replica.stats("replication")
        idle = sorted(k for k, v in st.items() if k.endswith(":stream") and v != "streaming")
        last["not streaming"] = idle[:8]
        if idle:
            return False
        a, b = await active.high_seqnos(), await replica.high_seqnos()
        diff = {vb: (a[vb], b.get(vb)) for vb in a if a[vb] != b.get(vb)}
        last["(vb: active, replica) seqnos differ"] = dict(list(diff.items())[:8])
        last["seqnos"] = a
        if diff:
            return False
        fa, fb = await active.failover_logs(), await replica.failover_logs()
        bad = [vb for vb in fa if fa[vb] != fb.get(vb)]
        last["failover logs differ in vb"] = bad[:8]
        return not bad

    try:
        await until(same, f"{replica.name} to catch up with {active.name}", timeout, 0.2)
    except AssertionError as exc:
        seen = {k: v for k, v in last.items() if k != "seqnos" and v}
        raise AssertionError(f"{exc}; last seen: {seen}") from None
    return last["seqnos"]  # type: ignore[return-value]


# --------------------------------------------------------------------------- streaming


@dataclass
class VbDump:
    """What a consumer streaming one vbucket from 0 to its high seqno received."""

    snapshots: list[tuple[int, int]] = field(default_factory=list)
    items: list[ItemRow] = field(default_factory=list)

    def final(self) -> dict[bytes, ItemRow]:
        """The newest version of each key (what a disk backfill would send)."""
        return {row[1]: row for row in self.items}


def row(event: object) -> ItemRow:
    g = getattr
    return (
        g(event, "kind"),
        bytes(g(event, "key")),
        g(event, "seqno"),
        g(event, "rev_seqno"),
        g(event, "cas"),
        g(event, "flags", None),
        g(event, "expiry", None),
        g(event, "datatype", None),
        None if g(event, "value", None) is None else bytes(g(event, "value")),
        g(event, "delete_time", None),
    )


async def dump(
    node: Node, vbuckets: Iterable[int] | None = None, timeout: float = 120.0
) -> dict[int, VbDump]:
    """Stream ``vbuckets`` (all the node has) from 0 to the high seqnos it reports at start."""
    out: dict[int, VbDump] = {}
    with trio.fail_after(timeout):
        async with DcpClient(
            HOST,
            node.port,
            vbuckets=None if vbuckets is None else list(vbuckets),
            to_latest=True,
            include_delete_times=True,
            include_expirations=True,
            retry_timeout=30,
            name=f"cluster-test-dump:{node.name}:{random.getrandbits(32):08x}",
        ) as client:
            async for batch in client:
                d = out.setdefault(batch.vbucket, VbDump())
                d.snapshots.append((batch.start, batch.end))
                d.items.extend(row(e) for e in batch)
    return out


def _first_diff(a: dict[bytes, ItemRow], b: dict[bytes, ItemRow]) -> str:
    only_a, only_b = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
    if only_a or only_b:
        return f"keys only on the first node {only_a[:5]}, only on the second {only_b[:5]}"
    k = next(k for k in sorted(a) if a[k] != b[k])
    return f"{k!r}: {a[k][:8]} != {b[k][:8]}"


async def assert_same(active: Node, replica: Node, vbuckets: Iterable[int] | None = None) -> int:
    """The full convergence check; returns the number of items compared.

    High seqnos and failover logs of every vbucket are equal; each vbucket's items,
    streamed from both nodes, are equal field by field in their newest versions,
    tombstones included. Superseded versions are not compared: a memory snapshot may span
    several checkpoints (keys repeated as the node's checkpoints happened to be cut), and
    a disk with a history window keeps what its node was sent, both of which differ
    between an active and its replica holding the same data."""
    ha, hb = await active.high_seqnos(), await replica.high_seqnos()
    assert ha == hb, {vb: (ha[vb], hb.get(vb)) for vb in ha if ha[vb] != hb.get(vb)}
    fa, fb = await active.failover_logs(), await replica.failover_logs()
    diff = {vb: (fa[vb], fb.get(vb)) for vb in fa if fa[vb] != fb.get(vb)}
    assert not diff, f"failover logs differ (vb: active, replica): {dict(list(diff.items())[:5])}"
    vbs = sorted(ha) if vbuckets is None else sorted(vbuckets)
    return compare_dumps(await dump(active, vbs), await dump(replica, vbs), ha, vbs)


def compare_dumps(
    da: dict[int, VbDump], db: dict[int, VbDump], high: dict[int, int], vbs: Iterable[int]
) -> int:
    """The item half of ``assert_same`` (pure, so the checker itself is tested)."""
    n = 0
    for vb in vbs:
        a, b = da.get(vb, VbDump()), db.get(vb, VbDump())
        newest_a, newest_b = a.final(), b.final()
        if newest_a != newest_b:
            raise AssertionError(f"vb {vb}: newest items differ: {_first_diff(newest_a, newest_b)}")
        for d in (a, b):
            last = max((r[2] for r in d.items), default=0)
            assert last == high[vb], f"vb {vb}: streamed up to {last}, high seqno {high[vb]}"
        n += len(newest_a)
    return n


# --------------------------------------------------------------------------- load


class Load:
    """Seeded SET/DELETE traffic over a fixed key space, in pipelined batches of distinct
    keys (a set_many and a delete_many of keys known to exist), with varied values (bytes
    of varied length, JSON documents), flags and expiries."""

    def __init__(self, rng: random.Random, keys: int, prefix: str = "k") -> None:
        self.rng = rng
        self.keys = [f"{prefix}-{i}".encode() for i in range(keys)]
        self.live: set[bytes] = set()
        self.acked = 0

    def _value(self) -> bytes | dict[str, int]:
        r = self.rng
        if r.random() < 0.2:
            return {"n": r.randrange(1 << 30), "w": r.randrange(100)}
        return r.randbytes(r.randrange(1, 300))

    async def batch(self, kv: KvClient, size: int) -> None:
        r = self.rng
        chosen = r.sample(self.keys, size)
        dels = [k for k in chosen if k in self.live and r.random() < 0.25]
        sets = {k: self._value() for k in chosen if k not in dels}
        flags = r.choice((0, 1, 0xDEADBEEF))
        expiry = r.choice((0, 0, 86_400))  # a day: set, never reached during a test
        self.live |= set(sets)  # before the answer: a killed node may have applied them
        await kv.set_many(sets, flags=flags, expiry=expiry)
        self.acked += len(sets)
        if not dels:
            return
        try:
            await kv.delete_many(dels)
        except BatchWriteError as exc:
            # after a kill -9 a key believed live may be gone (its write was not flushed)
            if not all(isinstance(r, MutationResult | KeyNotFound) for r in exc.results):
                raise
        self.live -= set(dels)
        self.acked += len(dels)

    async def run(
        self, port: int, ops: int, num_vbuckets: int, batch: int = 200, timeout: float = 30.0
    ) -> None:
        """``ops`` operations (bounded), ``batch`` distinct keys at a time."""
        async with KvClient(HOST, port, num_vbuckets=num_vbuckets, timeout=timeout) as kv:
            done = 0
            while done < ops:
                n = min(batch, ops - done)
                await self.batch(kv, n)
                done += n


async def dcpctl(*args: object, timeout: float = 120.0) -> str:
    """Run ``dcpctl`` as a user would; fails the test on a non-zero exit; its stdout."""
    exe = Path(sys.executable).parent / "dcpctl"
    argv = [str(exe)] if exe.exists() else [sys.executable, "-m", "dcp.ctl"]
    with trio.fail_after(timeout):
        r = await trio.run_process(
            [*argv, *map(str, args)], capture_stdout=True, capture_stderr=True, check=False
        )
    out, err = r.stdout.decode(), r.stderr.decode()
    assert r.returncode == 0, f"dcpctl {args}: exit {r.returncode}\n{out}\n{err}"
    return out
