"""dcpctl set-state / promote / move / vbuckets against real ``dcp-server`` processes
(8 vbuckets each, loopback): one node alone, and an active with its ``--replica-of``
replica."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dcp.protocol import Opcode, Status, codec

from .support import NUM_VBUCKETS, ServerProcess, Wire, ctl, fails, keys_for_vb, ok, ok_json, write


def states(port: int) -> dict[int, str]:
    return {r["vbucket"]: r["state"] for r in ok_json("vbuckets", port=port)["vbuckets"]}


def until(check, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def get_status(port: int, key: bytes) -> int:
    w = Wire(port)
    try:
        vb = codec.vbucket_for_key(key, NUM_VBUCKETS)
        return w.request(lambda o: codec.request(Opcode.GET, vbucket=vb, opaque=o, key=key)).status
    finally:
        w.close()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """An active node and a node whose every vbucket replicates it."""
    a = ServerProcess(tmp_path / "a").start()
    b = None
    try:
        b = ServerProcess(tmp_path / "b", "--replica-of", f"127.0.0.1:{a.port}").start()
        yield a, b
    finally:
        for srv in (b, a):
            if srv is not None:
                srv.kill()


def test_set_state_then_promote_adds_one_failover_entry_and_a_second_promote_none(server) -> None:
    p = server.port
    out = ok("set-state", "0-3", "dead", port=p)
    assert out.strip() == "vb 0-3: dead"
    assert [states(p)[vb] for vb in range(5)] == ["dead"] * 4 + ["active"]
    assert get_status(p, keys_for_vb(1, 1)[0]) == Status.NOT_MY_VBUCKET
    before = len(ok_json("failover-log", "2", port=p)["entries"])
    doc = ok_json("promote", "2", port=p)
    assert (doc["promoted"], doc["already_active"]) == (1, 0)
    assert len(ok_json("failover-log", "2", port=p)["entries"]) == before + 1
    doc = ok_json("promote", "2", port=p)
    assert (doc["promoted"], doc["already_active"]) == (0, 1)
    assert len(ok_json("failover-log", "2", port=p)["entries"]) == before + 1


def test_set_state_of_a_missing_vbucket_names_it_and_exits_1(server) -> None:
    line = fails("set-state", "6-9", "replica", port=server.port)
    assert "refused for 2 vbuckets: first vb 8: NOT_MY_VBUCKET" in line
    assert states(server.port)[6] == "replica"


def test_replica_shows_source_and_lag_then_an_unreachable_source_then_promotes(pair) -> None:
    a, b = pair
    source = f"127.0.0.1:{a.port}"
    write(a.port, [(k, b"v") for k in keys_for_vb(3, 5)])

    def caught_up() -> bool:
        rows = ok_json("vbuckets", port=b.port)["vbuckets"]
        return rows[3]["high_seqno"] == 5 and rows[3]["lag"] == 0

    until(caught_up)
    rows = ok_json("vbuckets", port=b.port)["vbuckets"]
    assert {r["state"] for r in rows} == {"replica"}
    assert {r["source"] for r in rows} == {source}
    assert rows[3]["source_high_seqno"] == 5 and rows[3]["source_reachable"] is True
    a.kill()
    text = ok("vbuckets", port=b.port)
    assert "unreachable" in text and "* source unreachable" in text
    doc = ok_json("promote", port=b.port)
    assert doc["promoted"] == NUM_VBUCKETS and doc["already_active"] == 0
    assert set(states(b.port).values()) == {"active"}
    assert ok_json("get", keys_for_vb(3, 1)[0].decode(), port=b.port)["value"] == "v"


def test_move_hands_a_vbucket_over_and_makes_the_old_node_its_replica(tmp_path: Path) -> None:
    a = ServerProcess(tmp_path / "a").start()
    b = ServerProcess(tmp_path / "b").start()
    try:
        keys = keys_for_vb(3, 4)
        write(a.port, [(k, b"moved") for k in keys])
        out = ok("move", "3", "--to", f"127.0.0.1:{b.port}", port=a.port, timeout=90)
        assert out.strip().splitlines()[-1].startswith(f"moved vb 3 from 127.0.0.1:{a.port}")
        assert states(b.port)[3] == "active" and states(a.port)[3] == "replica"
        assert get_status(a.port, keys[0]) == Status.NOT_MY_VBUCKET
        assert ok_json("get", keys[0].decode(), port=b.port)["value"] == "moved"
        row = ok_json("vbuckets", "--vb", "3", port=a.port)["vbuckets"][0]
        assert row["source"] == f"127.0.0.1:{b.port}"
        # moving it again from the node that no longer has it is refused up front
        line = fails("move", "3", "--to", f"127.0.0.1:{b.port}", port=a.port)
        assert "vb 3 is replica" in line
    finally:
        b.kill()
        a.kill()


def test_promote_with_nothing_to_promote(server) -> None:
    r = ctl("promote", port=server.port)
    assert r.returncode == 0 and "nothing to promote" in r.stdout
