"""Helpers for the hardening tests: a client that never reads, RSS of a process, raw
frame builders (``dcp.protocol`` only, as ``wire.py``)."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio

from dcp.protocol import Opcode, codec

_BIN = Path(sys.executable).parent
SERVER = (
    [str(_BIN / "dcp-server")]
    if (_BIN / "dcp-server").exists()
    else [sys.executable, "-m", "dcp.producer"]
)


class ServerProcess:
    """A real ``dcp-server`` (8 vbuckets unless ``extra`` says otherwise); its log goes
    to ``<data_dir>.log``. ``start`` waits for its port; ``stop`` is SIGTERM, then kill."""

    def __init__(self, data_dir: Path, *extra: str, **popen: Any) -> None:
        self.data_dir = data_dir
        self.extra = list(extra)
        self.popen = popen
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    async def start(self) -> ServerProcess:
        """Spawn it and wait for its port (polling with ``trio.sleep``: the callers are
        async tests, whose event loop must keep running meanwhile)."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    *SERVER,
                    "--port",
                    "0",
                    "--data-dir",
                    str(self.data_dir),
                    "--num-vbuckets",
                    "8",
                    *self.extra,
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
                **self.popen,
            )
        deadline = trio.current_time() + 20
        while trio.current_time() < deadline:
            m = re.search(r"listening host=\S+ port=(\d+)", self.log())
            if m:
                self.port = int(m.group(1))
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"dcp-server exited early:\n{self.log()}")
            await trio.sleep(0.02)
        self.stop()
        raise RuntimeError("dcp-server did not report its port")

    def log(self) -> str:
        return self.log_path.read_text("utf-8", "replace") if self.log_path.exists() else ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


async def open_hog(port: int, rcvbuf: int | None = 4096) -> trio.SocketStream:
    """A connection for a client that never reads. With a tiny receive buffer the kernel
    absorbs little of what the server sends, so the server holds the rest (reading it
    later is slow: ``rcvbuf=None`` keeps the system's buffer)."""
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await sock.connect(("127.0.0.1", port))
    return trio.SocketStream(sock)


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (``VmRSS`` of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def gets(key: bytes, vb: int, n: int, first_opaque: int = 1) -> bytes:
    """``n`` GETs of ``key`` in one buffer (one write)."""
    return b"".join(
        codec.request(Opcode.GET, vbucket=vb, opaque=first_opaque + i, key=key) for i in range(n)
    )


def stats(group: str, n: int) -> bytes:
    return b"".join(codec.request(Opcode.STAT, opaque=i + 1, key=group.encode()) for i in range(n))


async def read_answers(stream: trio.SocketStream, count: int) -> list[tuple[int, int, int]]:
    """Read ``count`` responses as (opcode, status, body length) without keeping their
    bodies (they may be large)."""
    out: list[tuple[int, int, int]] = []
    buf = bytearray()
    skip = 0
    while len(out) < count:
        data = await stream.receive_some(1 << 20)
        if not data:
            raise EOFError(f"server closed after {len(out)} of {count} answers")
        if skip:
            take = min(skip, len(data))
            skip -= take
            data = data[take:]
        buf += data
        while len(buf) >= 24 and len(out) < count:
            body = codec.U32.unpack_from(buf, 8)[0]
            out.append((buf[1], codec.U16.unpack_from(buf, 6)[0], body))
            if len(buf) >= 24 + body:
                del buf[: 24 + body]
            else:
                skip = 24 + body - len(buf)
                buf.clear()
                break
    return out
