"""dcpctl inspect: a data directory read offline (and while its server runs), the
consistency check, and what happens with directories that are not ours."""

from __future__ import annotations

import base64
import json
import os
import pty
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest

from dcp.producer.engine.records import (
    CRC_SIZE,
    FORMAT_VERSION,
    ITEM_KEY,
    ITEM_RECORD,
    VB_KEY,
    VBStateRecord,
    add_checksum,
)

from .support import (
    DCPCTL,
    ServerProcess,
    ctl,
    fails,
    keys_for_vb,
    ok,
    ok_json,
    table_rows,
    wait_persisted,
    write,
)

#: The counts these tests check describe a store without a change history (the server's
#: default keeps one): there, a rewritten or deleted key's older version leaves the disk.
NO_HISTORY = ("--history-seconds", "0", "--history-bytes", "0")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path / "data", *NO_HISTORY).start()
    try:
        yield srv
    finally:
        srv.kill()


def _populate(srv: ServerProcess) -> dict[str, list[bytes]]:
    """vb 2: 3 live keys; vb 5: 2 keys, one deleted, one binary value."""
    k2 = keys_for_vb(2, 3)
    k5 = keys_for_vb(5, 2)
    write(srv.port, [(k, b"value-" + k) for k in k2] + [(k5[0], b"\x00\xffbin"), (k5[1], b"x")])
    wait_persisted(srv.port)
    write(srv.port, [], deletes=[k5[1]])
    wait_persisted(srv.port)
    return {"vb2": k2, "vb5": k5}


def test_inspect_reads_states_and_counts_while_the_server_runs(server) -> None:
    _populate(server)
    doc = ok_json("inspect", server.data_dir)
    env = doc["data_dir"]
    assert (env["format"], env["num_vbuckets"], env["clean_shutdown"]) == (FORMAT_VERSION, 8, False)
    rows = {r["vbucket"]: r for r in doc["vbuckets"]}
    assert sorted(rows) == list(range(8))
    live = ok_json("vbuckets", port=server.port)["vbuckets"]
    for v in live:  # what is persisted matches what the server says it persisted
        r = rows[v["vbucket"]]
        assert (r["state"], r["vb_uuid"], r["high_seqno"]) == (
            v["state"],
            v["vb_uuid"],
            v["persisted_seqno"],
        )
    assert (rows[2]["records"], rows[2]["live_items"], rows[2]["tombstones"]) == (3, 3, 0)
    assert (rows[5]["records"], rows[5]["live_items"], rows[5]["tombstones"]) == (2, 1, 1)
    assert (rows[5]["min_seqno"], rows[5]["max_seqno"], rows[5]["high_seqno"]) == (1, 3, 3)
    assert doc["totals"]["records"] == 5 and doc["totals"]["live_items"] == 4

    text = ok("inspect", server.data_dir, "vbuckets", "--vb", "2,5")
    assert f"format {FORMAT_VERSION}, 8 vbuckets" in text and "clean shutdown marker: no" in text
    body = table_rows(text)
    assert [r[0] for r in body] == ["2", "5", "total"]
    assert body[1][3:5] == ["3", "3..3"] and body[1][7:] == ["2", "1", "1", "0", "1..3"]
    assert body[-1][7:11] == ["5", "4", "1", "0"]
    assert [
        r["vbucket"]
        for r in ok_json("inspect", server.data_dir, "vbuckets", "--active")["vbuckets"]
    ] == list(range(8))


def test_check_passes_on_a_store_being_written_to(server) -> None:
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.wait(0.01):
            write(server.port, [(f"busy-{i}-{j}".encode(), b"v" * 300) for j in range(100)])
            i += 1

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        for _ in range(2):  # each read transaction is a consistent snapshot
            report = ok_json("inspect", server.data_dir, "check")
            assert report["ok"] and report["problems"] == []
    finally:
        stop.set()
        t.join(10)
    assert report["vbuckets_checked"] == 8 and report["records_checked"] > 0


def test_dump_shows_a_seqno_range_as_table_and_json_lines(server) -> None:
    keys = _populate(server)
    d = server.data_dir
    items = [json.loads(line) for line in ok("inspect", d, "dump", "5", "--json").splitlines()]
    assert [(i["seqno"], i["op"], i["key"]) for i in items] == [
        (1, "mutation", keys["vb5"][0].decode()),
        (3, "deletion", keys["vb5"][1].decode()),
    ]
    assert items[0]["value_encoding"] == "base64"
    assert base64.b64decode(items[0]["value"]) == b"\x00\xffbin"
    assert items[1]["delete_time"] > 0 and "value" not in items[1]

    ranged = [
        json.loads(x)
        for x in ok("inspect", d, "dump", "2", "--from", "2", "--to", "3", "--json").splitlines()
    ]
    assert [i["seqno"] for i in ranged] == [2, 3]
    assert ranged[0]["value"] == "value-" + keys["vb2"][1].decode()
    limited = ok("inspect", d, "dump", "2", "--limit", "1", "--value-width", "4")
    assert "vb 2: stored seqnos 1..3" in limited and "1 items" in limited
    (row,) = table_rows(limited)
    assert row[:3] == ["1", "mutation", keys["vb2"][0].decode()] and row[-1] == "val…"
    assert "vbucket 8 does not exist" in fails("inspect", d, "dump", "8")


