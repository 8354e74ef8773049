"""Load generator of the ``durability`` benchmark (``durability.py``): writes at a
durability level over the wire, to our cluster's actives or to a Redis primary.

Run as ``python tools/bench/durability_worker.py ROLE '{json params}'`` (``dura-ours``,
``dura-redis``). It connects, reports ``ready``, then answers every command
``{"cmd": "run", "mode": "throughput"|"latency", "level", "seconds", "rate"}`` with one
``result``; stdin closed ends it. The connections stay open across runs, so every run
after the first measures warm connections on both sides.

Rules of this file:
- One thread, blocking sockets, a selector says which have answers: the same loop drives
  both sides, so they pay the same client cost per write. Every socket operation is
  bounded by the ``timeout`` parameter, every run by its seconds plus a drain deadline
  (the durability timeout + 10 s), after which the unanswered writes are reported.
- Client concurrency is the same on both sides: ``connections`` connections (ours:
  ``conns_per_node`` per node, each writing only keys whose vbucket's active is its node,
  from the map GET_CLUSTER_CONFIG gives; Redis: as many in total to the primary).
  **throughput**: each connection keeps ``window`` writes outstanding until the run's
  seconds are up. **latency**: open loop, write ``j`` is due at ``t0 + j / rate``
  (round-robin over the connections) whatever the answers do.
- An answer's time counts from when its write was due (latency mode: a client that falls
  behind its schedule is charged for it, so there is no coordinated omission) and, also
  reported, from when it was sent. A write answered with an error is counted under its
  status, never in the rate or the percentiles, and never retried.
- Our writes are memcached-binary SETs; a durable level adds the durability frame info
  (alt magic 0x08, ``codec.durability_frame_info``), level ``none`` sends none, as
  Couchbase clients do. Redis writes are ``SET`` (level ``none``) or ``SET`` + ``WAIT 1
  <timeout>`` pipelined (level ``wait1``); a WAIT answered 0 is a timeout.
"""

from __future__ import annotations

import collections
import json
import selectors
import socket
import struct
import sys
import time
from typing import Any

import hiredis
from scale_worker import fetch_config
from worker import Meter, emit, key_of, percentiles, value_of

from dcp.protocol import codec
from dcp.protocol.frames import FrameReader
from dcp.protocol.layout import vbucket_for_key
from dcp.protocol.opcodes import DurabilityLevel, HelloFeature, Opcode, Status

#: our level names (as KvClient spells them) -> the wire level
OURS_LEVELS = {
    "none": DurabilityLevel.NONE,
    "majority": DurabilityLevel.MAJORITY,
    "majorityAndPersistActive": DurabilityLevel.MAJORITY_AND_PERSIST_TO_ACTIVE,
    "persistToMajority": DurabilityLevel.PERSIST_TO_MAJORITY,
    "persistActive": DurabilityLevel.PERSIST_TO_ACTIVE,
}
REDIS_LEVELS = ("none", "wait1")
_HDR = struct.Struct(">BBHBBHII")  # magic opcode keylen extlen datatype vb/status body opaque
_HDR_SIZE = 24
_OPAQUE = struct.Struct(">I")
_FEATURES = [
    int(HelloFeature.XERROR),  # SYNC_WRITE_AMBIGUOUS as itself, not ETMPFAIL
    int(HelloFeature.ALT_REQUEST_SUPPORT),
    int(HelloFeature.SYNC_REPLICATION),
    int(HelloFeature.TCPNODELAY),
]


def _connect(addr: tuple[str, int], timeout: float) -> socket.socket:
    s = socket.create_connection(addr, timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


# ---------------------------------------------------------------------- answers


class BinaryAnswers:
    """The whole memcached-binary answers in a connection's bytes, however they were cut."""

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, data: bytes) -> list[tuple[int, int | str]]:
        """(opaque, 0 or the status as hex) of each answer completed by ``data``."""
        buf = self._rest + data if self._rest else data
        out: list[tuple[int, int | str]] = []
        o, end_all = 0, len(buf)
        while end_all - o >= _HDR_SIZE:
            _m, _op, _kl, _el, _dt, status, body, opaque = _HDR.unpack_from(buf, o)
            if o + _HDR_SIZE + body > end_all:
                break
            out.append((opaque, f"0x{status:02x}" if status else 0))
            o += _HDR_SIZE + body
        self._rest = buf[o:]
        return out


