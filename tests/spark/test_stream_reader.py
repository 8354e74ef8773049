"""The stream reader's driver-side methods, called directly (no Spark session)."""

from __future__ import annotations

import json
import pickle

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from dcp.spark.errors import RollbackDetectedError
from dcp.spark.source import DcpStreamReader

from .helpers import ThreadServer


def _reader(server: ThreadServer, **opts: str) -> DcpStreamReader:
    return DcpStreamReader({"port": str(server.port), **opts}, None)


def test_latest_is_resolved_once_and_read_back_after_a_restart(server, tmp_path):
    path = str(tmp_path / "start.json")
    with server.kv() as kv:
        kv.set_many({f"a{i}": b"1" for i in range(50)})
    first = _reader(server, startingOffsets="latest", startingOffsetsFile=path)
    init = first.initialOffset()
    assert first.initialOffset() == init  # stable within a run
    assert sum(p["s"] for p in init["vb"].values()) == 50
    with server.kv() as kv:
        kv.set_many({f"b{i}": b"2" for i in range(50)})
    again = _reader(server, startingOffsets="latest", startingOffsetsFile=path)
    assert json.dumps(again.initialOffset()) == json.dumps(init)  # and across restarts
    end = again.latestOffset(init, ReadAllAvailable())
    assert sum(p["s"] for p in end["vb"].values()) == 100


def test_an_idle_stream_returns_its_start_unchanged_and_planning_is_cached(server):
    with server.kv() as kv:
        kv.set_many({f"k{i}": b"v" for i in range(100)})
    r = _reader(server)
    start = r.initialOffset()
    end = r.latestOffset(start, ReadAllAvailable())
    text = json.dumps(end)
    for _ in range(200):  # Spark polls about every 12 ms when idle
        assert json.dumps(r.latestOffset(json.loads(text), ReadAllAvailable())) == text
    assert r.planner.refreshes <= 3  # one server round trip per 250 ms, not per poll
    restored = pickle.loads(pickle.dumps(r))  # what Spark ships to executors: no socket
    assert restored._planner is None and restored.cfg == r.cfg


def test_a_row_limit_splits_a_backlog_at_observed_boundaries(server):
    r = _reader(server, maxRowsPerBatch="30", vbuckets="0", planCacheMs="0")
    start = r.initialOffset()
    assert r.getDefaultReadLimit() == ReadMaxRows(30)
    keys = [k for k in (f"k{i}" for i in range(3000)) if _vb(k, 16) == 0][:80]
    with server.kv() as kv:
        for i in range(0, 80, 20):  # four writes, each seen by a planning poll
            kv.set_many({k: b"v" for k in keys[i : i + 20]})
            r.latestOffset(start, ReadMaxRows(10**9))
    seqs = []
    pos = start
    while True:
        nxt = r.latestOffset(pos, ReadMaxRows(30))
        if nxt == pos:
            break
        seqs.append(nxt["vb"]["0"]["s"])
        pos = nxt
    assert seqs == [20, 40, 60, 80]


def _vb(key: str, n: int) -> int:
    from dcp.protocol import codec

    return codec.vbucket_for_key(key.encode(), n)


def test_a_rollback_at_the_start_offset_fails_planning_or_rewinds(tmp_path):
    s = ThreadServer(tmp_path / "d", num_vbuckets=4)
    try:
        with s.kv() as kv:
            kv.set_many({f"p{i}": b"kept" for i in range(20)})
            s.flush()
            s.pause_persistence()
            kv.set_many({f"m{i}": b"lost" for i in range(20)})
        r = _reader(s)
        consumed = r.latestOffset(r.initialOffset(), ReadAllAvailable())
    finally:
        s.stop(clean=False)
    s = ThreadServer(tmp_path / "d", num_vbuckets=4)
    try:
        with pytest.raises(RollbackDetectedError) as info:
            _reader(s).latestOffset(consumed, ReadAllAvailable())
        err = info.value
        pos = consumed["vb"][str(err.vbucket)]
        assert (str(err.vb_uuid), err.seqno) == (pos["u"], pos["s"])
        assert err.rollback_seqno < err.seqno
        end = _reader(s, onRollback="rewind").latestOffset(consumed, ReadAllAvailable())
        marked = {vb: p for vb, p in end["vb"].items() if "rb" in p}
        assert marked and all(
            p["rb"] == p["s"] < consumed["vb"][vb]["s"] for vb, p in marked.items()
        )
    finally:
        s.stop()


def test_a_server_without_history_is_named_once_at_query_start(tmp_path, caplog):
    from .conftest import NO_HISTORY

    s = ThreadServer(tmp_path / "off", **NO_HISTORY)
    try:
        r = _reader(s)
        with caplog.at_level("WARNING", logger="dcp.spark"):
            r.latestOffset(r.initialOffset(), ReadAllAvailable())
            r.latestOffset(r.initialOffset(), ReadAllAvailable())
    finally:
        s.stop()
    warned = [m for m in caplog.messages if "keeps no change history" in m]
    assert len(warned) == 1 and "history_seconds" in warned[0]


def test_a_server_with_history_gives_no_warning(history_server, caplog):
    r = _reader(history_server)
    with caplog.at_level("WARNING", logger="dcp.spark"):
        r.latestOffset(r.initialOffset(), ReadAllAvailable())
    assert not [m for m in caplog.messages if "history" in m]


def test_a_refused_first_connection_fails_at_once_naming_the_options(server):
    import socket
    import time

    from dcp.spark.errors import RangeUnavailableError

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    r = DcpStreamReader({"port": str(port), "retryTimeout": "30"}, None)
    t = time.monotonic()
    with pytest.raises(RangeUnavailableError, match="refused the connection") as info:
        r.initialOffset()
    assert time.monotonic() - t < 5  # not the 30 s of retries
    assert "retryTimeout=forever" in str(info.value) and "port" in str(info.value)


def test_a_server_gone_for_longer_than_retry_timeout_names_the_option(tmp_path):
    from dcp.spark.errors import RangeUnavailableError

    s = ThreadServer(tmp_path / "d")
    r = _reader(s, retryTimeout="0.5", planCacheMs="0")
    start = r.initialOffset()
    s.stop()
    with pytest.raises(RangeUnavailableError, match=r"retryTimeout=0\.5") as info:
        r.latestOffset(start, ReadAllAvailable())
    assert "forever" in str(info.value)


def test_min_rows_waits_for_enough_changes_or_the_delay(server):
    r = _reader(server, minOffsetsPerTrigger="20", maxTriggerDelay="1s", planCacheMs="0")
    start = r.initialOffset()
    with server.kv() as kv:
        kv.set_many({f"k{i}": b"v" for i in range(5)})
    assert r.latestOffset(start, r.getDefaultReadLimit()) == start  # 5 < 20: wait
    import time

    time.sleep(1.1)
    end = r.latestOffset(start, r.getDefaultReadLimit())  # the delay passed: go
    assert sum(p["s"] for p in end["vb"].values()) == 5


def test_executors_without_pyarrow_get_a_direct_error(monkeypatch):
    import sys

    from dcp.spark.errors import DcpSparkError
    from dcp.spark.source import _need_pyarrow

    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow -> ImportError
    with pytest.raises(DcpSparkError, match="PYSPARK_PYTHON"):
        _need_pyarrow()
