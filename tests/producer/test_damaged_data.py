"""``dcp-server`` over damaged data files, as an operator meets them: a truncated, emptied
or deleted data file refuses the start with one line and exit code 3 (instead of a SIGBUS
or a silently empty store); a flipped byte inside a stored value is never served; a
graceful stop on a full disk exits 4 instead of 0 and does not grow the map.
(docs/operations.md, "Damaged data files and exit codes".)"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dcp.producer.engine import Bucket, EngineConfig
from dcp.producer.engine.datafiles import MARKER
from dcp.protocol import FrameReader, Opcode, Status, StreamEndStatus, codec

ROOT = Path(__file__).resolve().parents[2]
SERVER = [sys.executable, "-m", "dcp.producer"]
ENOSPC_SERVER = [sys.executable, str(Path(__file__).with_name("enospc_server.py"))]
NV = 4


def _key(vb: int, name: str) -> bytes:
    for i in range(10_000):
        k = f"{name}-{i}".encode()
        if codec.vbucket_for_key(k, NV) == vb:
            return k
    raise AssertionError("unreachable")


def _prepare(data: Path, n: int = 200) -> dict[bytes, bytes]:
    """A cleanly closed store of ``n`` keys (~2 KB each), written by the engine."""
    b = Bucket.open(
        data,
        EngineConfig(num_vbuckets=NV, map_size=64 << 20),
        clock=lambda: 1_700_000_000.0,
        uuid_source=lambda: 0xABC,
    )
    docs = {}
    for i in range(n):
        k = b"key-%d" % i
        docs[k] = b"%d:" % i + b"v" * 2000
        b.set(codec.vbucket_for_key(k, NV), k, docs[k])
    b.flusher.flush_all()
    b.close()
    return docs


def _refused(data: Path, *extra: str, code: int = 3, cwd: Path | None = None) -> str:
    """Run the server, which must refuse to start: exit ``code``; on stderr the log line
    naming the absolute data directory, then one line saying why (no traceback)."""
    r = subprocess.run(
        [*SERVER, "--port", "0", "--data-dir", str(data), "--num-vbuckets", str(NV), *extra],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    absolute = ((cwd or Path.cwd()) / data).resolve()
    assert lines[0].endswith(f" INFO dcp.server opening data_dir={absolute}"), r.stderr
    assert len(lines) == 2, r.stderr
    return lines[1]


class Proc:
    """A server process whose stderr goes to a file (a pipe could fill up)."""

    def __init__(self, argv: list[str], data: Path, *extra: str) -> None:
        self.log = data.parent / "server.log"
        with open(self.log, "wb") as log:
            self.p = subprocess.Popen(
                [*argv, "--port", "0", "--data-dir", str(data), "--num-vbuckets", str(NV), *extra],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        deadline = time.monotonic() + 30
        while not (m := re.search(r"listening host=\S+ port=(\d+)", self.text())):
            assert self.p.poll() is None, f"exited {self.p.returncode}:\n{self.text()}"
            if time.monotonic() >= deadline:
                self.kill()  # no server left behind by a failed start
                raise AssertionError(f"dcp-server did not report its port:\n{self.text()}")
            time.sleep(0.02)
        self.port = int(m.group(1))

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text()):
            assert time.monotonic() < deadline, f"no {pattern!r} in:\n{self.text()}"
            time.sleep(0.02)

    def stop(self) -> int:
        """SIGTERM (graceful stop); the exit code."""
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
        try:
            return self.p.wait(60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            raise

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


class Client:
    """A blocking raw client: requests, and the frames the server sends."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.reader = FrameReader()
        self.frames: list = []

    def next(self):  # type: ignore[no-untyped-def]
        while not self.frames:
            data = self.sock.recv(1 << 16)
            assert data, "server closed the connection"
            self.reader.feed(data)
            self.frames.extend(self.reader.read_frames())
        return self.frames.pop(0)

    def call(self, frame: bytes):  # type: ignore[no-untyped-def]
        self.sock.sendall(frame)
        return self.next()

    def get(self, key: bytes):  # type: ignore[no-untyped-def]
        return self.call(
            codec.request(Opcode.GET, vbucket=codec.vbucket_for_key(key, NV), opaque=1, key=key)
        )

    def set(self, key: bytes, value: bytes):  # type: ignore[no-untyped-def]
        return self.call(
            codec.request(
                Opcode.SET,
                vbucket=codec.vbucket_for_key(key, NV),
                opaque=2,
                extras=codec.store_extras(),
                key=key,
                value=value,
            )
        )

    def stream(self, vb: int, end: int) -> tuple[list[bytes], int]:
        """Stream ``vb`` from 0 to ``end``: (values received, stream-end status)."""
        r = self.call(
            codec.stream_request(vb, 7, start=0, end=end, vb_uuid=0, snap_start=0, snap_end=0)
        )
        assert r.status == Status.SUCCESS, r
        values = []
        while True:
            f = self.next()
            if f.opcode == Opcode.DCP_MUTATION:
                values.append(bytes(f.value))
            elif f.opcode == Opcode.DCP_STREAM_END:
                return values, codec.parse_stream_end(f)

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize(
    "damage, says",
    [
        (
            lambda f: os.truncate(f, f.stat().st_size // 2),
            r"data\.mdb is truncated: \d+ bytes, "
            r"but its LMDB meta page \(transaction \d+\) says \d+ bytes are in use",
        ),
        (
            lambda f: os.truncate(f, 0),
            r"data\.mdb is empty \(0 bytes\), but .*dcp-store\.json "
            "says this directory holds a bucket",
        ),
        (
            lambda f: f.unlink(),
            r"data\.mdb is missing, but .*dcp-store\.json says this "
            "directory holds a bucket",
        ),
    ],
    ids=["truncated", "emptied", "deleted"],
)
def test_a_damaged_data_file_refuses_the_start_with_one_line_and_exit_3(
    tmp_path: Path, damage, says: str
) -> None:
    data = tmp_path / "data"
    _prepare(data)
    damage(data / "data.mdb")
    before = sorted((p.name, p.stat().st_size) for p in data.iterdir())
    line = _refused(data)
    assert line.startswith("dcp-server: refusing to start: "), line
    assert re.search(says, line), line
    assert str(data.resolve() / "data.mdb") in line and "--reset-data" in line
    assert sorted((p.name, p.stat().st_size) for p in data.iterdir()) == before  # untouched


def test_a_failed_open_names_the_absolute_data_dir_in_the_log_and_the_error_line(
    tmp_path: Path,
) -> None:
    """A relative ``--data-dir`` that cannot be opened: the log names the resolved
    directory before opening, and so does the error line (the operator may not know the
    server's working directory)."""
    (tmp_path / "blocker").write_text("a file where a directory should be")
    line = _refused(Path("blocker/data"), code=1, cwd=tmp_path)
    assert line.startswith(f"dcp-server: {tmp_path.resolve() / 'blocker' / 'data'}: "), line
    assert "Not a directory" in line, line


def test_reset_data_sets_a_damaged_file_aside_and_starts_empty_but_never_touches_intact_data(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    docs = _prepare(data)
    key = next(iter(docs))
    srv = Proc(SERVER, data, "--reset-data")  # intact: --reset-data changes nothing
    try:
        c = Client(srv.port)
        assert bytes(c.get(key).value) == docs[key]
        c.close()
    finally:
        assert srv.stop() == 0
    assert "passes its checks; nothing was reset" in srv.text()

    os.truncate(data / "data.mdb", 0)
    _refused(data)
    srv = Proc(SERVER, data, "--reset-data")
    try:
        c = Client(srv.port)
        assert c.get(key).status == Status.KEY_ENOENT  # an empty store, as asked
        assert c.set(key, b"new").status == Status.SUCCESS
        c.close()
    finally:
        assert srv.stop() == 0
    assert (data / "data.mdb.damaged").exists() and (data / MARKER).exists()
    assert "--reset-data: moved" in srv.text()
    srv = Proc(SERVER, data)  # and from now on an ordinary store
    try:
        c = Client(srv.port)
        assert bytes(c.get(key).value) == b"new"
        c.close()
    finally:
        assert srv.stop() == 0


def test_a_flipped_value_byte_is_never_served_and_the_server_serves_the_rest(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    b = Bucket.open(
        data,
        EngineConfig(num_vbuckets=NV, map_size=64 << 20),
        clock=lambda: 1_700_000_000.0,
        uuid_source=lambda: 0xABC,
    )
    good, bad, other = _key(1, "good"), _key(1, "bad"), _key(2, "other")
    b.set(1, good, b"g" * 300)
    b.set(1, bad, b"FLIPME" + b"v" * 300)
    b.set(2, other, b"o" * 300)
    b.flusher.flush_all()
    b.close()
    buf = bytearray((data / "data.mdb").read_bytes())
    at = buf.find(b"FLIPME")
    assert at > 0 and buf.find(b"FLIPME", at + 1) < 0
    buf[at + 100] ^= 0x04  # "v" -> "r"
    (data / "data.mdb").write_bytes(bytes(buf))

    srv = Proc(SERVER, data)
    try:
        c = Client(srv.port)
        r = c.get(bad)
        assert r.status == Status.EINTERNAL and b"FLIPME" not in bytes(r.value)
        srv.wait_for(
            rf"ERROR dcp\.storage checksum mismatch in the stored record of vb 1 "
            rf"seqno 2 key {re.escape(repr(bad))}"
        )
        assert bytes(c.get(good).value) == b"g" * 300
        assert c.call(codec.dcp_open("damaged", 1, 3)).status == Status.SUCCESS
        values, end = c.stream(1, 2)  # a backfill over the damaged record
        assert end == StreamEndStatus.BACKFILL_FAIL
        assert not any(b"FLIPME" in v for v in values)
        srv.wait_for(r"backfill failed name=damaged\S* vb=1: .*checksum mismatch")
        assert c.stream(2, 1) == ([b"o" * 300], StreamEndStatus.OK)  # others stream on
        assert bytes(c.get(other).value) == b"o" * 300
        c.close()
    finally:
        assert srv.stop() == 0


def test_sigterm_on_a_full_disk_exits_4_and_does_not_grow_the_map(tmp_path: Path) -> None:
    """Before: the final flush took ENOSPC for a full map, grew the map toward 2 TiB, and
    the process exited 0 although an acknowledged write was never persisted."""
    data = tmp_path / "data"
    trigger = tmp_path / "disk-full"
    srv = Proc([*ENOSPC_SERVER, str(trigger)], data)
    try:
        c = Client(srv.port)
        assert c.set(b"before", b"1").status == Status.SUCCESS
        trigger.touch()
        assert c.set(b"acked", b"2").status == Status.SUCCESS  # acknowledged in memory
        srv.wait_for(r"flusher error: .*disk full")
        c.close()
        code = srv.stop()
    finally:
        srv.kill()
    text = srv.text()
    assert code == 4, text
    assert "final flush failed" in text and "grow_map" not in text, text
    assert "growing" not in text
    assert text.strip().splitlines()[-1] == (
        "dcp-server: stopped without persisting every acknowledged write (see the log above)"
    )


def test_a_file_truncated_under_the_running_server_dies_with_a_traceback_not_silently(
    tmp_path: Path,
) -> None:
    """No check can stop a mapped file from shrinking; the fault handler at least says
    what happened, and the next start refuses the file."""
    data = tmp_path / "data"
    docs = _prepare(data, 400)
    srv = Proc(SERVER, data)
    try:
        os.truncate(data / "data.mdb", 8192)  # only the two meta pages are left
        c = Client(srv.port)
        c.sock.sendall(
            b"".join(
                codec.request(Opcode.GET, vbucket=codec.vbucket_for_key(k, NV), opaque=1, key=k)
                for k in docs
            )
        )
        assert srv.p.wait(30) == -signal.SIGBUS
        c.close()
    finally:
        srv.kill()
    assert "Fatal Python error: Bus error" in srv.text()
    assert "is truncated" in _refused(data)
