"""Issue-level scenarios through Spark: streams that a row limit, a restart of the query
or of the server used to leave stuck (``MergedSnapshotError`` forever) end exact on a
server with a bounded change history (``conftest.HISTORY``; the server's default is still
off, see docs/spark.md "Running the server for streaming"); rollback rows applied from a
file sink give the server's documents; options are checked at ``load()``.

"Exact" is checked against the writers' own log: every (batch, vbucket) change set holds,
per key, the newest write whose seqno lies in the set's ``[snapshot_start,
snapshot_end]``, nothing else. A server with ``checkpoint_retain_seconds=0`` stands for
"the batch ran (or was replayed) after the default 10 s retention".
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from .conftest import HISTORY
from .helpers import ThreadServer
from .test_spark import Rows, Sink, check_change_sets, run, start, state_of

pytestmark = pytest.mark.spark

Log = list[tuple[int, int, str, bytes]]  # (vbucket, seqno, key, value), as acknowledged


def write(s: ThreadServer, items: dict[str, bytes], log: Log) -> None:
    with s.kv() as kv:
        for r in kv.set_many(items):
            assert r.seqno is not None
            log.append((r.vbucket, r.seqno, r.key.decode(), items[r.key.decode()]))


def check_against_log(sink: Sink, log: Log) -> None:
    """Each (batch, vbucket) change set is exactly the newest logged write per key in it."""
    for bid, rows in sink.batches.items():
        by_vb: dict[int, Rows] = {}
        for r in rows:
            by_vb.setdefault(r["vbucket"], []).append(r)
        for vb, rs in by_vb.items():
            ss, se = rs[0]["snapshot_start"], rs[0]["snapshot_end"]
            want: dict[str, tuple[int, bytes]] = {}
            for v, seq, key, value in sorted(log, key=lambda e: e[1]):
                if v == vb and ss <= seq <= se:
                    want[key] = (seq, value)
            got = {r["key"]: (r["seqno"], bytes(r["value"])) for r in rs}
            assert got == want, (bid, vb, ss, se)


def test_a_row_limited_stream_behind_its_writer_stays_exact(spark, tmp_path):
    """1a: ``maxOffsetsPerTrigger`` makes the stream lag behind rewrites of the same keys;
    the later pieces of the backlog are read from disk, cut where they were planned."""
    s = ThreadServer(tmp_path / "d", checkpoint_retain_seconds=0, **HISTORY)
    log: Log = []
    sink = Sink()
    stop = threading.Event()

    def writer() -> None:
        for i in range(20):  # 600 rewrites of 150 keys over about 2 s
            write(s, {f"hot{(i * 37 + j) % 150}": b"w%d" % i for j in range(30)}, log)
            time.sleep(0.1)
        stop.set()

    w = threading.Thread(target=writer)
    try:
        q = start(spark, s.port, tmp_path / "ck", sink, trigger={}, maxOffsetsPerTrigger=100)
        w.start()
        w.join()
        time.sleep(0.5)  # past the planner's 250 ms cache
        q.processAllAvailable()
        q.stop()
    finally:
        stop.set()
        s.stop()
    assert q.exception() is None
    assert len(sink.batches) >= 4
    check_change_sets(sink)
    check_against_log(sink, log)
    assert state_of(sink.rows()) == {k: v for _, _, k, v in sorted(log, key=lambda e: e[1])}


@pytest.mark.parametrize("restart", ["query", "server"])
def test_a_logged_batch_replays_exactly_after_a_restart(spark, tmp_path, restart):
    """1b/1c: the query dies after Spark logged a batch's offsets (a crash inside the
    batch); the documents are rewritten and persisted; then either only the query
    restarts late (after the retention) or the server is restarted first. The replay
    yields the first attempt's rows, and the stream continues with no gap or duplicate."""
    data, ck = tmp_path / "d", tmp_path / "ck"
    kw: dict[str, Any] = dict(HISTORY)
    if restart == "query":
        kw["checkpoint_retain_seconds"] = 0
    s = ThreadServer(data, **kw)
    log: Log = []
    try:
        write(s, {f"k{i}": b"a" for i in range(300)}, log)
        sink = Sink()
        assert run(spark, s.port, ck, sink) is None
        write(s, {f"k{i}": b"b" for i in range(0, 400, 2)}, log)
        crashing = Sink(crash_on=lambda bid: bid == 1)
        err = run(spark, s.port, ck, crashing)
        assert err is not None and "simulated crash" in str(err)
        first = crashing.attempts[-1][1]
        if restart == "server":
            s.stop()  # a graceful stop (SIGTERM): memory checkpoints are gone
            s = ThreadServer(data, port=s.port, **kw)
        write(s, {f"k{i}": b"c" for i in range(0, 400, 3)}, log)  # rewrites batch 1's keys
        s.flush()
        assert run(spark, s.port, ck, sink) is None
    finally:
        s.stop()
    assert sorted(sink.batches) == [0, 1, 2]
    key = lambda r: (r["vbucket"], r["seqno"])  # noqa: E731
    assert sorted(sink.batches[1], key=key) == sorted(first, key=key)
    check_change_sets(sink)
    check_against_log(sink, log)


