"""Offsets, offset stores and restarts: committed changes are never lost nor repeated."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dcp.consumer import (
    ClientClosedError,
    DcpClient,
    FileOffsetStore,
    InvalidOffsetError,
    MemoryOffsetStore,
    Offset,
    UsageError,
)
from dcp.consumer.batches import SnapshotBatch
from dcp.consumer.positions import Session
from dcp.protocol.opcodes import SEQNO_MAX

from .conftest import drain, make_client


def test_offset_validation_is_a_usage_error():
    with pytest.raises(InvalidOffsetError):
        Offset(0, 1, seqno=5, snap_start=6, snap_end=9)
    with pytest.raises(InvalidOffsetError):
        Offset(70000)
    with pytest.raises(InvalidOffsetError):
        Offset(0, -1, 3)
    with pytest.raises(InvalidOffsetError):
        Offset(0, 5, 3, failover_log=((6, 0),))
    with pytest.raises(ValueError):  # usage errors are ValueErrors
        Offset(0, 1, seqno=2**64)
    o = Offset(0, 0, 4, failover_log=((9, 0),))
    assert o.vb_uuid == 9 and o.snap_start == o.snap_end == 4


def test_bad_client_arguments_raise_at_once():
    for kw in (
        {"vbuckets": [1, 1]},
        {"vbuckets": [-1]},
        {"buffer_size": -5},
        {"ack_ratio": 0},
        {"noop_interval": 0.01},
        {"start": "later"},
        {"offsets": {1: Offset(2)}},
        {"vbuckets": [0], "offsets": {1: Offset(1)}},
        {"rollback_policy": "ignore"},
        {"offset_store": "file.json"},
    ):
        with pytest.raises(UsageError):
            DcpClient(port=1, **kw)


def test_file_store_round_trip_and_corruption(tmp_path):
    path = tmp_path / "offsets.json"
    store = FileOffsetStore(path)
    assert store.load() == {}
    offsets = {3: Offset(3, 77, 10, failover_log=((77, 5), (66, 0)), purge_seqno=2), 0: Offset(0)}
    store.save(offsets)
    assert FileOffsetStore(path).load() == offsets
    doc = json.loads(path.read_text())
    assert doc["v"] == 1 and doc["vbuckets"]["3"]["failover_log"] == [[77, 5], [66, 0]]
    path.write_text('{"v": 1, "vbuckets": {"3": {"seqno": 5, "snap_start": 9}}}')
    with pytest.raises(InvalidOffsetError):
        store.load()
    path.write_text("{not json")
    with pytest.raises(InvalidOffsetError):
        store.load()


_WRITER = textwrap.dedent("""
    import sys
    from dcp.consumer import FileOffsetStore, Offset
    store = FileOffsetStore(sys.argv[1])
    n = int(sys.argv[2])
    print("ready", flush=True)
    while True:
        n += 1
        store.save({vb: Offset(vb, 1000 + n, n, failover_log=((1000 + n, 0),))
                    for vb in range(64)})
