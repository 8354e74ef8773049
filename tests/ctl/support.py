"""Helpers for dcpctl tests: a real server process, the CLI as a user runs it, and a tiny
blocking wire client (``dcp.protocol`` only) to put data in place quickly."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dcp.protocol import FrameReader, Opcode, Status, codec

BIN = Path(sys.executable).parent
DCPCTL = [str(BIN / "dcpctl")] if (BIN / "dcpctl").exists() else [sys.executable, "-m", "dcp.ctl"]
SERVER = (
    [str(BIN / "dcp-server")]
    if (BIN / "dcp-server").exists()
    else [sys.executable, "-m", "dcp.producer"]
)
NUM_VBUCKETS = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``dcp-server`` as a subprocess; its log goes to a file (a pipe could fill up)."""

    def __init__(self, data_dir: Path, *extra: str) -> None:
        self.data_dir = data_dir
        self.extra = list(extra)
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    def start(self) -> ServerProcess:
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "ab")  # the child keeps its own descriptor
        self.proc = subprocess.Popen(
            [
                *SERVER,
                "--port",
                "0",
                "--data-dir",
                str(self.data_dir),
                "--num-vbuckets",
                str(NUM_VBUCKETS),
                "--log-level",
                "INFO",
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        log.close()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            text = self.log_path.read_bytes()[offset:].decode("utf-8", "replace")
            m = re.search(r"listening host=\S+ port=(\d+)", text)
            if m:
                self.port = int(m.group(1))
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"dcp-server exited early:\n{text}")
            time.sleep(0.02)
        raise RuntimeError("dcp-server did not report its port")

    def stop(self) -> None:
        """Graceful stop (SIGTERM): flush, clean-shutdown marker."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """``kill -9``: an unclean stop."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def ctl(
    *args: Any, port: int | None = None, timeout: float = 30, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run dcpctl as a user would; ``port`` adds ``--port``."""
    argv = [*DCPCTL, *(["--port", str(port)] if port else []), *map(str, args)]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def ok(*args: Any, **kw: Any) -> str:
    r = ctl(*args, **kw)
    assert r.returncode == 0, (args, r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    return r.stdout


def ok_json(*args: Any, **kw: Any) -> Any:
    return json.loads(ok(*args, "--json", **kw))


def fails(*args: Any, code: int = 1, **kw: Any) -> str:
    """Run a command that must fail with one line on stderr; returns that line."""
    r = ctl(*args, **kw)
    assert r.returncode == code, (args, r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("dcpctl: "), lines[0]
    return lines[0]


def keys_for_vb(vb: int, n: int, prefix: str = "k") -> list[bytes]:
    out = []
    for i in itertools.count():
        k = f"{prefix}-{i}".encode()
        if codec.vbucket_for_key(k, NUM_VBUCKETS) == vb:
            out.append(k)
            if len(out) == n:
                return out
    raise AssertionError("unreachable")


class Wire:
    """A blocking raw client: pipelined KV requests, STAT, and DCP for stream tests."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.reader = FrameReader()
        self.opaques = itertools.count(1)
        self.stash: list[Any] = []

    def close(self) -> None:
        self.sock.close()

    def _frames(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise EOFError("server closed the connection")
        self.reader.feed(data)
        self.stash.extend(self.reader.read_frames())

    def call_many(self, build: list[Any]) -> list[Any]:
        """Send ``build[i](opaque)`` requests in one write; their responses in order."""
        ops = [next(self.opaques) for _ in build]
        self.sock.sendall(b"".join(b(o) for b, o in zip(build, ops, strict=True)))
        got: dict[int, Any] = {}
        while len(got) < len(ops):
            if not self.stash:
                self._frames()
            f = self.stash.pop(0)
            if f.is_response and f.opaque in ops and f.opaque not in got:
                got[f.opaque] = f
        return [got[o] for o in ops]

    def set_many(self, pairs: list[tuple[bytes, bytes]]) -> list[Any]:
        frames = self.call_many(
            [
                (
                    lambda o, k=k, v=v: codec.request(
                        Opcode.SET,
                        vbucket=codec.vbucket_for_key(k, NUM_VBUCKETS),
                        opaque=o,
                        extras=codec.store_extras(0, 0),
                        key=k,
                        value=v,
                    )
                )
                for k, v in pairs
            ]
        )
        assert all(f.status == Status.SUCCESS for f in frames), frames
        return frames

    def delete(self, key: bytes) -> None:
        (f,) = self.call_many(
            [
                lambda o: codec.request(
                    Opcode.DELETE,
                    vbucket=codec.vbucket_for_key(key, NUM_VBUCKETS),
                    opaque=o,
                    key=key,
                )
            ]
        )
        assert f.status == Status.SUCCESS, f

    def request(self, build: Any) -> Any:
        return self.call_many([build])[0]


def write(port: int, pairs: list[tuple[bytes, bytes]], deletes: list[bytes] = ()) -> None:
    w = Wire(port)
    try:
        if pairs:
            w.set_many(pairs)
        for k in deletes:
            w.delete(k)
    finally:
        w.close()


def wait_persisted(port: int, timeout: float = 10) -> None:
    """Until every vbucket's persisted seqno reached its high seqno."""
    deadline = time.monotonic() + timeout
    while True:
        doc = ok_json("vbuckets", port=port)
        if all(v["persisted_seqno"] == v["high_seqno"] for v in doc["vbuckets"]):
            return
        assert time.monotonic() < deadline, doc
        time.sleep(0.05)


def table_rows(text: str) -> list[list[str]]:
    """Body and footer rows of the rich tables in ``text``, as stripped cells."""
    return [
        [c.strip() for c in line.strip().strip("│").split("│")]
        for line in text.splitlines()
        if line.startswith("│")
    ]


def table_header(text: str) -> list[str]:
    for line in text.splitlines():
        if line.startswith("┃"):
            return [c.strip() for c in line.strip().strip("┃").split("┃")]
    raise AssertionError(f"no table header in:\n{text}")
