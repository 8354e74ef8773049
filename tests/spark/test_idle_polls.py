"""Idle polls of a stream: Spark asks ``latestOffset`` about every 12 ms with the same
offsets; the answer is reused until something it depends on changes (driver.py and
source.py module rules), and never when it depends on the clock."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

import dcp.spark.driver as driver_mod
import dcp.spark.source as source_mod
from dcp.spark.errors import OffsetError
from dcp.spark.offsets import VbPosition, from_json
from dcp.spark.source import DcpStreamReader

from .helpers import ThreadServer


def _reader(server: ThreadServer, **opts: str) -> DcpStreamReader:
    return DcpStreamReader({"port": str(server.port), **opts}, None)


@pytest.fixture
def counted(monkeypatch):
    """How often the batch end is planned and offsets are parsed from Spark's dicts."""
    calls = {"plan_end": 0, "from_json": 0}

    def counting(name, real):
        def f(*a, **k):
            calls[name] += 1
            return real(*a, **k)

        return f

    monkeypatch.setattr(driver_mod, "plan_end", counting("plan_end", driver_mod.plan_end))
    monkeypatch.setattr(source_mod, "from_json", counting("from_json", source_mod.from_json))
    return calls


def test_idle_polls_plan_once_per_refresh_not_once_per_poll(server, counted):
    with server.kv() as kv:
        kv.set_many({f"k{i}": b"v" for i in range(100)})
    r = _reader(server, planCacheMs="60000")  # no refresh during the polls
    start = r.initialOffset()
    text = json.dumps(r.latestOffset(start, ReadAllAvailable()))
    planned, parsed = counted["plan_end"], counted["from_json"]
    for _ in range(200):  # Spark hands a fresh dict parsed from its own text each time
        assert json.dumps(r.latestOffset(json.loads(text), ReadAllAvailable())) == text
    assert counted["plan_end"] - planned <= 1  # the first poll from the new start
    assert counted["from_json"] == parsed  # the reader made that offset: never parsed
    assert r.planner.refreshes == 1


def test_partitions_parse_nothing_the_reader_made_and_still_parse_what_it_did_not(server, counted):
    with server.kv() as kv:
        kv.set_many({f"k{i}": b"v" for i in range(64)})
    r = _reader(server, numPartitions="2")
    start = r.initialOffset()
    end = r.latestOffset(json.loads(json.dumps(start)), ReadAllAvailable())
    parts = r.partitions(json.loads(json.dumps(start)), json.loads(json.dumps(end)))
    assert counted["from_json"] == 0
    assert sum(t[3] - t[2] for p in parts for t in p.ranges) == 64
    # a batch replayed from Spark's log after a restart: offsets this reader never saw
    other = _reader(server, numPartitions="2")
    again = other.partitions(json.loads(json.dumps(start)), json.loads(json.dumps(end)))
    assert counted["from_json"] == 2
    assert [p.ranges for p in again] == [p.ranges for p in parts]


def test_new_changes_are_planned_after_the_next_refresh(server):
    r = _reader(server, planCacheMs="60000")
    start = r.initialOffset()
    for _ in range(5):
        assert r.latestOffset(json.loads(json.dumps(start)), ReadAllAvailable()) == start
    with server.kv() as kv:
        kv.set_many({f"k{i}": b"v" for i in range(30)})
    assert r.latestOffset(json.loads(json.dumps(start)), ReadAllAvailable()) == start  # cached
    r.planner.refresh(force=True)
    end = r.latestOffset(json.loads(json.dumps(start)), ReadAllAvailable())
    assert sum(p["s"] for p in end["vb"].values()) == 30


def _vb(key: str, n: int) -> int:
    from dcp.protocol import codec

    return codec.vbucket_for_key(key.encode(), n)