class RespAnswers:
    """Redis replies grouped per write: ``per_write`` replies (SET, or SET and WAIT)."""

    def __init__(self, per_write: int = 1) -> None:
        self.per_write = per_write
        self._reader = hiredis.Reader()
        self._part: list[Any] = []

    def feed(self, data: bytes) -> list[int | str]:
        """0, ``"error"`` (any reply an error) or ``"wait_timeout"`` (WAIT counted no
        replica) for each write completed by ``data``."""
        self._reader.feed(data)
        out: list[int | str] = []
        while (r := self._reader.gets()) is not False:
            self._part.append(r)
            if len(self._part) < self.per_write:
                continue
            status: int | str = 0
            if any(isinstance(x, hiredis.ReplyError) for x in self._part):
                status = "error"
            elif self.per_write == 2 and self._part[1] < 1:
                status = "wait_timeout"
            self._part = []
            out.append(status)
        return out


# ---------------------------------------------------------------------- connections


class OursConn:
    """One connection to a node; writes cycle over ``keys`` (all of that node's).
    Answers are matched by opaque (the write's number)."""

    def __init__(self, addr: tuple[str, int], keys: list[int], timeout: float) -> None:
        self.sock = _connect(addr, timeout)
        self.keys = keys
        self.templates: list[bytes] = []
        self.i = 0
        self.inflight: dict[int, tuple[float, float]] = {}
        self._answers = BinaryAnswers()
        self.sock.sendall(codec.hello("bench-durability", _FEATURES, opaque=1))
        reader = FrameReader()
        while not (frames := reader.read_frames()):
            data = self.sock.recv(4096)
            if not data:
                raise ConnectionError(f"{addr}: closed at HELLO")
            reader.feed(data)
        if frames[0].status != Status.SUCCESS:
            raise RuntimeError(f"{addr}: HELLO refused: status 0x{frames[0].status:02x}")

    def prepare(self, level: str, size: int, nvb: int, timeout_ms: int) -> None:
        """Every key's request at ``level``, opaque 0 (patched per write), before the clock."""
        wire = OURS_LEVELS[level]
        fi = b"" if wire == DurabilityLevel.NONE else codec.durability_frame_info(wire, timeout_ms)
        extras = codec.store_extras()
        self.templates = [
            codec.request(
                Opcode.SET,
                vbucket=vbucket_for_key(key_of(k), nvb),
                extras=extras,
                key=key_of(k),
                value=value_of(k, size),
                framing_extras=fi,
            )
            for k in self.keys
        ]
        self.i = 0

    def request(self, wid: int) -> bytes:
        t = self.templates[self.i]
        self.i = (self.i + 1) % len(self.templates)
        return t[:12] + _OPAQUE.pack(wid) + t[16:]

    def answers(self, data: bytes) -> list[tuple[int, int | str]]:
        return self._answers.feed(data)


class RedisConn:
    """One connection to the Redis primary; answers come in request order."""

    def __init__(self, addr: tuple[str, int], keys: list[int], timeout: float) -> None:
        self.sock = _connect(addr, timeout)
        self.keys = keys
        self.templates: list[bytes] = []
        self.i = 0
        self.inflight: dict[int, tuple[float, float]] = {}
        self.order: collections.deque[int] = collections.deque()
        self._answers = RespAnswers()

    def prepare(self, level: str, size: int, nvb: int, timeout_ms: int) -> None:
        if level not in REDIS_LEVELS:
            raise ValueError(f"Redis level {level!r}: one of {REDIS_LEVELS}")
        wait = hiredis.pack_command(("WAIT", 1, timeout_ms)) if level == "wait1" else b""
        self._answers.per_write = 2 if wait else 1
        self.templates = [
            hiredis.pack_command(("SET", key_of(k), value_of(k, size))) + wait for k in self.keys
        ]
        self.i = 0

    def request(self, wid: int) -> bytes:
        self.order.append(wid)
        t = self.templates[self.i]
        self.i = (self.i + 1) % len(self.templates)
        return t

    def answers(self, data: bytes) -> list[tuple[int, int | str]]:
        return [(self.order.popleft(), st) for st in self._answers.feed(data)]


Conn = OursConn | RedisConn


# ---------------------------------------------------------------------- the loop


