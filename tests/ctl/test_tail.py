"""dcpctl tail: snapshot markers and changes as they stream, in lines or JSON Lines."""

from __future__ import annotations

import json
import signal
import subprocess
import time

from .support import DCPCTL, fails, keys_for_vb, ok, write


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def test_tail_to_latest_replays_a_vbucket_from_the_beginning(server) -> None:
    p = server.port
    a, b, c = keys_for_vb(4, 3)
    write(p, [(a, b"alpha"), (b, b"\xff\x00binary"), (c, b"x" * 200)], deletes=[b])
    events = _json_lines(
        ok("tail", "--vb", "4", "--from", "beginning", "--to-latest", "--json", port=p)
    )
    kinds = [e["type"] for e in events]
    assert kinds[0] == "snapshot" and kinds[-1] == "stream_end"
    changes = [e for e in events if e["type"] in ("mutation", "deletion")]
    # b was deleted in the open checkpoint: its mutation is deduplicated away
    assert [(e["type"], e["seqno"], e["key"]) for e in changes] == [
        ("mutation", 1, a.decode()),
        ("mutation", 3, c.decode()),
        ("deletion", 4, b.decode()),
    ]
    assert changes[0]["value"] == "alpha" and changes[1]["value"] == "x" * 200
    snap = events[0]
    assert (snap["vbucket"], snap["end"]) == (4, 4)
    assert {"memory", "disk"} & set(snap["flags"])  # memory, or disk once persisted
    assert events[-1] == {"type": "stream_end", "vbucket": 4, "reason": "ok"}

    lines = ok(
        "tail", "--vb", "4", "--from", "beginning", "--to-latest", "--value-width", "10", port=p
    ).splitlines()
    assert lines[0].startswith("vb 4") and "snapshot 1..4" in lines[0]
    assert any("#1" in ln and "mutation" in ln and f"{a.decode()} = alpha" in ln for ln in lines)
    assert any(f"{c.decode()} = xxxxxxxxx…" in ln for ln in lines)
    assert any("deletion" in ln and b.decode() in ln for ln in lines)
    assert "stream end (ok)" in lines[-2]
    assert lines[-1] == "-- 2 mutations, 1 deletions, 0 expirations in 1 snapshots from 1 vbuckets"


def test_tail_over_every_vbucket_stops_when_caught_up(server) -> None:
    p = server.port
    keys = [k for vb in range(8) for k in keys_for_vb(vb, 30, prefix=f"t{vb}")]
    write(p, [(k, b"v") for k in keys])
    events = _json_lines(ok("tail", "--from", "beginning", "--to-latest", "--json", port=p))
    seen = {e["key"] for e in events if e["type"] == "mutation"}
    assert seen == {k.decode() for k in keys}
    assert sorted(e["vbucket"] for e in events if e["type"] == "stream_end") == list(range(8))
    # from now: already at the end, nothing to show but the ends of the streams
    caught_up = _json_lines(ok("tail", "--to-latest", "--json", port=p))
    assert sorted(e["vbucket"] for e in caught_up) == list(range(8))
    assert all(e["type"] == "stream_end" for e in caught_up)


def test_tail_follows_new_changes_live_until_the_limit(server) -> None:
    p = server.port
    write(p, [(k, b"old") for k in keys_for_vb(1, 2, prefix="old")])
    proc = subprocess.Popen(
        [*DCPCTL, "--port", str(p), "tail", "--vb", "1", "--limit", "2", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 10
        k1, k2 = keys_for_vb(1, 2, prefix="new")
        # wait until the tail's stream is open, then write
        while "dcpctl-tail" not in ok("connections", port=p):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        write(p, [(k1, b"one"), (k2, b"two")])
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    changes = [e for e in _json_lines(out) if e["type"] == "mutation"]
    assert [(e["key"], e["value"], e["seqno"]) for e in changes] == [
        (k1.decode(), "one", 3),
        (k2.decode(), "two", 4),
    ]


def test_ctrl_c_stops_tail_quietly_with_status_130(server) -> None:
    proc = subprocess.Popen(
        [*DCPCTL, "--port", str(server.port), "tail"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 10
    while "dcpctl-tail" not in ok("connections", port=server.port):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=10)
    assert proc.returncode == 130
    assert err.strip() == "dcpctl: interrupted"


def test_tail_refuses_unknown_vbuckets(server) -> None:
    line = fails("tail", "--vb", "3,12", "--to-latest", port=server.port)
    assert "vbucket 12 does not exist (the server has 0..7)" in line