def test_rollback_rows_applied_from_a_parquet_sink_give_the_servers_documents(spark, tmp_path):
    """2: a server crash loses writes the stream had read, including updates of keys
    whose older versions the same change set had deduplicated away. With
    ``failOnDataLoss=false`` the sink gets rollback rows and the re-read; the documented
    ``current_documents`` over the parquet files equals the server's documents."""
    from dcp.spark import current_documents

    data, out = tmp_path / "d", tmp_path / "out"
    s = ThreadServer(data, num_vbuckets=4)

    def drain(port: int, **options: Any) -> None:
        reader = spark.readStream.format("dcp").option("port", port)
        for k, v in options.items():
            reader = reader.option(k, v)
        q = (
            reader.load()
            .writeStream.format("parquet")
            .option("path", str(out / "changes"))
            .option("checkpointLocation", str(out / "ck"))
            .trigger(availableNow=True)
            .start()
        )
        q.awaitTermination()

    try:
        with s.kv() as kv:
            kv.set_many({f"p{i}": b"kept" for i in range(60)})
            s.flush()
            s.pause_persistence()
            kv.set_many({f"p{i}": b"lost" for i in range(30)})  # updates the crash loses
            kv.set_many({f"m{i}": b"lost" for i in range(20)})  # new keys it loses
        drain(s.port)
    finally:
        s.stop(clean=False)
    s = ThreadServer(data, num_vbuckets=4, port=s.port)
    try:
        with s.kv() as kv:
            kv.set_many({f"p{i}": b"after" for i in range(20, 40)})
            kv.set_many({f"n{i}": b"after" for i in range(10)})
            kv.delete("p50")
            keys = [f"{c}{i}" for c in "pmn" for i in range(60)]
            found = kv.get_many(keys)
        drain(s.port, failOnDataLoss="false")
    finally:
        s.stop()
    server_docs = {k.decode(): g.value for k, g in found.items()}
    assert server_docs["p0"] == b"kept" and "m0" not in server_docs
    changes = spark.read.parquet(str(out / "changes"))
    rows = changes.collect()
    assert any(r["op"] == "rollback" for r in rows)
    pairs = [(r["vbucket"], r["seqno"]) for r in rows if r["op"] != "rollback"]
    assert len(set(pairs)) < len(pairs)  # the same (vbucket, seqno) on both branches ...
    ordered = [(r["vbucket"], r["position"]) for r in rows]
    assert len(set(ordered)) == len(ordered)  # ... told apart by position
    got = {r["key"]: bytes(r["value"]) for r in current_documents(changes).collect()}
    assert got == server_docs


def test_options_are_checked_at_load_with_a_hint(spark):
    from pyspark.errors import PySparkException

    for reader in (spark.read, spark.readStream):
        with pytest.raises(PySparkException) as info:
            reader.format("dcp").option("maxOffsetPerTrigger", 10).load()
        assert "did you mean 'maxOffsetsPerTrigger'" in str(info.value)


def test_batch_reads_honour_starting_and_ending_offsets(spark, tmp_path: Path):
    s = ThreadServer(tmp_path / "d", num_vbuckets=1)
    log: Log = []
    try:
        write(s, {f"k{i}": b"v" for i in range(10)}, log)
        rows = (
            spark.read.format("dcp")
            .option("port", s.port)
            .option("startingOffsets", '{"0": 3}')
            .option("endingOffsets", '{"0": 7}')
            .load()
            .collect()
        )
    finally:
        s.stop()
    assert sorted(r["seqno"] for r in rows) == [4, 5, 6, 7]
    assert all(r["timestamp"] is not None and r["vb_uuid"] for r in rows)