def test_history_lists_superseded_versions_kept_by_the_window(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "data", "--history-seconds", "3600").start()
    try:
        (key,) = keys_for_vb(6, 1)
        for v in (b"v1", b"v2", b"v3"):  # each version persisted before the next one
            write(srv.port, [(key, v)])
            wait_persisted(srv.port)
        doc = ok_json("inspect", srv.data_dir, "history", "6")
        assert doc["high_seqno"] == 3
        assert [
            (h["seqno"], h["superseded_by"], h["newest_seqno"], h["rev_seqno"])
            for h in doc["superseded_versions"]
        ] == [(1, 2, 3, 1), (2, 3, 3, 2)]
        text = ok("inspect", srv.data_dir, "history", "6")
        assert "2 superseded versions kept" in text
        assert ["1", key.decode(), "mutation", "1", "2", "3"] in table_rows(text)
        report = ok_json("inspect", srv.data_dir, "check")
        assert (
            report["ok"] and "vb 6: 2 superseded versions kept (history window)" in report["notes"]
        )
        assert ok_json("inspect", srv.data_dir, "history", "1")["superseded_versions"] == []
    finally:
        srv.kill()


def _damage(data: Path) -> None:
    """vb 2: persisted high seqno below its records; vb 5: a record with the wrong seqno;
    vb 7: a truncated record."""
    env = lmdb.open(str(data), max_dbs=16)
    try:
        states = env.open_db(b"vbstate")
        seq5 = env.open_db(b"seq:0005")
        seq7 = env.open_db(b"seq:0007")
        with env.begin(write=True) as txn:
            rec = VBStateRecord.decode(txn.get(VB_KEY.pack(2), db=states))
            rec.high_seqno = rec.snap_start = rec.snap_end = 1
            txn.put(VB_KEY.pack(2), rec.encode(), db=states)
            raw = bytearray(txn.get(ITEM_KEY.pack(5, 1), db=seq5))
            fields = list(ITEM_RECORD.unpack_from(raw))
            fields[5] = 42  # the record's own seqno
            ITEM_RECORD.pack_into(raw, 0, *fields)
            # a consistent record (its checksum matches) that breaks an invariant
            txn.put(ITEM_KEY.pack(5, 1), add_checksum(bytes(raw[:-CRC_SIZE])), db=seq5)
            txn.put(ITEM_KEY.pack(7, 1), b"short", db=seq7)
    finally:
        env.close()


def test_check_reports_what_is_wrong_and_exits_1(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "data", *NO_HISTORY).start()
    _populate(srv)
    srv.stop()  # clean stop: flushed, marker written
    clean = ok_json("inspect", srv.data_dir, "check")
    assert clean["ok"] and clean["notes"] == [] and clean["records_checked"] == 5
    assert ok("inspect", srv.data_dir, "check").strip() == "OK: 8 vbuckets, 5 records, no problems"

    broken = tmp_path / "broken"
    shutil.copytree(srv.data_dir, broken)
    _damage(broken)
    line = fails("inspect", broken, "check")
    assert line == (
        "dcpctl: check failed: 3 problems (first: vb 2: records up to seqno 3 on "
        "disk, but the persisted high seqno is 1)"
    )
    r = ctl("inspect", broken, "check")
    assert table_rows(r.stdout)[1:] == [
        ["5", "record keyed at seqno 1 says it is seqno 42"],
        ["7", "record at seqno 1 has 5 bytes, shorter than the 47-byte head"],
    ]
    assert fails("inspect", broken, "dump", "7") == (
        "dcpctl: vbucket 7: record at seqno 1 has 5 bytes, shorter than the 47-byte head"
    )
    r = ctl("inspect", broken, "check", "--vb", "5", "--json")
    assert r.returncode == 1
    report = json.loads(r.stdout)
    assert not report["ok"] and report["problems"] == [
        {"vbucket": 5, "problem": "record keyed at seqno 1 says it is seqno 42"}
    ]


