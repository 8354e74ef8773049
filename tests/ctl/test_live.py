"""dcpctl against a live server process: vbuckets, failover-log, checkpoints, stats,
connections, streams, get/set/delete, and the errors a user can run into."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from dcp.protocol import Status, codec

from .support import (
    ServerProcess,
    Wire,
    ctl,
    fails,
    free_port,
    keys_for_vb,
    ok,
    ok_json,
    table_header,
    table_rows,
    wait_persisted,
    write,
)


def test_vbuckets_shows_every_vbucket_with_seqnos_memory_and_totals(server) -> None:
    p = server.port
    write(p, [(k, b"v") for k in keys_for_vb(2, 3)] + [(k, b"v") for k in keys_for_vb(5, 2)])
    wait_persisted(p)
    doc = ok_json("vbuckets", port=p)
    rows = {r["vbucket"]: r for r in doc["vbuckets"]}
    assert sorted(rows) == list(range(8))
    assert (rows[2]["high_seqno"], rows[5]["high_seqno"], rows[0]["high_seqno"]) == (3, 2, 0)
    assert rows[2]["persisted_seqno"] == 3 and rows[2]["purge_seqno"] == 0
    assert rows[2]["state"] == "active" and rows[2]["vb_uuid"] > 0
    assert rows[2]["items_in_memory"] == 3 and rows[2]["checkpoints"] >= 1
    assert rows[2]["checkpoint_memory"] > 0 and rows[2]["open_streams"] == 0
    assert doc["totals"]["high_seqno"] == 5 and doc["totals"]["states"] == {"active": 8}

    text = ok("vbuckets", port=p)
    assert table_header(text)[:5] == ["vb", "state", "uuid", "high", "persisted"]
    body = table_rows(text)
    assert [r[0] for r in body] == [*map(str, range(8)), "total"]
    assert body[2][1:5] == ["active", str(rows[2]["vb_uuid"]), "3", "3"]
    assert body[-1][1] == "8 active" and body[-1][3] == "5"


def test_vbuckets_filters_by_list_and_state_and_refuses_unknown_ones(server) -> None:
    p = server.port
    doc = ok_json("vbuckets", "--vb", "1,3-4", port=p)
    assert [r["vbucket"] for r in doc["vbuckets"]] == [1, 3, 4]
    assert doc["totals"]["vbuckets"] == 3
    assert len(ok_json("vbuckets", "--active", port=p)["vbuckets"]) == 8
    assert [r[0] for r in table_rows(ok("vbuckets", "--vb", "7", port=p))] == ["7", "total"]
    assert "vbucket 9 does not exist" in fails("vbuckets", "--vb", "9", port=p)
    r = ctl("vbuckets", "--vb", "x", port=p)
    assert r.returncode == 2 and "not a vbucket list" in r.stderr


def test_failover_log_is_newest_first_after_an_unclean_restart(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "data").start()
    try:
        write(srv.port, [(k, b"v") for k in keys_for_vb(1, 3)])
        wait_persisted(srv.port)
        srv.kill()  # kill -9: the next warm-up starts a new history branch at seqno 3
        srv.start()
        doc = ok_json("failover-log", "1", port=srv.port)
        assert doc["vbucket"] == 1
        entries = doc["entries"]
        assert [(e["index"], e["seqno"]) for e in entries] == [(0, 3), (1, 0)]
        assert entries[0]["vb_uuid"] != entries[1]["vb_uuid"]
        rows = table_rows(ok("failover-log", "1", port=srv.port))
        assert rows == [
            ["0", str(entries[0]["vb_uuid"]), "3"],
            ["1", str(entries[1]["vb_uuid"]), "0"],
        ]
        # the persisted log says the same, read offline while the server runs
        assert ok_json("inspect", srv.data_dir, "failover-log", "1")["entries"] == entries
        assert "vbucket 8 does not exist" in fails("failover-log", "8", port=srv.port)
    finally:
        srv.kill()


def _open_slow_stream(port: int, vb: int, name: str) -> Wire:
    """A DCP connection with a 2 KB flow-control window that never acks."""
    w = Wire(port)
    assert w.request(lambda o: codec.dcp_open(name, 1, o)).status == Status.SUCCESS
    assert (
        w.request(lambda o: codec.dcp_control("connection_buffer_size", "2048", o)).status
        == Status.SUCCESS
    )
    assert w.request(lambda o: codec.dcp_control("enable_noop", "true", o)).status == Status.SUCCESS
    r = w.request(
        lambda o: codec.stream_request(
            vb, o, start=0, end=2**64 - 1, vb_uuid=0, snap_start=0, snap_end=0
        )
    )
    assert r.status == Status.SUCCESS, r
    return w


def test_checkpoints_show_ranges_cursors_with_lag_and_the_dropped_cursor(tmp_path: Path) -> None:
    srv = ServerProcess(
        tmp_path / "data", "--checkpoint-memory-quota", "100000", "--checkpoint-max-items", "20"
    ).start()
    slow = _open_slow_stream(srv.port, 3, "slow-reader")
    try:
        keys = keys_for_vb(3, 700)
        write(srv.port, [(k, b"x" * 5000) for k in keys])
        deadline = time.monotonic() + 10
        while True:
            doc = ok_json("checkpoints", "3", port=srv.port)
            if doc["dropped_cursors"] and doc["persisted_seqno"] == 700:
                break
            assert time.monotonic() < deadline, doc
            time.sleep(0.05)
        assert doc["vbucket"] == 3 and doc["high_seqno"] == 700
        ckpts = doc["checkpoints"]
        assert ckpts and ckpts[-1]["state"] == "open"
        assert all(c["last_seqno"] >= c["start_seqno"] - 1 for c in ckpts)
        assert sum(c["mem_usage"] for c in ckpts) == doc["mem_usage"]
        cursors = {c["name"]: c for c in doc["cursors"]}
        assert cursors["persistence"]["lag"] == 0
        assert cursors["persistence"]["last_seqno"] == 700
        (dropped,) = doc["dropped_cursors"]
        assert dropped["stream"].startswith("slow-reader:3:") and dropped["dropped_now"]
        assert dropped["lag"] > 600 and dropped["state"] == "in-memory"
        assert dropped["stream"] not in cursors  # the engine let go of it

        text = ok("checkpoints", "3", port=srv.port)
        assert "vb 3: high seqno 700, persisted 700" in text
        assert [
            "persistence",
            str(cursors["persistence"]["checkpoint_id"]),
            str(cursors["persistence"]["offset"]),
            "700",
            "0",
        ] in table_rows(text)
        assert "dropped cursors (streams that fell back to disk)" in text
        assert any(r[0] == dropped["stream"] and r[2] == "yes" for r in table_rows(text))
        # the same stream from the streams view: its window is full
        (st,) = ok_json("streams", "--vb", "3", port=srv.port)["streams"]
        assert st["connection"] == "slow-reader" and st["cursor_dropped"] is True
        assert st["unacked_bytes"] >= 2048 and st["window"] == 2048
        assert ok_json("stats", port=srv.port)["stats"]["ep_cursors_dropped"] == "1"
    finally:
        slow.close()
        srv.kill()


def test_connections_and_streams_show_phase_lag_flow_control_and_noops(server) -> None:
    p = server.port
    write(p, [(k, b"v" * 100) for k in keys_for_vb(6, 50)])
    slow = _open_slow_stream(p, 6, "watcher")
    try:
        deadline = time.monotonic() + 5
        while True:
            (conn,) = ok_json("connections", port=p)["connections"]
            if conn["unacked_bytes"] >= 2048:
                break
            assert time.monotonic() < deadline, conn
            time.sleep(0.05)
        assert conn["name"] == "watcher" and conn["streams"] == 1
        assert conn["stream_list"] == [6] and conn["window"] == 2048
        assert conn["noop_enabled"] is True and conn["flow_control"] == "full"
        (st,) = ok_json("streams", port=p)["streams"]
        assert (st["vbucket"], st["state"], st["high_seqno"]) == (6, "in-memory", 50)
        assert 0 < st["last_sent_seqno"] < 50 and st["lag"] == 50 - st["last_sent_seqno"]
        assert st["unacked_bytes"] >= 2048 and st["noop_enabled"] is True

        rows = table_rows(ok("connections", port=p))
        assert rows[0][1] == "watcher" and rows[0][5].endswith("/2048")
        assert rows[0][6] == "full" and rows[0][7].startswith("every")
        (row,) = table_rows(ok("streams", port=p))
        assert row[:3] == ["watcher", "6", "in-memory"] and row[3] == "0..∞"
        assert row[4] == str(st["last_sent_seqno"]) and row[6] == str(st["lag"])
        assert ok_json("streams", "--vb", "1", port=p)["streams"] == []
        assert ok_json("connections", "--name", "nobody", port=p)["connections"] == []
    finally:
        slow.close()


def test_stats_prints_a_raw_group_and_refuses_unknown_groups(server) -> None:
    p = server.port
    write(p, [(k, b"v") for k in keys_for_vb(3, 2)])
    doc = ok_json("stats", "vbucket-seqno", "3", port=p)
    assert doc["group"] == "vbucket-seqno 3"
    assert doc["stats"]["vb_3:high_seqno"] == "2"
    rows = table_rows(ok("stats", "vbucket-seqno 3", port=p))
    assert ["vb_3:high_seqno", "2"] in rows
    assert ["ep_num_vbuckets", "8"] in table_rows(ok("stats", port=p))
    line = fails("stats", "no-such-group", port=p)
    assert "unknown stat group" in line and "KEY_ENOENT" in line
    assert "does not exist" in fails("stats", "checkpoint", "99", port=p)


def test_get_set_delete_route_keys_with_the_discovered_vbucket_count(server) -> None:
    p = server.port
    doc = ok_json("set", "user:1", "hello world", "--flags", "7", port=p)
    assert doc["key"] == "user:1" and doc["seqno"] == 1 and doc["cas"] > 0
    assert doc["vbucket"] == codec.vbucket_for_key(b"user:1", 8)
    got = ok_json("get", "user:1", port=p)
    assert (got["value"], got["flags"], got["vbucket"]) == ("hello world", 7, doc["vbucket"])
    assert ["value", "hello world"] in table_rows(ok("get", "user:1", port=p))
    rows = table_rows(ok("set", "user:1", "again", port=p))
    assert ["seqno", "2"] in rows
    assert ok_json("delete", "user:1", port=p)["seqno"] == 3
    assert fails("get", "user:1", port=p) == "dcpctl: key 'user:1' not found"
    assert fails("delete", "user:1", port=p) == "dcpctl: key 'user:1' not found"


def test_an_unreachable_server_is_one_line_and_exit_1(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "data").start()
    port = srv.port
    srv.kill()
    for cmd in (
        ["vbuckets"],
        ["checkpoints", "0"],
        ["streams"],
        ["tail", "--to-latest"],
        ["set", "k", "v"],
    ):
        line = fails(*cmd, port=port, timeout=20)
        assert f"cannot connect to 127.0.0.1:{port}: connection refused" in line, line


def test_a_silent_or_foreign_peer_is_one_line_and_exit_1() -> None:
    with socket.socket() as silent:  # listens (the kernel accepts) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        line = fails("vbuckets", "--timeout", "0.3", port=silent.getsockname()[1])
        assert line.endswith("did not answer within 0.3 s"), line

    with socket.socket() as http:  # answers like a web server
        http.bind(("127.0.0.1", 0))
        http.listen()

        def answer() -> None:
            conn, _ = http.accept()
            with conn:
                conn.recv(100)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b"x" * 40)

        t = threading.Thread(target=answer, daemon=True)
        t.start()
        line = fails("stats", port=http.getsockname()[1])
        t.join(5)
        assert "does not speak the memcached binary protocol" in line, line


def test_metrics_command_shows_the_prometheus_endpoint(tmp_path: Path) -> None:
    mport = free_port()
    srv = ServerProcess(tmp_path / "data", "--metrics-port", str(mport)).start()
    try:
        write(srv.port, [(k, b"v") for k in keys_for_vb(0, 3)])
        samples = ok_json("metrics", "--metrics-port", mport)["metrics"]
        assert {"name": "dcp_ops_total", "labels": {"op": "set"}, "value": 3} in samples
        assert {"name": "dcp_items_queued_total", "labels": {}, "value": 3} in samples
        rows = table_rows(ok("metrics", "--grep", "ops", env={"DCP_METRICS_PORT": str(mport)}))
        assert rows == [["dcp_ops_total", "op=set", "3"]]
        assert "# TYPE dcp_ops_total counter" in ok("metrics", "--metrics-port", mport, "--raw")
        r = ctl("metrics")
        assert r.returncode == 2 and r.stderr.startswith("dcpctl: give --metrics-port")
        assert "answered" in fails("metrics", "--metrics-port", srv.port)  # not HTTP
    finally:
        srv.kill()