""")


def test_file_store_survives_kill_9_at_any_instant(tmp_path):
    path = tmp_path / "offsets.json"
    FileOffsetStore(path).save({0: Offset(0, 1, 0, failover_log=((1, 0),))})
    last = 0
    for round_ in range(6):
        proc = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(path), str(last)],
            stdout=subprocess.PIPE,
            cwd=os.getcwd(),
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        time.sleep(0.05 + 0.03 * round_)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        offsets = FileOffsetStore(path).load()  # always a complete old or new version
        seqnos = {o.seqno for o in offsets.values()}
        assert len(seqnos) == 1, "never a mix of two versions"
        (n,) = seqnos
        assert n >= last
        if n:
            assert len(offsets) == 64 and offsets[5].vb_uuid == 1000 + n
        last = n
    assert last > 0
    leftovers = [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    assert len(leftovers) <= 6  # killed writers' temp files are harmless


async def test_restart_resumes_with_the_exact_stream_request_fields(producer, tmp_path):
    for vb in range(4):
        producer.vb(vb).add_mutations(6, per_snapshot=3)
    path = tmp_path / "offsets.json"
    async with make_client(producer, to_latest=True, offset_store=FileOffsetStore(path)) as c:
        async for b in c:
            if b.end == 3 or b.vbucket == 2:
                await b.commit()
    saved = FileOffsetStore(path).load()
    assert {vb: o.seqno for vb, o in saved.items()} == {0: 3, 1: 3, 2: 6, 3: 3}
    for vb in range(4):
        producer.vb(vb).add_mutations(2, per_snapshot=2)
    producer.stream_requests.clear()
    async with make_client(producer, offset_store=FileOffsetStore(path), to_latest=True) as c:
        items = await drain(c)
    for r in producer.stream_requests:
        want = saved[r.vbucket].seqno
        uuid = producer.vbs[r.vbucket].log[0][0]
        assert (r.start, r.snap_start, r.snap_end, r.vb_uuid) == (want, want, want, uuid)
    got = sorted((b.vbucket, e.seqno) for b in items for e in b)
    assert got == sorted([(vb, s) for vb in (0, 1, 3) for s in range(4, 9)] + [(2, 7), (2, 8)])


async def test_saved_offsets_of_other_vbuckets_are_kept(producer):
    producer.vb(0).add_mutations(2, per_snapshot=2)
    store = MemoryOffsetStore({9: Offset(9, 5, 7, failover_log=((5, 0),))})
    async with make_client(producer, vbuckets=[0], offset_store=store, to_latest=True) as c:
        await drain(c)
        await c.commit()
    assert set(store.offsets) == {0, 9} and store.offsets[9].seqno == 7


def _batch(vb: int, start: int, end: int, epoch: int, gen: int, log=((7, 0),)):
    return SnapshotBatch(vb, start, end, 1, [], 0, log, epoch, gen, None, None)


def test_session_commit_rules():
    s = Session({0: Offset(0)})
    _, gen = s.next_generation(0)
    b1, b2 = _batch(0, 1, 3, 0, gen), _batch(0, 4, 6, 0, gen)
    assert s.commit(b2) and not s.commit(b1), "positions never move backwards"
    assert s.offsets()[0].seqno == 6
    _, gen2 = s.next_generation(0)  # reconnect: a new stream generation
    assert not s.commit(_batch(0, 7, 9, 0, gen)), "batches of an old stream are not committed"
    ev = s.rollback(0, 2)
    assert (ev.seqno, ev.rollback_seqno, ev.vb_uuid) == (6, 2, 7)
    assert s.request_fields(0) == (2, SEQNO_MAX, 7, 2, 2)
    assert s.offsets()[0].seqno == 6, "the reset is not committed until the app says so"
    assert not s.commit(_batch(0, 7, 9, 0, gen2)), "pre-rollback batches are stale"
    assert s.commit(ev) and s.offsets()[0].seqno == 2


def test_rollback_prunes_failover_entries_above_the_rollback_seqno():
    log = ((30, 9), (20, 5), (10, 0))
    s = Session({0: Offset(0, 30, 12, failover_log=log)})
    ev = s.rollback(0, 7)
    assert ev.failover_log == ((20, 5), (10, 0))
    assert s.request_fields(0)[2] == 20
    ev = s.rollback(0, 0)
    assert ev.failover_log == ((10, 0),) and s.request_fields(0)[:3] == (0, SEQNO_MAX, 10)


class FlakyStore(MemoryOffsetStore):
    def __init__(self) -> None:
        super().__init__()
        self.fail_next = 1

    def save(self, offsets) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise OSError("disk full")
        super().save(offsets)


async def test_a_failed_save_is_retried_by_the_next_commit(producer):
    producer.vb(0).add_mutations(3, per_snapshot=3)
    store = FlakyStore()
    async with make_client(producer, vbuckets=[0], offset_store=store, to_latest=True) as c:
        (b,) = await drain(c)
        with pytest.raises(OSError):
            await b.commit()
        assert store.offsets == {}
        assert not await c.commit()  # nothing new moved, but the save is redone
        assert store.offsets[0].seqno == 3


async def test_purge_seqno_from_v22_markers_is_saved_and_sent_back(producer):
    h = producer.vb(0)
    h.purge_seqno = 2
    h.add_mutations(6, per_snapshot=3)
    store = MemoryOffsetStore()
    async with make_client(producer, vbuckets=[0], offset_store=store, to_latest=True) as c:
        batches = await drain(c)
        assert [b.purge_seqno for b in batches] == [2, 2]
        await c.commit()
    assert store.offsets[0].purge_seqno == 2 and store.offsets[0].seqno == 6
    h.add_mutations(1)
    async with make_client(producer, vbuckets=[0], offset_store=store, to_latest=True) as c:
        await drain(c)
    assert producer.requests_for(0)[0].value == b""
    assert json.loads(producer.requests_for(0)[-1].value) == {"purge_seqno": "2"}


async def test_aclose_is_idempotent_and_use_after_close_is_a_usage_error(producer):
    producer.vb(0).add_mutations(3)
    c = make_client(producer, vbuckets=[0])
    with pytest.raises(UsageError):
        await c.getone()  # not entered yet
    async with c:
        await c.getone()
        await c.aclose()
        await c.aclose()
        with pytest.raises(ClientClosedError):
            await c.getone()
    await c.aclose()
    with pytest.raises(UsageError):
        async with c:
            pass
