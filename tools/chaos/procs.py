"""Child processes and the raw wire for the reliability harness (``python -m tools.chaos``):
the server as a child process, a minimal memcached-binary client, STAT readers.

Rules of this module:
- Loopback only: every socket is 127.0.0.1, every server is started with ``--host 127.0.0.1``.
- Nothing here is unbounded: every wait has a deadline and raises ``HarnessError`` when
  it passes (a harness failure, never mistaken for a server defect).
- The server is never imported: it runs as ``python -m dcp.producer`` so it can be
  killed with SIGKILL like a real process. Every child is tracked (``track``) and a
  ``@scenario`` function kills the ones still running when it returns or fails.
"""

from __future__ import annotations

import atexit
import functools
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import trio

from dcp.protocol import codec
from dcp.protocol.opcodes import Opcode, Status
from dcp.protocol.raw_session import RawSession

__all__ = [
    "HOST",
    "HarnessError",
    "RawClient",
    "ServerProcess",
    "failover_logs",
    "free_port",
    "kill_children",
    "proc_rss",
    "scenario",
    "track",
    "vb_seqnos",
]

HOST = "127.0.0.1"
_LISTENING = re.compile(rb"listening host=\S+ port=(\d+)")


class HarnessError(RuntimeError):
    """The harness itself could not do its job (not a finding about the server)."""


#: Every child process the harness started; ``kill_children`` ends the ones still alive.
_CHILDREN: list[subprocess.Popen[bytes]] = []