def test_another_limit_or_target_is_planned_not_reused(server):
    keys = [k for k in (f"k{i}" for i in range(3000)) if _vb(k, 16) == 0][:40]
    r = _reader(server, planCacheMs="60000", vbuckets="0")
    start = r.initialOffset()
    with server.kv() as kv:
        for i in range(0, 40, 10):  # four boundaries of vbucket 0, each seen by a refresh
            kv.set_many({k: b"v" for k in keys[i : i + 10]})
            r.planner.refresh(force=True)
    seqno = {"s": 0}

    def end(limit):
        got = r.latestOffset(json.loads(json.dumps(start)), limit)
        seqno["s"] = got["vb"]["0"]["s"]
        return seqno["s"]

    whole = end(ReadAllAvailable())
    assert whole == 40
    cut = end(ReadMaxRows(1))  # one boundary only, though the same start was just planned
    assert cut == 10
    assert end(ReadAllAvailable()) == whole
    r.prepareForTriggerAvailableNow()  # availableNow: the target is the high seqno now
    assert end(ReadAllAvailable()) == whole
    r._target = {0: cut}  # a smaller target is obeyed at once
    assert end(ReadAllAvailable()) == cut


def test_an_answer_the_caller_changes_does_not_change_the_next_one(server):
    with server.kv() as kv:
        kv.set_many({f"k{i}": b"v" for i in range(20)})
    r = _reader(server, planCacheMs="60000")
    planner = r.planner
    begin = from_json(r.initialOffset())
    first = planner.latest(begin)
    want = dict(first)
    first.clear()  # the caller's dict is its own
    assert planner.latest(begin) == want
    begin.pop(0)  # and so is the start it passed: a changed start is checked anew
    with pytest.raises(OffsetError, match="name 15 vbuckets"):
        planner.latest(begin)


def test_a_poll_waiting_for_min_rows_is_never_reused(server):
    r = _reader(server, minOffsetsPerTrigger="20", maxTriggerDelay="1s", planCacheMs="60000")
    start = r.initialOffset()
    with server.kv() as kv:
        kv.set_many({f"k{i}": b"v" for i in range(5)})
    r.planner.refresh(force=True)
    limit = r.getDefaultReadLimit()
    assert r.latestOffset(json.loads(json.dumps(start)), limit) == start  # 5 < 20: wait
    time.sleep(1.1)
    end = r.latestOffset(json.loads(json.dumps(start)), limit)  # the delay passed: go
    assert sum(p["s"] for p in end["vb"].values()) == 5
    # the same question again starts a new wait (what it always did), not the last answer
    assert r.latestOffset(json.loads(json.dumps(start)), limit) == start


def test_a_recorded_batch_voids_the_kept_answer(server, counted):
    with server.kv() as kv:
        kv.set_many({f"k{i}": b"v" for i in range(20)})
    r = _reader(server, planCacheMs="60000")
    start = r.initialOffset()
    end = r.latestOffset(json.loads(json.dumps(start)), ReadAllAvailable())
    planned = counted["plan_end"]
    r.latestOffset(json.loads(json.dumps(start)), ReadAllAvailable())
    assert counted["plan_end"] == planned  # reused
    # Spark replays another batch that ends at the same offset (a restart): its start is
    # where a rewind would go back to, so the answer is planned again
    finish = from_json(end)
    vb = next(v for v, p in finish.items() if p.seqno)
    r.planner.remember({**from_json(start), vb: VbPosition(0, 1)}, finish)
    r.latestOffset(json.loads(json.dumps(start)), ReadAllAvailable())
    assert counted["plan_end"] == planned + 1


def test_the_offset_memo_keeps_what_a_dict_meant_when_its_owner_changes_it() -> None:
    """Spark's dict is kept as a copy: changed in place afterwards, it is parsed anew."""
    from dcp.spark.offsets import to_json

    memo = source_mod._OffsetMemo()
    a = {0: VbPosition(7, 10)}
    obj = to_json(a)
    assert memo.parse(obj) == from_json(to_json(a))
    b = {0: VbPosition(7, 20)}
    obj.clear()
    obj.update(to_json(b))  # the same dict object, now meaning b
    assert memo.parse(obj) == from_json(to_json(b))
