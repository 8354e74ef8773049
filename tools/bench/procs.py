"""Processes of the benchmark: our server, the Redis peer, client workers.

Rules of this module:
- Every process started here is started by this tool, on loopback, and stopped by its
  own PID (``stop()``), never by name. Every wait is bounded by a timeout.
- Server CPU and memory come from psutil on the server's PID: ``cpu()`` is user+system
  seconds of all its threads, ``peak_rss()`` is the kernel's high-water mark (VmHWM).
- Workers (``tools/bench/worker.py``) talk JSON lines: they print ``{"event": ...}``
  objects on stdout and read commands from stdin; their stderr goes to a log file.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[2]
TOOLS = Path(__file__).resolve().parent  # tools/bench
PYTHON = sys.executable
MiB = 1024 * 1024


class BenchError(RuntimeError):
    """A benchmark step failed (a process died, a wait timed out)."""


def _server_binary() -> str:
    exe = Path(PYTHON).parent / "dcp-server"
    return str(exe) if exe.exists() else "dcp-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Proc:
    """Common psutil accounting of a child process."""

    proc: subprocess.Popen
    ps: psutil.Process

    def cpu(self) -> float:
        try:
            t = self.ps.cpu_times()
        except psutil.Error:
            return 0.0
        return t.user + t.system

    def cpu_split(self) -> tuple[float, float]:
        """(user, system) CPU seconds."""
        try:
            t = self.ps.cpu_times()
        except psutil.Error:
            return (0.0, 0.0)
        return (t.user, t.system)

    def thread_cpu(self) -> dict[int, float]:
        try:
            return {t.id: t.user_time + t.system_time for t in self.ps.threads()}
        except psutil.Error:
            return {}

    def rss(self) -> int:
        try:
            return self.ps.memory_info().rss
        except psutil.Error:
            return 0

    def peak_rss(self) -> int:
        """VmHWM (peak resident set) from /proc; psutil's rss where that is missing."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return self.rss()

    def alive(self) -> bool:
        return self.proc.poll() is None


class OurServer(_Proc):
    """``dcp-server --port 0`` in a subprocess; the port comes from its log line."""

    def __init__(
        self,
        data_dir: str,
        vbuckets: int,
        extra: dict[str, Any] | None = None,
        log_path: str | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.vbuckets = vbuckets
        self.extra = dict(extra or {})
        self.log_path = log_path or os.path.join(data_dir, "..", "server.log")
        self.port = 0
        self._lines: list[str] = []

    def start(self, timeout: float = 60.0) -> OurServer:
        # The port comes from the INFO line ``listening ... port=N``; a quieter log level
        # hides it, so then the port is picked here and polled until it accepts.
        quiet = str(self.extra.get("log_level", "INFO")).upper() in ("WARNING", "ERROR")
        fixed = free_port() if quiet else 0
        code_root = os.environ.get("DCP_BENCH_CODE_ROOT")
        exe = [PYTHON, "-m", "dcp.producer"] if code_root else [_server_binary()]
        args = [
            *exe,
            "--port",
            str(fixed),
            "--data-dir",
            self.data_dir,
            "--num-vbuckets",
            str(self.vbuckets),
        ]
        for k, v in self.extra.items():
            args += ["--" + k.replace("_", "-"), str(v)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("DCP_")}
        if code_root:  # --code-root: the server of another checkout (A/B comparisons)
            env["PYTHONPATH"] = code_root
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=code_root or None,
        )  # -m puts the cwd first
        self.ps = psutil.Process(self.proc.pid)
        found: queue.Queue[int] = queue.Queue()
        log = open(self.log_path, "a")

        def drain() -> None:
            pat = re.compile(r"listening host=\S+ port=(\d+)")
            with log:
                for line in self.proc.stderr:  # type: ignore[union-attr]
                    log.write(line)
                    if not self.port:
                        m = pat.search(line)
                        if m:
                            found.put(int(m.group(1)))
                    if "ERROR" in line or "Traceback" in line:
                        self._lines.append(line.rstrip())

        threading.Thread(target=drain, daemon=True).start()
        if fixed:
            threading.Thread(
                target=_poll_port, args=(fixed, found, timeout, self.proc), daemon=True
            ).start()
        deadline = time.monotonic() + timeout
        while not self.port:
            try:
                self.port = found.get(timeout=0.1)
            except queue.Empty:
                if self.proc.poll() is not None:  # died at start: say so now, not in 60 s
                    raise BenchError(
                        f"dcp-server exited with status {self.proc.returncode} at start "
                        f"(log: {self.log_path})"
                    ) from None
                if time.monotonic() > deadline:
                    self.stop()
                    raise BenchError(
                        f"dcp-server did not report its port within {timeout:g}s "
                        f"(log: {self.log_path})"
                    ) from None
        return self

    def errors(self) -> list[str]:
        return list(self._lines)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (graceful: flushes everything), then SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def stat(self, group: str = "", timeout: float = 30.0) -> dict[str, str]:
        return stat(self.port, group, timeout)