def track(proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    _CHILDREN[:] = [p for p in _CHILDREN if p.poll() is None]
    _CHILDREN.append(proc)
    return proc


def kill_children() -> None:
    """SIGKILL every child this harness started that is still running (by pid)."""
    for p in _CHILDREN:
        if p.poll() is None:
            p.kill()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
    _CHILDREN.clear()


atexit.register(kill_children)


Scenario = Callable[..., Awaitable[dict[str, Any]]]


def scenario(fn: Scenario) -> Scenario:
    """A scenario never leaves a child process behind, whatever happens to it."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            return await fn(*args, **kwargs)
        finally:
            kill_children()

    return wrapper


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


def proc_rss(pid: int) -> int:
    """Resident set size in bytes (psutil when installed, else /proc)."""
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except ImportError:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    return 0


# --------------------------------------------------------------------------- server process


class ServerProcess:
    """``dcp-server`` as a child process; stderr goes to ``log_path`` (appended)."""

    def __init__(
        self,
        data_dir: Path,
        log_path: Path,
        *,
        port: int = 0,
        num_vbuckets: int = 16,
        args: Iterable[str] = (),
    ) -> None:
        self.data_dir = Path(data_dir)
        self.log_path = Path(log_path)
        self.port = port
        self.num_vbuckets = num_vbuckets
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def command(self, extra: Iterable[str] = ()) -> list[str]:
        return [
            sys.executable,
            "-m",
            "dcp.producer",
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--data-dir",
            str(self.data_dir),
            "--num-vbuckets",
            str(self.num_vbuckets),
            *self.args,
            *extra,
        ]

    async def start(self, extra: Iterable[str] = (), timeout: float = 30.0) -> int:
        """Start and wait for the ``listening`` line; returns the port."""
        if self.alive():
            raise HarnessError("server already running")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = open(self.log_path, "ab")
        try:
            self.proc = track(
                subprocess.Popen(
                    self.command(extra), stdin=subprocess.DEVNULL, stdout=log, stderr=log
                )
            )
        finally:
            log.close()
        self.starts += 1
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                m = _LISTENING.search(f.read())
            if m:
                self.port = int(m.group(1))
                return self.port
            if self.port and _accepts(self.port):  # log levels above INFO hide the line
                return self.port
            if self.proc.poll() is not None:
                raise HarnessError(
                    f"server exited with {self.proc.returncode} while starting:\n" + self.log_tail()
                )
            await trio.sleep(0.02)
        self.kill()
        raise HarnessError("server did not start listening in time:\n" + self.log_tail())

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL (a crash) and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    async def terminate(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (graceful stop); SIGKILL if it takes longer than ``timeout``."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None and time.monotonic() < deadline:
                await trio.sleep(0.05)
            if self.proc.poll() is None:
                self.kill()
        return self.proc.returncode

    def rss(self) -> int:
        return proc_rss(self.pid) if self.alive() else 0

    def log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_bytes().splitlines()[-n:]
        except OSError:
            return ""
        return "\n".join(x.decode("utf-8", "replace") for x in lines)

    def crash_signatures(self) -> list[str]:
        """One line per traceback in the log: the innermost exception and the deepest
        project frame (``dcp/...:line in function``)."""
        out = []
        for tb in self.tracebacks():
            lines = [x.strip(" |+-\t") for x in tb.splitlines()]
            frames = [x for x in lines if x.startswith("File ") and "/dcp/" in x]
            excs = [
                x
                for x in lines
                if re.match(r"^[\w.]+(Error|Exception|Group)\b", x)
                and not x.startswith("ExceptionGroup")
            ]
            where = ""
            if frames:
                m = re.search(r'File ".*?/(dcp/[^"]+)", line (\d+), in (\S+)', frames[-1])
                if m:
                    where = f" at {m.group(1)}:{m.group(2)} in {m.group(3)}"
            out.append((excs[-1] if excs else lines[-1])[:200] + where)
        return out

    def tracebacks(self) -> list[str]:
        """Unhandled-exception reports in the server's log (a crash or a task that died)."""
        try:
            lines = self.log_path.read_text("utf-8", "replace").splitlines()
        except OSError:
            return []
        out: list[str] = []
        cur: list[str] | None = None
        for line in lines:
            starts = (
                "Traceback (most recent call last)" in line or "Exception Group Traceback" in line
            )
            if cur is not None and line[:1] in (" ", "\t", "|", "+", ""):
                cur.append(line)
                continue
            if cur is not None:
                if line[:1] not in "0123456789" and not line.startswith("dcp-server:"):
                    cur.append(line)  # the exception line of a plain traceback
                out.append("\n".join(cur)[-3000:])
                cur = None
            if starts:
                cur = [line]
        if cur is not None:
            out.append("\n".join(cur)[-3000:])
        return out


# --------------------------------------------------------------------------- raw wire client


class RawClient:
    """A minimal memcached-binary client over trio (independent of the SDK): a shell over
    a ``RawSession``, which frames; answers are matched by opaque here."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.session = RawSession()
        self.stash: list[Any] = []
        self.opaque = 0x1000

    @classmethod
    async def connect(cls, port: int, timeout: float = 10.0) -> RawClient:
        with trio.fail_after(timeout):
            return cls(await trio.open_tcp_stream(HOST, port))

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self.stream)

    def next_opaque(self) -> int:
        self.opaque += 1
        return self.opaque

    async def _fill(self) -> None:
        data = await self.stream.receive_some(1 << 16)
        if not data:
            raise EOFError("server closed the connection")
        self.stash.extend(self.session.receive_data(data))

    async def call(self, frame: bytes, opaque: int, timeout: float = 10.0) -> Any:
        await self.stream.send_all(frame)
        with trio.fail_after(timeout):
            while True:
                for i, f in enumerate(self.stash):
                    if f.is_response and f.opaque == opaque:
                        del self.stash[i]
                        return f
                await self._fill()

    async def stats(self, group: str = "", timeout: float = 10.0) -> dict[str, str]:
        op = self.next_opaque()
        await self.stream.send_all(codec.request(Opcode.STAT, opaque=op, key=group.encode()))
        out: dict[str, str] = {}
        with trio.fail_after(timeout):
            while True:
                while not self.stash:
                    await self._fill()
                f = self.stash.pop(0)
                if not (f.is_response and f.opaque == op):
                    continue
                if f.status != Status.SUCCESS:
                    raise HarnessError(f"STAT {group!r} failed with status 0x{f.status:02x}")
                if not f.key:
                    return out
                out[bytes(f.key).decode()] = bytes(f.value).decode()

    async def store(
        self,
        key: bytes,
        value: bytes,
        vbucket: int,
        *,
        opcode: int = Opcode.SET,
        expiry: int = 0,
        durable: bool = False,
    ) -> Any:
        op = self.next_opaque()
        fe = codec.durability_frame_info(3) if durable else b""
        return await self.call(
            codec.request(
                opcode,
                vbucket=vbucket,
                opaque=op,
                extras=codec.store_extras(0, expiry),
                key=key,
                value=value,
                framing_extras=fe,
            ),
            op,
        )

    async def get(self, key: bytes, vbucket: int) -> Any:
        op = self.next_opaque()
        return await self.call(codec.request(Opcode.GET, vbucket=vbucket, opaque=op, key=key), op)


async def vb_seqnos(port: int) -> dict[int, tuple[int, int, int]]:
    """vb -> (high_seqno, vb_uuid, persisted_seqno) from STAT vbucket-seqno."""
    c = await RawClient.connect(port)
    try:
        st = await c.stats("vbucket-seqno")
    finally:
        await c.aclose()
    out: dict[int, list[int]] = {}
    for k, v in st.items():
        vb, _, name = k.partition(":")
        idx = {"high_seqno": 0, "vb_uuid": 1, "last_persisted_seqno": 2}.get(name)
        if idx is not None:
            out.setdefault(int(vb[3:]), [0, 0, 0])[idx] = int(v)
    return {vb: (x[0], x[1], x[2]) for vb, x in out.items()}


async def failover_logs(port: int) -> dict[int, list[tuple[int, int]]]:
    c = await RawClient.connect(port)
    try:
        st = await c.stats("failovers")
    finally:
        await c.aclose()
    logs: dict[int, dict[int, list[int]]] = {}
    for k, v in st.items():
        parts = k.split(":")
        if len(parts) != 3 or parts[2] not in ("id", "seq"):
            continue
        vb, i = int(parts[0][3:]), int(parts[1])
        logs.setdefault(vb, {}).setdefault(i, [0, 0])[parts[2] == "seq"] = int(v)
    return {vb: [(e[0], e[1]) for _, e in sorted(d.items())] for vb, d in logs.items()}