def measure(
    conns: list[Conn], mode: str, seconds: float, rate: int, window: int, drain_s: float
) -> dict[str, Any]:
    """One run (see the module rules); the caller has ``prepare``d every connection."""
    sel = selectors.DefaultSelector()
    for c in conns:
        c.inflight.clear()
        sel.register(c.sock, selectors.EVENT_READ, c)
    perf = time.perf_counter
    n = len(conns)
    total = int(seconds * rate) if mode == "latency" else None
    by_due: list[float] = []
    by_sent: list[float] = []
    statuses: collections.Counter[str] = collections.Counter()
    wid = sent = ok = 0
    m = Meter()
    t0 = perf()
    stop_at = t0 + seconds
    last = t0
    if mode == "throughput":
        for c in conns:
            now = perf()
            reqs = []
            for _ in range(window):
                c.inflight[wid] = (now, now)
                reqs.append(c.request(wid))
                wid += 1
            c.sock.sendall(b"".join(reqs))
        sent = wid
    sending = True
    deadline = stop_at + drain_s
    try:
        while True:
            now = perf()
            if sending:
                if total is not None:  # open loop: everything due by now
                    due_n = min(total, int((now - t0) * rate) + 1)
                    if wid < due_n:
                        out: dict[int, list[bytes]] = {}
                        for j in range(wid, due_n):
                            c = conns[j % n]
                            c.inflight[j] = (t0 + j / rate, now)
                            out.setdefault(j % n, []).append(c.request(j))
                        for i, reqs in out.items():
                            conns[i].sock.sendall(b"".join(reqs))
                        wid = sent = due_n
                    sending = wid < total
                else:
                    sending = now < stop_at
            if not sending and not any(c.inflight for c in conns):
                break
            if now > deadline:
                break
            if sending and total is not None:
                wait = max(0.0, t0 + wid / rate - perf())
            else:
                wait = min(0.05, max(0.0, (stop_at if sending else deadline) - now))
            for key, _ev in sel.select(wait):
                c = key.data
                data = c.sock.recv(1 << 18)
                if not data:
                    raise ConnectionError("the server closed a write connection")
                t = perf()
                more = 0
                for w, status in c.answers(data):
                    due, at = c.inflight.pop(w)
                    if status:
                        statuses[str(status)] += 1
                    else:
                        ok += 1
                        by_due.append(t - due)
                        by_sent.append(t - at)
                    last = t
                    more += 1
                if total is None and more and t < stop_at:  # closed loop: refill
                    reqs = []
                    for _ in range(more):
                        c.inflight[wid] = (t, t)
                        reqs.append(c.request(wid))
                        wid += 1
                    c.sock.sendall(b"".join(reqs))
                    sent = wid
    finally:
        sel.close()
    unanswered = sum(len(c.inflight) for c in conns)
    for c in conns:  # a later run must not match these (ours: opaques restart at 0)
        c.inflight.clear()
    span = max(last - t0, 1e-9)
    return m.result(
        mode=mode,
        sent=sent,
        ok=ok,
        errors=dict(statuses),
        unanswered=unanswered,
        rate=ok / span,
        offered_rate=rate if total is not None else None,
        answer_ms=percentiles([x * 1e3 for x in by_due]),
        answer_from_send_ms=percentiles([x * 1e3 for x in by_sent]),
    )


# ---------------------------------------------------------------------- roles


def _serve(conns: list[Conn], p: dict[str, Any]) -> None:
    """``ready``, then one ``result`` per ``run`` command until stdin closes."""
    emit("ready", connections=len(conns), keys=[len(c.keys) for c in conns])
    while True:
        line = sys.stdin.readline()
        if not line:
            return
        cmd = json.loads(line)
        if cmd.get("cmd") != "run":
            return
        for c in conns:
            c.prepare(cmd["level"], p["value_size"], p["vbuckets"], p["durability_timeout_ms"])
        drain = p["durability_timeout_ms"] / 1000 + 10
        res = measure(conns, cmd["mode"], cmd["seconds"], cmd["rate"], p["window"], drain)
        emit("result", level=cmd["level"], **res)


def dura_ours(p: dict[str, Any]) -> None:
    """Connections to every node, each node's keys (by the map's actives) split among them."""
    nvb = p["vbuckets"]
    boot = [tuple(a) for a in p["bootstrap"]]
    _cfg, owners = fetch_config(boot, nvb, time.monotonic() + p["timeout"])  # type: ignore[arg-type]
    per_node: dict[tuple[str, int], list[int]] = {}
    for k in range(p["keys"]):
        per_node.setdefault(owners[vbucket_for_key(key_of(k), nvb)], []).append(k)
    conns: list[Conn] = []
    try:
        for addr in sorted(per_node):
            keys = per_node[addr]
            c = p["conns_per_node"]
            for i in range(c):
                conns.append(OursConn(addr, keys[i::c], p["timeout"]))
        _serve(conns, p)
    finally:
        for c in conns:
            c.sock.close()


def dura_redis(p: dict[str, Any]) -> None:
    """``connections`` connections to the primary, the keys split among them."""
    n = p["connections"]
    conns: list[Conn] = []
    try:
        for i in range(n):
            conns.append(
                RedisConn(("127.0.0.1", p["port"]), list(range(i, p["keys"], n)), p["timeout"])
            )
        _serve(conns, p)
    finally:
        for c in conns:
            c.sock.close()


ROLES = {"dura-ours": dura_ours, "dura-redis": dura_redis}


def main() -> None:
    role, params = sys.argv[1], json.loads(sys.argv[2])
    try:
        ROLES[role](params)
    except BaseException as exc:  # report, then exit non-zero
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        emit("error", error=f"{type(exc).__name__}: {exc}")
        raise


if __name__ == "__main__":
    main()
