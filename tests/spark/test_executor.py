"""Executors read planned ranges exactly, whole snapshots only (no Spark needed)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import trio

from dcp.protocol import FrameReader, Opcode, codec
from dcp.protocol.layout import MUTATION_EXTRAS
from dcp.spark.arrow import to_record_batch
from dcp.spark.batch_plan import VbRange
from dcp.spark.changes import OP_ROLLBACK, Chunk
from dcp.spark.driver import Planner
from dcp.spark.errors import MergedSnapshotError, RollbackDetectedError
from dcp.spark.executor import read_ranges
from dcp.spark.options import parse_options

from .conftest import NO_HISTORY
from .helpers import ThreadServer


def _cfg(port: int, **opts: str):
    return parse_options({"port": str(port), "retryTimeout": "5", **opts}, streaming=True)


def _rows(chunks: list[Chunk]) -> list[tuple]:
    out = []
    for ch in chunks:
        i = 0
        for vb, s, e, n, *_ in ch.segments:
            for j in range(i, i + n):
                out.append((vb, ch.seqno[j], ch.op[j], ch.key[j], ch.value[j], s, e))
            i += n
    return out


def _plan(server: ThreadServer) -> tuple[dict[int, int], dict]:
    p = Planner(_cfg(server.port))
    try:
        return p.refresh(force=True)
    finally:
        p.close()


def _read(server: ThreadServer, ranges: list[VbRange], **opts: str) -> list[tuple]:
    return _rows(list(read_ranges(_cfg(server.port, **opts), ranges, "test")))


def test_a_planned_range_reads_back_every_change_in_whole_snapshots(server):
    with server.kv() as kv:
        kv.set_many({f"k{i}": b"a" for i in range(600)})
        kv.set_many({f"k{i}": b"b" for i in range(0, 600, 2)})
        kv.delete_many([f"k{i}" for i in range(0, 600, 5)])
    highs, logs = _plan(server)
    ranges = [VbRange(vb, logs[vb][0][0], 0, h) for vb, h in highs.items() if h]
    rows = _read(server, ranges)
    state: dict[bytes, bytes | None] = {}
    for _vb, _s, op, key, value, _ss, _se in sorted(rows, key=lambda r: (r[0], r[1])):
        state[key] = value if op == 0 else None
    want = {f"k{i}".encode(): (b"b" if i % 2 == 0 else b"a") for i in range(600) if i % 5}
    assert {k: v for k, v in state.items() if v is not None} == want
    by_vb: dict[int, list[tuple]] = {}
    for r in rows:
        by_vb.setdefault(r[0], []).append(r)
    for vb, rs in by_vb.items():
        assert max(r[1] for r in rs) <= highs[vb]
        for ss, se in {(r[5], r[6]) for r in rs}:  # every snapshot is whole: its end is in
            assert se <= highs[vb] and any(r[1] == se for r in rs if (r[5], r[6]) == (ss, se))


def _merge_after_planning(server: ThreadServer) -> tuple[list[VbRange], dict[int, int]]:
    with server.kv() as kv:
        kv.set_many({f"k{i}": b"old" for i in range(200)})
    highs, logs = _plan(server)
    with server.kv() as kv:  # rewrite half of them: their old versions leave the disk
        kv.set_many({f"k{i}": b"new" for i in range(0, 200, 2)})
    server.flush()
    ranges = [VbRange(vb, logs[vb][0][0], 0, h) for vb, h in highs.items() if h]
    return ranges, highs


def test_a_range_merged_since_planning_fails_with_the_facts(disk_server):
    ranges, _ = _merge_after_planning(disk_server)
    with pytest.raises(MergedSnapshotError) as info:
        _read(disk_server, ranges)
    err = info.value
    assert err.snapshot_end > err.end and "can no longer be served exactly" in str(err)
    assert f"vbucket {err.vbucket}" in str(err) and "onMergedSnapshot=reread" in str(err)


def test_reread_reads_the_merged_snapshot_whole(disk_server):
    ranges, highs = _merge_after_planning(disk_server)
    rows = _read(disk_server, ranges, onMergedSnapshot="reread")
    state = {r[3]: r[4] for r in sorted(rows, key=lambda r: (r[0], r[1]))}
    assert state == {f"k{i}".encode(): (b"new" if i % 2 == 0 else b"old") for i in range(200)}
    for vb in highs:
        rs = [r for r in rows if r[0] == vb]
        if rs:  # each vbucket ends on a whole snapshot that reaches past the planned end
            assert max(r[1] for r in rs) == max(r[6] for r in rs) >= highs[vb]
            assert {r[5] for r in rs} == {1}  # tagged from the range start (0) + 1


def test_a_range_rewritten_and_persisted_since_planning_is_exact_from_retained_memory(
    no_history_server,
):
    """Even without history the server keeps closed checkpoints a few seconds: the range
    is read from memory at the boundaries it was planned on, not as a merged disk
    snapshot."""
    server = no_history_server
    ranges, highs = _merge_after_planning(server)
    rows = _read(server, ranges)
    assert sorted(r[3] for r in rows) == sorted(f"k{i}".encode() for i in range(200))
    assert all(r[4] == b"old" for r in rows)  # the state at the planned end, exactly
    for r in rows:
        assert r[1] <= highs[r[0]] and r[6] <= highs[r[0]]


def test_inside_the_history_window_a_replay_yields_the_same_rows(history_server):
    s = history_server
    with s.kv() as kv:
        kv.set_many({f"k{i}": b"v1" for i in range(300)})
        s.flush()
        kv.set_many({f"k{i}": b"v2" for i in range(0, 300, 3)})
    highs, logs = _plan(s)
    s.flush()
    ranges = [VbRange(vb, logs[vb][0][0], 0, h) for vb, h in highs.items() if h]
    first = sorted(_read(s, ranges))  # (partly) from memory: deduplicated per checkpoint
    with s.kv() as kv:  # the same keys again, after the batch was read: merges without history
        kv.set_many({f"k{i}": b"v3" for i in range(300)})
    s.flush()
    again = sorted(_read(s, ranges))  # from the history on disk: every version
    assert again == first
    assert len(first) == 300
    assert {r[3]: r[4] for r in first} == {
        f"k{i}".encode(): b"v2" if i % 3 == 0 else b"v1" for i in range(300)
    }


def test_a_position_lost_in_an_unclean_restart_is_a_rollback_when_read(tmp_path):
    s = ThreadServer(tmp_path / "d", num_vbuckets=4)
    try:
        with s.kv() as kv:
            kv.set_many({f"p{i}": b"kept" for i in range(40)})
            s.flush()
            s.pause_persistence()
            kv.set_many({f"m{i}": b"lost" for i in range(40)})
        highs, logs = _plan(s)
    finally:
        s.stop(clean=False)
    s = ThreadServer(tmp_path / "d", num_vbuckets=4)
    try:
        new_highs, _ = _plan(s)
        ranges = [VbRange(vb, logs[vb][0][0], h, h + 5) for vb, h in highs.items()]
        with pytest.raises(RollbackDetectedError) as info:
            _read(s, ranges)
        err = info.value
        assert err.rollback_seqno == new_highs[err.vbucket] < err.seqno == highs[err.vbucket]
        rows = _read(s, ranges, onRollback="rewind")
        assert sorted((r[0], r[1], r[2]) for r in rows) == sorted(
            (vb, new_highs[vb], OP_ROLLBACK) for vb in highs
        )
    finally:
        s.stop()


class _ScriptedProducer:
    """A fake server: each connection answers the handshake, then plays one script."""

    def __init__(self, scripts: list[list[bytes]]) -> None:
        self.scripts = scripts
        self.requests: list[codec.StreamRequest] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        for script in self.scripts:
            conn, _ = self.sock.accept()
            with conn:
                reader = FrameReader()
                while True:
                    data = conn.recv(65536)
                    if not data:
                        break
                    reader.feed(data)
                    for f in reader.read_frames():
                        if f.opcode == Opcode.DCP_CLOSE_STREAM:
                            conn.sendall(
                                codec.response(f.opcode, opaque=f.opaque)
                                + codec.stream_end(0, self.requests[-1].opaque, 1)
                            )
                        elif f.opcode == Opcode.DCP_STREAM_REQ:
                            req = codec.parse_stream_request(f)
                            self.requests.append(req)
                            conn.sendall(
                                codec.response(
                                    f.opcode,
                                    opaque=f.opaque,
                                    value=codec.failover_log_value([(7, 0)]),
                                )
                            )
                            conn.sendall(b"".join(frame(f.opaque) for frame in script))
                            if script[-1] is _HANG_UP:
                                break
                        else:
                            conn.sendall(codec.response(f.opcode, opaque=f.opaque))
                    else:
                        continue
                    break


def _HANG_UP(opaque: int) -> bytes:
    return b""


def _marker(start: int, end: int):
    return lambda o: codec.snapshot_marker(0, o, start, end, 0x01)


def _mut(seqno: int):
    return lambda o: codec.mutation(0, o, seqno, 1, f"k{seqno}".encode(), b"v")


def _end(o: int) -> bytes:
    return codec.stream_end(0, o, 0)


def test_a_connection_lost_mid_snapshot_resumes_from_the_last_whole_one():
    p = _ScriptedProducer(
        [
            [_marker(1, 2), _mut(1), _mut(2), _marker(3, 5), _mut(3), _HANG_UP],
            [_marker(3, 5), _mut(3), _mut(4), _mut(5), _end],
        ]
    )
    rows = _rows(list(read_ranges(_cfg(p.port), [VbRange(0, 7, 0, 5)], "test")))
    assert [r[1] for r in rows] == [1, 2, 3, 4, 5]
    assert [(r.start_seqno, r.snap_start_seqno, r.snap_end_seqno) for r in p.requests] == [
        (0, 0, 0),
        (2, 2, 2),
    ]


@pytest.mark.parametrize("history", [False, True], ids=["disk", "history"])
def test_a_large_range_read_from_disk_is_complete(tmp_path, history):
    """More items than one server backfill chunk (4096): all of them, once."""
    s = ThreadServer(tmp_path / "d", num_vbuckets=1, **({} if history else NO_HISTORY))
    try:
        with s.kv() as kv:
            for c in range(0, 10_000, 2_500):
                kv.set_many({f"k{i}": b"v" for i in range(c, c + 2_500)})
        s.flush()
        highs, logs = _plan(s)
        s.flush()
        rows = _read(s, [VbRange(0, logs[0][0][0], 0, highs[0])])
        # A cut inside the one disk snapshot: exact with history (any prefix is a real
        # state), and without it too here, because everything past the cut is a first
        # revision (inserts cannot have replaced a version inside the range).
        half = _read(s, [VbRange(0, logs[0][0][0], 0, 5_000)])
    finally:
        s.stop()
    assert [r[1] for r in rows] == list(range(1, 10_001))
    assert [r[1] for r in half] == list(range(1, 5_001))


def test_expirations_and_deletions_have_their_own_op(tmp_path):
    pytest.importorskip("pyarrow")
    s = ThreadServer(tmp_path / "d", num_vbuckets=1, expiry_interval=0.1)
    try:
        with s.kv() as kv:
            kv.set("gone", b"x")
            kv.delete("gone")
            kv.set("brief", b"y", expiry=1)
            kv.set("stays", b"z", flags=0xDEADBEEF)
        deadline = time.monotonic() + 10
        while True:  # the expiry pager turns "brief" into an expiration (seqno 5)
            highs, logs = _plan(s)
            if highs[0] >= 5 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        chunks = list(read_ranges(_cfg(s.port), [VbRange(0, logs[0][0][0], 0, highs[0])], "t"))
    finally:
        s.stop()
    rows = {r["key"]: r for ch in chunks for r in to_record_batch(ch).to_pylist()}
    assert rows["gone"]["op"] == "deletion" and rows["gone"]["value"] is None
    assert rows["brief"]["op"] == "expiration"
    assert rows["stays"]["op"] == "mutation" and rows["stays"]["flags"] == 0xDEADBEEF
    assert rows["stays"]["value"] == b"z" and rows["stays"]["cas"] > 0


def test_a_range_ending_in_a_purged_tombstone_completes_without_a_later_change(tmp_path):
    """The range's last seqno was a deletion whose tombstone compaction purged: the disk
    has no item there, the server says so (SEQNO_ADVANCED) and the read finishes."""
    s = ThreadServer(
        tmp_path / "d", num_vbuckets=4, tombstone_purge_age=0, checkpoint_retain_seconds=0
    )
    try:
        with s.kv() as kv:
            kv.set_many({f"k{i}": b"v" for i in range(40)})
            kv.delete("k3")
        highs, logs = _plan(s)
        s.flush()

        def new_checkpoints() -> None:
            for vb in range(4):
                s.server.bucket.vbucket(vb).checkpoints.create_checkpoint()

        s.call(new_checkpoints)
        s.flush()
        assert trio.from_thread.run(s.server.persistence.compact_now, trio_token=s._token) == 1
        ranges = [VbRange(vb, logs[vb][0][0], 0, h) for vb, h in highs.items() if h]
        t0 = time.monotonic()
        rows = _read(s, ranges, timeout="3", retryTimeout="3")
        assert time.monotonic() - t0 < 3
        assert sorted(r[3] for r in rows) == sorted(f"k{i}".encode() for i in range(40) if i != 3)
    finally:
        s.stop()


def _not_a_mutation(seqno: int):
    """A response frame (magic 0x81) whose opcode byte is DCP_MUTATION's, with well-formed
    mutation extras and the stream's opaque: not a change of the stream."""
    return lambda o: codec.response(
        Opcode.DCP_MUTATION,
        opaque=o,
        extras=MUTATION_EXTRAS.pack(seqno, 1, 0, 0, 0, 0, 0),
        key=b"bogus",
        value=b"x",
    )


def test_a_frame_is_a_mutation_by_magic_and_opcode_not_by_opcode_alone():
    p = _ScriptedProducer(
        [
            [_marker(1, 3), _mut(1), _not_a_mutation(2), _mut(2), _mut(3), _end],
        ]
    )
    rows = _rows(list(read_ranges(_cfg(p.port), [VbRange(0, 7, 0, 3)], "test")))
    assert [(r[1], r[3]) for r in rows] == [(1, b"k1"), (2, b"k2"), (3, b"k3")]
