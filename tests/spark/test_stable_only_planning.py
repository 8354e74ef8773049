"""Option ``stableOnly`` in planning: no planned end above a vbucket's stable seqno, so a
failover cannot take a planned batch's tail back (which would be a rollback).

On a server that is not part of a cluster the stable seqno is the persisted seqno
(dcp/producer/durability.py), so pausing the flusher holds it while writes go on. The
planner is driven directly (no Spark session), against real in-process servers, and
against a stand-in server (bytes on a socket) that reports no stable seqno.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dcp.protocol import FrameReader, Opcode, Status, codec
from dcp.spark import driver
from dcp.spark.batch_plan import plan_end
from dcp.spark.driver import Planner
from dcp.spark.errors import RangeUnavailableError
from dcp.spark.offsets import Offsets, VbPosition, earliest
from dcp.spark.options import parse_options

from .cluster_helpers import keys_in
from .helpers import ThreadServer
from .test_cluster import NVB, Pair

VBS = 16


def _cfg(port: int, **opts: str):
    base = {"port": str(port), "retryTimeout": "5", "planCacheMs": "0"}
    return parse_options({**base, **opts}, streaming=True)


def _write(server: ThreadServer, vb: int, n: int, value: bytes, start: int = 0, nvb=VBS) -> None:
    with server.kv() as kv:
        kv.set_many({k: value for k in keys_in(vb, start + n, nvb)[start:]})


def _seqnos(offsets: Offsets) -> dict[int, int]:
    return {vb: p.seqno for vb, p in offsets.items()}


def _persisted(server: ThreadServer, vb: int) -> int:
    return server.server.bucket.vbucket(vb).persisted_seqno


def test_plan_end_never_ends_above_the_stable_seqno() -> None:
    start = earliest([0, 1, 2])
    highs = {0: 30, 1: 30, 2: 30}
    boundaries = {0: [10, 20, 30], 1: [10, 20, 30], 2: [30]}
    stable = {0: 25, 1: 30, 2: 29}
    end = plan_end(start, highs, {}, boundaries, stable=stable)
    # the largest observed boundary at or below the stable seqno; none yet: no progress
    assert _seqnos(end) == {0: 20, 1: 30, 2: 0}
    assert _seqnos(plan_end(start, highs, {}, boundaries)) == {0: 30, 1: 30, 2: 30}
    # an availableNow target at or below the stable seqno is an end of its own
    end = plan_end(start, highs, {}, boundaries, target={0: 25, 1: 25, 2: 25}, stable=stable)
    assert _seqnos(end) == {0: 25, 1: 25, 2: 25}
    stable = {0: 24, 1: 9, 2: 25}  # a target above the stable seqno is not one
    end = plan_end(start, highs, {}, boundaries, target={0: 25, 1: 25, 2: 25}, stable=stable)
    assert _seqnos(end) == {0: 20, 1: 0, 2: 25}


def test_stable_only_plans_stop_at_the_persisted_seqno_until_it_moves(server, monkeypatch) -> None:
    monkeypatch.setattr(driver, "STABLE_SETTLE_SECONDS", 0.2)  # never settles here
    vbs = list(range(VBS))
    _write(server, 1, 4, b"a")
    server.flush()
    normal = Planner(_cfg(server.port))
    stable = Planner(_cfg(server.port, stableOnly="true"))
    try:
        start = earliest(vbs)
        assert _seqnos(stable.latest(start))[1] == 4  # persisted: stable at once

        server.pause_persistence()
        _write(server, 1, 4, b"b", start=4)  # seqnos 5..8, in memory only
        _write(server, 2, 3, b"c")  # seqnos 1..3, none persisted
        assert (_persisted(server, 1), _persisted(server, 2)) == (4, 0)

        got = _seqnos(normal.latest(start))
        assert (got[1], got[2]) == (8, 3)  # a normal query plans to the high seqnos
        got = _seqnos(stable.latest(start))
        assert (got[1], got[2]) == (4, 0)
        assert all(got[vb] <= _persisted(server, vb) for vb in vbs)
        # the one-off points (an availableNow run's target, a batch read's end): the
        # high seqnos are not stable within the wait, so the stable seqnos
        assert (stable.target()[1], stable.target()[2]) == (4, 0)
        assert (normal.target()[1], normal.target()[2]) == (8, 3)
        ends = _seqnos(stable.ending_offsets())
        assert (ends[1], ends[2]) == (4, 0)
        # a planner started now has seen no boundary at or below 4 in vbucket 1: it
        # waits rather than end a batch there (the stream a task reads may not either)
        fresh = Planner(_cfg(server.port, stableOnly="true"))
        try:
            got = _seqnos(fresh.latest(start))
            assert got[1] <= 4 and got[2] == 0
        finally:
            fresh.close()

        server.call(server.server.resume_persistence)
        server.flush()
        got = _seqnos(stable.latest(start))
        assert (got[1], got[2]) == (8, 3)  # persisted: planning moves on
        nxt = stable.latest({**start, 1: VbPosition(0, 4)})
        assert nxt[1].seqno == 8
    finally:
        normal.close()
        stable.close()


def test_a_one_off_point_waits_briefly_for_the_high_seqno_to_be_stable(server) -> None:
    """A batch read's end (and an availableNow target, startingOffsets=latest) is a high
    seqno, a boundary of every stream, once it is stable; not the stable seqno of the
    moment, which may fall inside the snapshot a task reads."""
    _write(server, 1, 4, b"a")
    server.flush()
    server.pause_persistence()
    _write(server, 1, 4, b"b", start=4)
    timer = threading.Timer(0.4, server.call, (server.server.resume_persistence,))
    planner = Planner(_cfg(server.port, stableOnly="true"))
    t0 = time.monotonic()
    timer.start()
    try:
        ends = _seqnos(planner.ending_offsets())
    finally:
        timer.join()
        planner.close()
    assert ends[1] == 8 and _persisted(server, 1) == 8
    assert 0.3 < time.monotonic() - t0 < driver.STABLE_SETTLE_SECONDS + 1


def test_on_a_cluster_each_active_node_is_asked_for_its_stable_seqnos(tmp_path: Path) -> None:
    pair = Pair(tmp_path)
    try:
        _write(pair.a, 0, 5, b"a", nvb=NVB)
        _write(pair.b, 2, 7, b"b", nvb=NVB)
        pair.a.flush()
        pair.b.flush()
        planner = Planner(pair.cfg(stableOnly="true", planCacheMs="0"))
        try:
            start = earliest(range(NVB))
            assert _seqnos(planner.latest(start)) == {0: 5, 1: 0, 2: 7, 3: 0}
            pair.a.pause_persistence()  # node a's vbuckets stop being stable
            _write(pair.a, 0, 5, b"a2", start=5, nvb=NVB)
            _write(pair.b, 2, 3, b"b2", start=7, nvb=NVB)
            pair.b.flush()
            assert _seqnos(planner.latest(start)) == {0: 5, 1: 0, 2: 10, 3: 0}
            pair.a.call(pair.a.server.resume_persistence)
            pair.a.flush()
            assert _seqnos(planner.latest(start)) == {0: 10, 1: 0, 2: 10, 3: 0}
        finally:
            planner.close()
    finally:
        pair.close()


class _OlderServer:
    """A single server of an older kind, speaking bytes: GET_ALL_VB_SEQNOS and failover
    logs for 4 vbuckets, STAT ``vbucket-seqno N`` answered as ``mode`` says (its pairs
    without ``stable_seqno``, or refused with a status), UNKNOWN_COMMAND to the rest."""

    HIGHS = {0: 12, 1: 0, 2: 7, 3: 3}

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.stats = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)  # accept() wakes up to see ``close``
        self._closed = False
        self.port: int = self._listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _answer(self, f) -> bytes:  # type: ignore[no-untyped-def]
        op, o = f.opcode, f.opaque
        if op == Opcode.GET_ALL_VB_SEQNOS:
            value = codec.all_vb_seqnos_value(sorted(self.HIGHS.items()))
            return codec.response(op, opaque=o, value=value)
        if op == Opcode.DCP_GET_FAILOVER_LOG:
            return codec.response(op, opaque=o, value=codec.failover_log_value([(77, 0)]))
        if op != Opcode.STAT:
            return codec.response(op, Status.UNKNOWN_COMMAND, opaque=o)
        self.stats += 1
        if self.mode != "no-key":
            return codec.response(op, Status(int(self.mode)), opaque=o, value=b"no")
        vb = int(bytes(f.key).split()[1])
        pairs = [(f"vb_{vb}:high_seqno", self.HIGHS[vb]), (f"vb_{vb}:vb_uuid", 77)]
        return b"".join(
            codec.response(op, opaque=o, key=k.encode(), value=str(v).encode()) for k, v in pairs
        ) + codec.response(op, opaque=o)

    def _serve(self, conn: socket.socket) -> None:
        reader = FrameReader()
        try:
            while data := conn.recv(65536):
                reader.feed(data)
                conn.sendall(b"".join(self._answer(f) for f in reader.read_frames()))
        except OSError:
            pass

    def close(self) -> None:
        self._closed = True
        self._thread.join(5)
        self._listener.close()
        for c in self._conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()


@pytest.fixture
def older() -> Iterator[_OlderServer]:
    s = _OlderServer("no-key")
    yield s
    s.close()


def test_a_server_without_stable_seqnos_is_a_clear_error_not_a_plan(older) -> None:
    vbs = list(_OlderServer.HIGHS)
    normal = Planner(_cfg(older.port, vbuckets="0,1,2,3"))
    try:  # a normal query plans to the high seqnos and sends no STAT at all
        assert _seqnos(normal.latest(earliest(vbs))) == _OlderServer.HIGHS
        assert _seqnos(normal.ending_offsets()) == _OlderServer.HIGHS
    finally:
        normal.close()
    assert older.stats == 0
    for plan in ("latest", "ending_offsets", "target"):
        planner = Planner(_cfg(older.port, stableOnly="true"))
        t0 = time.monotonic()
        try:
            with pytest.raises(RangeUnavailableError) as info:
                if plan == "latest":
                    planner.latest(earliest(vbs))
                else:
                    getattr(planner, plan)()
        finally:
            planner.close()
        assert time.monotonic() - t0 < 3  # not retried for retryTimeout
        text = str(info.value)
        assert "stableOnly=true" in text and "reports no stable seqno" in text
        assert "older version" in text
    assert older.stats > 0


@pytest.mark.parametrize(
    ("status", "words"),
    [(Status.KEY_ENOENT, "does not serve STAT vbucket-seqno"), (Status.EACCESS, "'stats'")],
)
def test_a_refused_stat_is_a_clear_error_naming_the_option(status, words) -> None:
    s = _OlderServer(str(int(status)))
    try:
        planner = Planner(_cfg(s.port, stableOnly="true"))
        try:
            with pytest.raises(RangeUnavailableError, match="stableOnly=true") as info:
                planner.latest(earliest(range(4)))
        finally:
            planner.close()
        assert words in str(info.value)
    finally:
        s.close()


def test_stat_pairs_of_several_groups_come_back_per_group(server) -> None:
    from dcp.spark.wire import WireClient

    _write(server, 3, 2, b"x")
    with WireClient("127.0.0.1", server.port) as c:
        a, b = c.stats(["vbucket-seqno 3", "vbucket-seqno 4"])
        assert a["vb_3:high_seqno"] == "2" and "vb_3:stable_seqno" in a
        assert set(b) and all(k.startswith("vb_4:") for k in b)
        assert c.get_all_vb_seqnos()[3] == 2  # the connection carries on after