def _poll_port(port: int, found: queue.Queue, timeout: float, proc: subprocess.Popen) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout and proc.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                found.put(port)
                return
        except OSError:
            time.sleep(0.05)


def stat(port: int, group: str = "", timeout: float = 30.0) -> dict[str, str]:
    """A memcached STAT request over a plain blocking socket."""
    from dcp.protocol import codec
    from dcp.protocol.frames import FrameReader
    from dcp.protocol.opcodes import Opcode

    out: dict[str, str] = {}
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(codec.request(Opcode.STAT, key=group.encode(), opaque=7))
        reader = FrameReader()
        while True:
            data = s.recv(1 << 20)
            if not data:
                raise BenchError("server closed the STAT connection")
            reader.feed(data)
            for f in reader.read_frames():
                if f.status != 0:
                    raise BenchError(f"STAT {group!r}: status 0x{f.status:02x}")
                if not f.key:
                    return out
                out[bytes(f.key).decode()] = bytes(f.value).decode()


def wait_persisted(port: int, timeout: float) -> float:
    """Poll STAT until the flusher has nothing queued; returns seconds waited."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if int(stat(port).get("ep_queue_size", "0")) == 0:
            return time.perf_counter() - t0
        time.sleep(0.05)
    raise BenchError(f"server still had unpersisted items after {timeout:g}s")


# ---------------------------------------------------------------------- redis


def redis_available() -> str | None:
    """None when the Redis peer can run, else why not."""
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (Debian: apt-get install -y redis-server)"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "the redis Python package is missing (pip install redis hiredis)"
    return None


def ensure_redis(install: bool) -> str | None:
    """Install redis-server with apt-get when missing and allowed (root); returns the
    reason the peer cannot run, or None."""
    why = redis_available()
    if why is None or shutil.which("redis-server") is not None or not install:
        return why
    if os.geteuid() != 0:
        return why + "; not root, so the tool did not install it"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        subprocess.run(
            ["apt-get", "update", "-qq"],
            check=True,
            env=env,
            timeout=300,
            stdout=subprocess.DEVNULL,
        )
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", "redis-server"],
            check=True,
            env=env,
            timeout=600,
            stdout=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"apt-get install redis-server failed: {exc}"
    return redis_available()


class RedisServer(_Proc):
    """redis-server on a free loopback port, persistence off."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.port = 0

    def start(self, timeout: float = 30.0) -> RedisServer:
        for _attempt in range(5):
            self.port = free_port()
            self.proc = subprocess.Popen(
                [
                    "redis-server",
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--daemonize",
                    "no",
                    "--dir",
                    self.workdir,
                    "--protected-mode",
                    "yes",
                    "--loglevel",
                    "warning",
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            self.ps = psutil.Process(self.proc.pid)
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < timeout and self.proc.poll() is None:
                try:
                    with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                        s.sendall(b"PING\r\n")
                        if s.recv(16).startswith(b"+PONG"):
                            return self
                except OSError:
                    time.sleep(0.05)
            self.stop()
        raise BenchError("redis-server did not start")

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


# ---------------------------------------------------------------------- workers


class Worker(_Proc):
    """``tools/bench/worker.py ROLE PARAMS`` with a JSON-lines conversation.

    The worker runs as a script by path, not ``-m``: a script puts its own folder first on
    ``sys.path`` (not the cwd), so with ``--code-root`` the ``dcp`` it imports is the other
    checkout's, through ``PYTHONPATH``, and never this one's."""

    def __init__(
        self, role: str, params: dict[str, Any], log_dir: str, script: str = "worker.py"
    ) -> None:
        self.role = role
        self.log_path = os.path.join(log_dir, f"worker-{role}-{os.getpid()}-{id(self)}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [PYTHON, str(TOOLS / script), role, json.dumps(params)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=str(ROOT),
            env={**os.environ, "PYTHONPATH": os.environ.get("DCP_BENCH_CODE_ROOT", str(ROOT))},
        )
        self.ps = psutil.Process(self.proc.pid)
        self._events: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            line = line.strip()
            if line.startswith("{"):
                try:
                    self._events.put(json.loads(line))
                except ValueError:
                    pass
        self._events.put(None)

    def expect(self, event: str, timeout: float) -> dict[str, Any]:
        """Wait for ``{"event": event}``; raises if the worker fails or dies first."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BenchError(
                    f"worker {self.role}: no {event!r} within {timeout:g}s (log: {self.log_path})"
                )
            try:
                msg = self._events.get(timeout=left)
            except queue.Empty:
                continue
            if msg is None:
                raise BenchError(f"worker {self.role} exited before {event!r}: {self._tail()}")
            if msg.get("event") == "error":
                raise BenchError(f"worker {self.role}: {msg.get('error')}")
            if msg.get("event") == event:
                return msg

    def send(self, command: str, **data: Any) -> None:
        try:
            self.proc.stdin.write(json.dumps({"cmd": command, **data}) + "\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except (BrokenPipeError, OSError) as exc:
            raise BenchError(f"worker {self.role} is gone: {self._tail()}") from exc

    def _tail(self) -> str:
        self._log.flush()
        try:
            lines = Path(self.log_path).read_text().strip().splitlines()
        except OSError:
            return "?"
        return " | ".join(lines[-6:]) or f"exit code {self.proc.poll()}"

    def close(self, timeout: float = 30.0) -> None:
        try:
            if self.proc.stdin and not self.proc.stdin.closed:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


class Profiler:
    """``--profile DIR``: py-spy records given PIDs during a measured phase (raw stacks,
    one file per process; ``py-spy`` must be installed). A no-op without DIR."""

    def __init__(self) -> None:
        self.out = os.environ.get("DCP_BENCH_PROFILE")
        self.spy = shutil.which("py-spy") or str(Path(PYTHON).parent / "py-spy")
        self._procs: list[subprocess.Popen] = []

    def start(self, **pids: int) -> Profiler:
        if not self.out or not os.path.exists(self.spy):
            return self
        tag = os.environ.get("DCP_BENCH_SCENARIO", "bench")
        for label, pid in pids.items():
            path = os.path.join(self.out, f"{tag}-{label}-{pid}.txt")
            self._procs.append(
                subprocess.Popen(
                    [
                        self.spy,
                        "record",
                        "-p",
                        str(pid),
                        "-o",
                        path,
                        "-f",
                        "raw",
                        "-r",
                        "250",
                        *(["--idle"] if os.environ.get("DCP_BENCH_PROFILE_IDLE") else []),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        time.sleep(0.3)  # let py-spy attach before the phase starts
        return self

    def stop(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in self._procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        self._procs.clear()


class RssSampler:
    """Samples a process's RSS every ``interval`` seconds in a thread, with a phase tag."""

    def __init__(self, proc: _Proc, interval: float = 0.2) -> None:
        self.proc = proc
        self.interval = interval
        #: (seconds, rss, phase, anonymous rss, file-backed rss: LMDB's mapped pages)
        self.samples: list[tuple[float, int, str, int, int]] = []
        self.phase = ""
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            anon = file = 0
            try:
                for line in Path(f"/proc/{self.proc.proc.pid}/status").read_text().splitlines():
                    if line.startswith("RssAnon:"):
                        anon = int(line.split()[1]) * 1024
                    elif line.startswith(("RssFile:", "RssShmem:")):
                        file += int(line.split()[1]) * 1024
            except OSError:
                pass
            self.samples.append(
                (round(time.perf_counter() - self._t0, 3), self.proc.rss(), self.phase, anon, file)
            )

    def stop(self) -> list[tuple[float, int, str, int, int]]:
        self._stop.set()
        self._thread.join(5)
        return self.samples


class Scratch:
    """A temporary directory for one scenario (data dirs, logs), removed at the end
    unless ``keep``."""

    def __init__(self, keep: bool = False, base: str | None = None) -> None:
        self.path = tempfile.mkdtemp(prefix="dcp-bench-", dir=base)
        self.keep = keep

    def sub(self, name: str) -> str:
        p = os.path.join(self.path, name)
        os.makedirs(p, exist_ok=True)
        return p

    def close(self) -> None:
        if not self.keep:
            shutil.rmtree(self.path, ignore_errors=True)
