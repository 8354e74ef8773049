"""End to end through a local Spark session: ``format("dcp")`` with no register call.

One session for the module (``conftest.spark``); each test runs the real server on a
thread and drives batch reads or streaming queries (``foreachBatch`` into a dict keyed by
batch id, so a replayed batch overwrites its first attempt like an idempotent sink).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .helpers import ThreadServer

pytestmark = pytest.mark.spark

Rows = list[dict[str, Any]]


class Sink:
    """``foreachBatch`` target: rows per batch id; optionally crash on some batch."""

    def __init__(self, crash_on: Callable[[int], bool] | None = None) -> None:
        self.batches: dict[int, Rows] = {}
        self.attempts: list[tuple[int, Rows]] = []
        self.crash_on = crash_on

    def __call__(self, df: Any, batch_id: int) -> None:
        rows = [r.asDict() for r in df.collect()]
        self.attempts.append((batch_id, rows))
        if self.crash_on is not None and self.crash_on(batch_id):
            raise RuntimeError(f"simulated crash in batch {batch_id}")
        self.batches[batch_id] = rows

    def rows(self) -> Rows:
        return [r for b in sorted(self.batches) for r in self.batches[b]]


def start(
    spark: Any, port: int, ck: Path, sink: Sink, trigger: dict | None = None, **options: Any
) -> Any:
    reader = spark.readStream.format("dcp").option("port", port).option("retryTimeout", 5)
    for k, v in options.items():
        reader = reader.option(k, v)
    writer = reader.load().writeStream.foreachBatch(sink).option("checkpointLocation", str(ck))
    if trigger is None:
        trigger = {"availableNow": True}
    if trigger:  # {} = Spark's default trigger: the next batch as soon as one is done
        writer = writer.trigger(**trigger)
    return writer.start()


def run(spark: Any, port: int, ck: Path, sink: Sink, **options: Any) -> Exception | None:
    from pyspark.errors import StreamingQueryException

    q = start(spark, port, ck, sink, **options)
    try:
        q.awaitTermination()
    except StreamingQueryException as exc:
        return exc
    return None


def state_of(rows: Rows) -> dict[str, bytes]:
    """Apply change rows in order (per vbucket by seqno) to a key -> value map."""
    out: dict[str, bytes] = {}
    for r in rows:
        if r["op"] == "mutation":
            out[r["key"]] = bytes(r["value"])
        elif r["op"] in ("deletion", "expiration"):
            out.pop(r["key"], None)
    return out


def check_change_sets(sink: Sink) -> None:
    """Every (batch, vbucket) is one change set: one snapshot range, each key once, all
    seqnos inside; consecutive batches of a vbucket continue exactly where the last ended."""
    last_end: dict[int, int] = {}
    for bid in sorted(sink.batches):
        by_vb: dict[int, Rows] = {}
        for r in sink.batches[bid]:
            by_vb.setdefault(r["vbucket"], []).append(r)
        for vb, rs in by_vb.items():
            data = [r for r in rs if r["op"] != "rollback"]
            if not data:
                continue
            ranges = {(r["snapshot_start"], r["snapshot_end"]) for r in data}
            assert len(ranges) == 1, (bid, vb, ranges)
            ((s, e),) = ranges
            assert all(s <= r["seqno"] <= e for r in data)
            assert len({r["key"] for r in data}) == len(data)
            assert s == last_end.get(vb, 0) + 1, (bid, vb, s, last_end.get(vb))
            last_end[vb] = e


def test_batch_read_equals_the_server_contents_across_partitions(spark, tmp_path):
    s = ThreadServer(tmp_path / "d", num_vbuckets=64)
    try:
        with s.kv() as kv:
            kv.set_many({f"doc{i}": f"v1-{i}".encode() for i in range(3000)})
            kv.set_many({f"doc{i}": f"v2-{i}".encode() for i in range(0, 3000, 4)})
            kv.delete_many([f"doc{i}" for i in range(0, 3000, 9)])
        df = spark.read.format("dcp").option("port", s.port).option("numPartitions", 3).load()
        assert df.rdd.getNumPartitions() == 3
        from pyspark.sql.pandas.types import to_arrow_schema

        from dcp.spark.arrow import arrow_schema

        assert to_arrow_schema(df.schema, timezone="UTC").equals(arrow_schema())
        rows = [r.asDict() for r in df.collect()]
    finally:
        s.stop()
    assert len({r["key"] for r in rows}) == len(rows) == 3000  # one row per key
    live = {i for i in range(3000) if i % 9}
    assert state_of(sorted(rows, key=lambda r: (r["vbucket"], r["seqno"]))) == {
        f"doc{i}": (f"v2-{i}" if i % 4 == 0 else f"v1-{i}").encode() for i in live
    }
    assert {r["key"] for r in rows if r["op"] == "deletion"} == {
        f"doc{i}" for i in range(0, 3000, 9)
    }
    assert len({r["vbucket"] for r in rows}) == 64


def _writer(s: ThreadServer, stop: threading.Event, last: dict[str, bytes], rewrite: bool) -> None:
    with s.kv() as kv:
        i = 0
        while not stop.is_set():
            if rewrite:  # the same 150 keys again and again: deduplication everywhere
                batch = {f"hot{(i * 37 + j) % 150}": b"w%d" % i for j in range(30)}
            else:  # new documents only (an append-only feed)
                batch = {f"new{i}-{j}": b"w%d" % i for j in range(30)}
            kv.set_many(batch)
            last.update(batch)
            i += 1
            time.sleep(0.01)


@pytest.mark.parametrize(
    ("history", "rewrite", "options"),
    [
        (True, True, {}),
        (False, False, {}),
        (False, True, {"onMergedSnapshot": "reread"}),
    ],
    ids=["history-window-rewrites", "no-history-inserts", "no-history-rewrites-reread"],
)
def test_streaming_under_concurrent_writes_yields_only_whole_change_sets(
    spark, tmp_path, history, rewrite, options
):
    s = ThreadServer(tmp_path / "d", **({"history_seconds": 3600} if history else {}))
    sink = Sink()
    last: dict[str, bytes] = {}
    stop = threading.Event()
    w = threading.Thread(target=_writer, args=(s, stop, last, rewrite))
    try:
        w.start()
        q = start(
            spark,
            s.port,
            tmp_path / "ck",
            sink,
            trigger={"processingTime": "100 milliseconds"},
            **options,
        )
        deadline = time.monotonic() + 60
        while len(sink.batches) < 4 and time.monotonic() < deadline and q.isActive:
            time.sleep(0.1)
        stop.set()
        w.join()
        time.sleep(0.3)  # the planner reuses the server's high seqnos for 250 ms
        q.processAllAvailable()
        q.stop()
    finally:
        stop.set()
        s.stop()
    assert len(sink.batches) >= 4
    assert state_of(sink.rows()) == last
    if not options:
        check_change_sets(sink)  # exact: contiguous, no overlap, one change set each
    else:  # merged snapshots were taken whole: each batch/vbucket still one change set
        for rows in sink.batches.values():
            by_vb: dict[int, Rows] = {}
            for r in rows:
                by_vb.setdefault(r["vbucket"], []).append(r)
            for rs in by_vb.values():
                assert len({(r["snapshot_start"], r["snapshot_end"]) for r in rs}) == 1
                assert len({r["key"] for r in rs}) == len(rs)


def test_crash_and_resume_replay_the_same_rows_with_no_gap_or_duplicate(
    spark, history_server, tmp_path
):
    s, ck = history_server, tmp_path / "ck"
    expected: dict[str, bytes] = {}

    def write(items: dict[str, bytes]) -> None:
        with s.kv() as kv:
            kv.set_many(items)
        expected.update(items)
        s.flush()

    write({f"k{i}": b"a" for i in range(300)})
    sink = Sink()
    assert run(spark, s.port, ck, sink) is None  # a clean stop after batch 0
    write({f"k{i}": b"b" for i in range(0, 400, 2)})
    crashing = Sink(crash_on=lambda bid: bid == 1)
    err = run(spark, s.port, ck, crashing)
    assert err is not None and "simulated crash" in str(err)
    first_attempt = crashing.attempts[-1]
    assert first_attempt[0] == 1 and first_attempt[1]
    write({f"k{i}": b"c" for i in range(0, 400, 3)})  # rewrites keys of batch 1, persisted
    assert run(spark, s.port, ck, sink) is None
    assert sorted(sink.batches) == [0, 1, 2]
    key = lambda r: (r["vbucket"], r["seqno"])  # noqa: E731
    assert sorted(sink.batches[1], key=key) == sorted(first_attempt[1], key=key)
    rows = sink.rows()
    assert len({key(r) for r in rows}) == len(rows)  # no duplicate
    check_change_sets(sink)  # no gap: every vbucket continues where it ended
    assert state_of(rows) == expected


def _crash_then_rewrite(spark, s: ThreadServer, ck) -> list:
    """200 documents; a query whose first batch crashes after reading them (offsets
    logged, commit not); then half the documents rewritten and persisted. Returns the
    rows the crashed batch saw."""
    with s.kv() as kv:
        kv.set_many({f"k{i}": b"old" for i in range(200)})
    crashing = Sink(crash_on=lambda bid: True)
    assert run(spark, s.port, ck, crashing) is not None
    with s.kv() as kv:  # without a history window the old versions leave the disk
        kv.set_many({f"k{i}": b"new" for i in range(0, 200, 2)})
    s.flush()
    return crashing.attempts[0][1]


def test_a_replay_the_server_can_no_longer_serve_exactly_fails_or_is_reread(
    spark, disk_server, tmp_path
):
    s, ck = disk_server, tmp_path / "ck"
    original = _crash_then_rewrite(spark, s, ck)
    err = run(spark, s.port, ck, Sink())
    assert err is not None and "can no longer be served exactly" in str(err)
    assert "onMergedSnapshot=reread" in str(err)
    sink = Sink()
    assert run(spark, s.port, ck, sink, onMergedSnapshot="reread") is None
    replay = sink.batches[0]
    assert state_of(replay) == {f"k{i}": b"new" if i % 2 == 0 else b"old" for i in range(200)}
    planned = {r["vbucket"]: r["snapshot_end"] for r in original}
    assert any(r["snapshot_end"] > planned[r["vbucket"]] for r in replay)  # it says so


def test_a_prompt_replay_over_rewritten_documents_is_exact_without_history(
    spark, no_history_server, tmp_path
):
    """Within the server's checkpoint retention a replayed batch is read from memory at
    its planned boundaries: the same rows, although the documents were rewritten."""
    s, ck = no_history_server, tmp_path / "ck"
    original = _crash_then_rewrite(spark, s, ck)
    sink = Sink()
    assert run(spark, s.port, ck, sink) is None
    key = lambda r: (r["vbucket"], r["seqno"])  # noqa: E731
    assert sorted(sink.batches[0], key=key) == sorted(original, key=key)
    assert state_of(sink.batches[0]) == {f"k{i}": b"old" for i in range(200)}


def test_rollback_after_an_unclean_restart_fails_or_rewinds_explicitly(spark, tmp_path):
    data, ck = tmp_path / "d", tmp_path / "ck"
    s = ThreadServer(data, num_vbuckets=4)
    try:
        with s.kv() as kv:
            kv.set_many({f"p{i}": b"kept" for i in range(40)})
            s.flush()
            s.pause_persistence()
            kv.set_many({f"m{i}": b"lost" for i in range(40)})
        sink = Sink()
        assert run(spark, s.port, ck, sink) is None
        assert len(sink.rows()) == 80
    finally:
        s.stop(clean=False)  # a crash: the memory-only writes are gone
    s = ThreadServer(data, num_vbuckets=4)
    try:
        err = run(spark, s.port, ck, Sink())
        assert err is not None
        msg = str(err)
        assert "rollback detected" in msg and "vbucket" in msg and "uuid" in msg
        assert "roll back to seqno" in msg
        with s.kv() as kv:
            kv.set_many({f"n{i}": b"after" for i in range(10)})
        sink2 = Sink()
        assert run(spark, s.port, ck, sink2, onRollback="rewind") is None
    finally:
        s.stop()
    rows = sink2.rows()
    rollbacks = [r for r in rows if r["op"] == "rollback"]
    assert rollbacks and all(r["key"] is None for r in rollbacks)
    lost_vbs = {r["vbucket"] for r in sink.rows() if r["key"].startswith("m")}
    assert {r["vbucket"] for r in rollbacks} == lost_vbs
    replayed = state_of([r for r in rows if r["op"] != "rollback"])
    assert {k for k in replayed if k.startswith("n")} == {f"n{i}" for i in range(10)}
    assert not any(k.startswith("m") for k in replayed)


def test_an_idle_stream_plans_no_empty_batches(spark, server, tmp_path):
    with server.kv() as kv:
        kv.set_many({f"k{i}": b"v" for i in range(20)})
    sink = Sink()
    q = start(spark, server.port, tmp_path / "ck", sink, trigger={})  # default: poll at once
    try:
        q.processAllAvailable()
        time.sleep(2.0)  # ~160 polls while idle
        assert len(sink.attempts) == 1
        with server.kv() as kv:
            kv.set("late", b"x")
        q.processAllAvailable()
        deadline = time.monotonic() + 20
        while len(sink.attempts) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        q.stop()
    assert [len(rows) for _, rows in sink.attempts] == [20, 1]
