"""Crash recovery of the LMDB layer: SIGKILL a child process mid-flush, reopen, check.

The child writes a deterministic workload (write i goes to vb i % 4, key k{i % 500},
value b"{i}"), so the parent can replay exactly what each vbucket held at any seqno.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from dcp.producer.engine import Bucket
from dcp.producer.engine.records import VB_KEY, VBStateRecord

from .conftest import FakeClock, UuidSource, small_config

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import itertools, os, sys, time
    from dcp.producer.engine import Bucket, EngineConfig
    data, mode = sys.argv[1], sys.argv[2]
    cfg = EngineConfig(num_vbuckets=4, map_size=256 << 20, lmdb_sync=True,
                       checkpoint_max_items=97)
    b = Bucket.open(data, cfg, clock=time.time,
                    uuid_source=lambda: int.from_bytes(os.urandom(8), "big"))
    i = 0
    def write(n):
        global i
        for _ in range(n):
            b.set(i % 4, b"k%d" % (i % 500), b"%d" % i)
            i += 1
    write(3000)
    b.flusher.flush_all()
    print("persisted", *[b.vbucket(v).persisted_seqno for v in range(4)], flush=True)
    if mode == "hook":
        write(500)
        def hang(batch):
            print("in-txn", flush=True)
            time.sleep(60)
        b.storage.before_commit = hang
        b.flusher.flush_all()
    else:
        while True:
            write(700)
            batch = b.flusher.collect(1000)
            b.storage.write_batch(batch)
            done = b.flusher.complete(batch)
            print("persisted", *[b.vbucket(v).persisted_seqno for v in range(4)], flush=True)
""")


def replay(vb: int, upto: int) -> dict[bytes, bytes]:
    """What vbucket ``vb`` holds after its first ``upto`` writes."""
    out: dict[bytes, bytes] = {}
    i = vb
    for _ in range(upto):
        out[b"k%d" % (i % 500)] = b"%d" % i
        i += 4
    return out


def run_child(data: Path, mode: str, lines_before_kill: int) -> list[list[str]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(data), mode], stdout=subprocess.PIPE, text=True, env=env
    )
    seen = []
    try:
        assert proc.stdout is not None
        while len(seen) < lines_before_kill:
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"child died early: rc={proc.wait()}")
            seen.append(line.split())
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return seen


def check_consistent(b: Bucket, acked: list[int]) -> None:
    for vbid in range(4):
        vb = b.vbucket(vbid)
        with b.storage.env.begin() as txn:
            rec = VBStateRecord.decode(txn.get(VB_KEY.pack(vbid), db=b.storage.state_db))
        assert rec.high_seqno == b.storage.disk_high_seqno(vbid) == vb.high_seqno
        assert vb.high_seqno >= acked[vbid]  # nothing acknowledged as persisted is lost
        expected = replay(vbid, vb.high_seqno)
        got = {k: b.get(vbid, k).value for k in expected}
        assert got == expected
        assert vb.num_keys == len(expected)
        with b.storage.open_backfill(vbid, 0) as scan:
            items = scan.read(1 << 30)
        assert len(items) == len(expected)  # only the newest version of each key on disk
        # the unclean shutdown started a new branch at the persisted point
        assert vb.failover_log.entries[0][1] == vb.high_seqno
        assert len(vb.failover_log) == 2


def reopen(data: Path) -> Bucket:
    return Bucket.open(
        data,
        small_config(map_size=256 << 20, checkpoint_max_items=97),
        clock=FakeClock(),
        uuid_source=UuidSource(),
    )


def test_kill_inside_the_flush_transaction_loses_only_the_unacknowledged_batch(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    lines = run_child(data, "hook", 2)
    assert lines[1] == ["in-txn"]
    acked = [int(x) for x in lines[0][1:]]
    b = reopen(data)
    try:
        assert b.warmup_unclean
        assert [b.vbucket(v).high_seqno for v in range(4)] == acked
        check_consistent(b, acked)
    finally:
        b.close()


def test_kill_while_flushing_continuously_leaves_a_consistent_store(tmp_path: Path) -> None:
    data = tmp_path / "data"
    lines = run_child(data, "loop", 6)
    acked = [int(x) for x in lines[-1][1:]]
    b = reopen(data)
    try:
        check_consistent(b, acked)
        # and the bucket is usable: write, flush, clean restart adds no entry
        b.set(0, b"after", b"crash")
        b.flusher.flush_all()
    finally:
        b.close()
    b2 = reopen(data)
    try:
        assert not b2.warmup_unclean and len(b2.vbucket(0).failover_log) == 2
        assert b2.get(0, b"after").value == b"crash"
    finally:
        b2.close()