def test_directories_that_are_not_ours_are_one_line_errors(tmp_path: Path) -> None:
    assert fails("inspect", tmp_path / "nope").endswith("no such directory")
    r = subprocess.run(
        [sys.executable, "-m", "dcp.ctl", "inspect", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert (r.returncode, r.stderr) == (1, f"dcpctl: {tmp_path / 'nope'}: no such directory\n")
    (tmp_path / "file").write_text("x")
    assert "not a directory" in fails("inspect", tmp_path / "file")
    (tmp_path / "empty").mkdir()
    assert "no data.mdb here" in fails("inspect", tmp_path / "empty", "check")

    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "data.mdb").write_bytes(os.urandom(65536))
    assert fails("inspect", garbage).endswith("cannot open as LMDB: File is not an LMDB file")
    assert sorted(p.name for p in garbage.iterdir()) == ["data.mdb"]  # nothing created

    foreign = tmp_path / "foreign"
    env = lmdb.open(str(foreign), max_dbs=2)
    env.open_db(b"other")
    env.close()
    assert "not a dcp data directory" in fails("inspect", foreign, "dump", "0")


def test_a_newer_format_is_refused(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "data").start()
    srv.stop()
    env = lmdb.open(str(srv.data_dir), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(b"format", b"99", db=env.open_db(b"meta", txn=txn))
    env.close()
    assert f"format b'99'; this dcpctl reads format {FORMAT_VERSION}" in fails(
        "inspect", srv.data_dir
    )
    env = lmdb.open(str(srv.data_dir), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(b"format", b"1", db=env.open_db(b"meta", txn=txn))
    env.close()
    assert "(records without checksums); start the server on it once" in fails(
        "inspect", srv.data_dir
    )


def test_progress_bar_only_on_a_terminal(server) -> None:
    write(server.port, [(k, b"v" * 50) for k in keys_for_vb(0, 300)])
    wait_persisted(server.port)
    piped = ok("inspect", server.data_dir, "dump", "0")
    assert "\x1b[" not in piped  # no bar, no colours
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [*DCPCTL, "inspect", str(server.data_dir), "dump", "0"],
        stdout=follower,
        stderr=subprocess.PIPE,
        env={**os.environ, "COLUMNS": "120", "TERM": "xterm"},
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    assert proc.wait(10) == 0
    shown = b"".join(chunks).decode("utf-8", "replace")
    # the bar: the cursor is hidden while it is drawn, then shown again
    assert "\x1b[?25l" in shown and "\x1b[?25h" in shown, repr(shown[:500])
    assert "300 items" in shown


def _flip_on_disk(data_file: Path, marker: bytes, offset: int) -> int:
    """Flip one bit ``offset`` bytes after every occurrence of ``marker`` in the file (a
    bad sector under a stored value; old page copies LMDB keeps get flipped too)."""
    buf = bytearray(data_file.read_bytes())
    hits = 0
    at = buf.find(marker)
    while at >= 0:
        buf[at + offset] ^= 0x01
        hits += 1
        at = buf.find(marker, at + 1)
    data_file.write_bytes(bytes(buf))
    return hits


def test_check_finds_a_flipped_value_byte_naming_vbucket_key_and_seqno(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "data").start()
    (key,) = keys_for_vb(3, 1)
    write(srv.port, [(k, b"fine") for k in keys_for_vb(4, 2)] + [(key, b"FLIPME" + b"x" * 200)])
    wait_persisted(srv.port)
    srv.stop()
    assert _flip_on_disk(srv.data_dir / "data.mdb", b"FLIPME", 50) >= 1
    line = fails("inspect", srv.data_dir, "check")
    assert line == (
        f"dcpctl: check failed: 1 problems (first: vb 3: record at seqno 1 (key "
        f"{key!r}) fails its checksum: its bytes changed on disk after they were "
        "written)"
    )
    report = json.loads(ctl("inspect", srv.data_dir, "check", "--json").stdout)
    assert [p["vbucket"] for p in report["problems"]] == [3]
    assert ok_json("inspect", srv.data_dir, "check", "--vb", "4")["ok"]  # the rest is fine


def test_a_truncated_data_file_is_a_one_line_error_not_a_crash(tmp_path: Path) -> None:
    """Mapping a data.mdb shorter than LMDB's meta page says, then reading it, is a
    SIGBUS; dcpctl checks the size first."""
    srv = ServerProcess(tmp_path / "data").start()
    write(srv.port, [(b"k%d" % i, b"v" * 2000) for i in range(300)])
    wait_persisted(srv.port)
    srv.stop()
    data = srv.data_dir / "data.mdb"
    size = data.stat().st_size
    os.truncate(data, size // 2)
    line = fails("inspect", srv.data_dir, "check")
    assert line.startswith(
        f"dcpctl: {srv.data_dir}: data.mdb is truncated: {size // 2} "
        "bytes, but its LMDB meta page says "
    )
