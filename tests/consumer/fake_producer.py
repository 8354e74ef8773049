"""A small scripted DCP producer (trio TCP server) for the consumer SDK's tests.

Built only from ``dcp.protocol``'s codec. It answers HELLO / DCP_OPEN / DCP_CONTROL /
GET_ALL_VB_SEQNOS / DCP_GET_FAILOVER_LOG / DCP_STREAM_REQ / DCP_BUFFER_ACK and the KV
opcodes (GET_CLUSTER_CONFIG when ``cluster_config`` is set: a node of a scripted
cluster), and plays per-vbucket histories written by the test:

- ``VbHistory.add_snapshot`` appends one snapshot (explicit seqnos allow gaps, i.e.
  deduplicated items); ``failover`` starts a new history branch (the server "lost"
  everything above a seqno and got a new vbucket uuid).
- Stream requests are decided with the reference's rollback rules (§5.4, without the
  purge rule); ``stream_responses[vb]`` scripts answers (rollbacks, error statuses)
  for the next requests of a vbucket.
- ``faults`` fire once, just before a given item would be sent: ``disconnect`` (send
  what is buffered, then drop the connection), ``stream_end`` (end that stream with a
  reason) or ``silence`` (stop sending anything, noops included).
- A flow-control window from ``connection_buffer_size`` is enforced: nothing but noops
  is sent while unacknowledged bytes >= window; ``max_outstanding`` records the peak.
- Noops are sent every ``set_noop_interval`` seconds once enabled; replies are counted.
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import trio

from dcp.protocol import codec
from dcp.protocol.frames import Frame, FrameReader
from dcp.protocol.opcodes import (
    SEQNO_MAX,
    DcpOpenFlag,
    HelloFeature,
    Magic,
    Opcode,
    SnapshotMarkerFlag,
    Status,
    StreamEndStatus,
)

MEMORY = SnapshotMarkerFlag.MEMORY
DISK = SnapshotMarkerFlag.DISK
U64 = struct.Struct(">Q")


@dataclass
class Item:
    seqno: int
    key: bytes
    value: bytes = b""
    kind: str = "m"  # m = mutation, d = deletion, x = expiration
    rev: int = 1
    flags: int = 0
    expiry: int = 0


@dataclass
class Snap:
    start: int
    end: int
    flags: int
    items: list[Item]


@dataclass
class StreamRequestRecord:
    vbucket: int
    flags: int
    start: int
    end: int
    vb_uuid: int
    snap_start: int
    snap_end: int
    opaque: int
    value: bytes = b""


class VbHistory:
    def __init__(self, vb: int, uuid: int) -> None:
        self.vb = vb
        self.log: list[tuple[int, int]] = [(uuid, 0)]  # newest first
        self.snapshots: list[Snap] = []
        self.high = 0
        self.purge_seqno = 0  # > 0: markers are sent as v2.2 carrying it

    def add_snapshot(
        self,
        items: list[Any],
        *,
        flags: int = MEMORY,
        start: int | None = None,
        end: int | None = None,
    ) -> Snap:
        """Append a snapshot. ``items``: ``Item``s, ``(key, value)`` pairs or keys;
        without explicit seqnos they get high+1, high+2, ..."""
        seq = self.high
        made = []
        for it in items:
            if isinstance(it, Item):
                made.append(it)
                seq = it.seqno
                continue
            seq += 1
            if isinstance(it, tuple):
                made.append(Item(seq, _b(it[0]), _b(it[1])))
            else:
                made.append(Item(seq, _b(it), b"v-" + _b(it)))
        s = Snap(
            self.high + 1 if start is None else start,
            (made[-1].seqno if made else self.high) if end is None else end,
            flags,
            made,
        )
        self.snapshots.append(s)
        self.high = max(self.high, s.end)
        return s

    def add_mutations(
        self,
        count: int,
        per_snapshot: int = 10,
        prefix: str = "k",
        value: bytes = b"",
        flags: int = MEMORY,
    ) -> None:
        n = 0
        while n < count:
            k = min(per_snapshot, count - n)
            self.add_snapshot(
                [
                    (f"{prefix}{self.vb}-{self.high + i + 1}", value or f"v{self.high + i + 1}")
                    for i in range(k)
                ],
                flags=flags,
            )
            n += k

    def failover(self, new_uuid: int, at: int) -> None:
        """The server lost everything above ``at`` and starts a new branch there."""
        kept = []
        for s in self.snapshots:
            if s.end <= at:
                kept.append(s)
            elif s.start <= at:
                items = [i for i in s.items if i.seqno <= at]
                kept.append(Snap(s.start, at, s.flags, items))
        self.snapshots = kept
        self.high = at
        self.log = [(new_uuid, at)] + [(u, s) for u, s in self.log if s <= at]

    def needs_rollback(self, start: int, uuid: int, ss: int, se: int) -> int | None:
        """The rollback decision of protocol_spec/README.md §8 (no purge rule)."""
        if start == 0:
            return None
        oldest_first = list(reversed(self.log))
        for i, (u, _s) in enumerate(oldest_first):
            if u == uuid:
                upper = oldest_first[i + 1][1] if i + 1 < len(oldest_first) else self.high
                break
        else:
            return 0
        if start == ss:
            se = start
        if se <= upper:
            return None
        if start == se:
            ss = start
        return upper if upper < ss else ss


def _b(x: Any) -> bytes:
    return x.encode() if isinstance(x, str) else bytes(x)


@dataclass
class Fault:
    vb: int
    seqno: int
    action: str  # disconnect | stream_end | silence
    reason: int = StreamEndStatus.STATE_CHANGED
    fired: bool = False


class ServerStream:
    def __init__(
        self, conn: FakeConnection, hist: VbHistory, opaque: int, start: int, end: int
    ) -> None:
        self.conn = conn
        self.hist = hist
        self.vb = hist.vb
        self.opaque = opaque
        self.pos = start
        self.end = end
        self.frames: deque[tuple[bytes, int | None]] = deque()  # (frame, item seqno)
        self.done = False
        self.first = True

    def refill(self) -> bool:
        if self.frames or self.done:
            return bool(self.frames)
        if self.pos >= self.end:
            self._end(StreamEndStatus.OK)
            return True
        for snap in self.hist.snapshots:
            if snap.end > self.pos:
                break
        else:
            return False
        mstart = snap.start if snap.start > self.pos else self.pos
        mend = min(snap.end, self.end) if self.conn.producer.clamp_to_end else snap.end
        self.frames.append((self._marker(mstart, mend, snap.flags), None))
        for it in snap.items:
            if self.pos < it.seqno <= mend:
                self.frames.append((self._item(it), it.seqno))
        self.pos = mend
        self.first = False
        return True

    def _marker(self, start: int, end: int, flags: int) -> bytes:
        purge = self.hist.purge_seqno
        if not purge:
            return codec.snapshot_marker(self.vb, self.opaque, start, end, flags)
        value = codec.MARKER_V2_0.pack(start, end, flags, end, 0) + U64.pack(purge) + U64.pack(0)
        return (
            codec.dcp_header(
                Opcode.DCP_SNAPSHOT_MARKER, 0, 1, 0, self.vb, 1 + len(value), self.opaque, 0
            )
            + b"\x02"
            + value
        )

    def _item(self, it: Item) -> bytes:
        c = self.conn
        cas = it.seqno * 1000 + it.rev
        if it.kind == "m":
            return codec.mutation(
                self.vb,
                self.opaque,
                it.seqno,
                it.rev,
                it.key,
                it.value,
                cas=cas,
                flags=it.flags,
                expiry=it.expiry,
            )
        if it.kind == "x" and c.delete_times and c.expiry_opcode:
            return codec.expiration(
                self.vb, self.opaque, it.seqno, it.rev, it.key, cas=cas, delete_time=1700000000
            )
        return codec.deletion(
            self.vb,
            self.opaque,
            it.seqno,
            it.rev,
            it.key,
            cas=cas,
            delete_time=1700000000 if c.delete_times else None,
        )

    def _end(self, reason: int) -> None:
        self.frames.append((codec.stream_end(self.vb, self.opaque, reason), None))
        self.done = True


class FakeConnection:
    def __init__(self, producer: FakeProducer, stream: trio.SocketStream) -> None:
        self.producer = producer
        self.stream = stream
        self.reader = FrameReader()
        self.lock = trio.StrictFIFOLock()
        self.streams: dict[int, ServerStream] = {}  # by vb
        self.wake = trio.Event()
        self.window = 0
        self.outstanding = 0
        self.noop_enabled = False
        self.noop_interval = 0.0
        self.noop_changed = trio.Event()
        self.delete_times = False
        self.expiry_opcode = False
        self.silenced = False
        self.closed = False
        self.features: set[int] = set()
        self.name = b""
        self.noop_opaque = 0x10000

    async def send(self, data: bytes | bytearray) -> None:
        if self.closed or self.silenced:  # a hung server sends nothing at all
            return
        try:
            async with self.lock:
                await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.closed = True

    async def close(self) -> None:
        self.closed = True
        await trio.aclose_forcefully(self.stream)

    def poke(self) -> None:
        self.wake.set()

    async def serve(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.sender)
                nursery.start_soon(self.noop_loop)
                await self.read_loop()
                nursery.cancel_scope.cancel()
        finally:
            self.closed = True
            await trio.aclose_forcefully(self.stream)
            self.producer.connections.remove(self)

    async def read_loop(self) -> None:
        while not self.closed:
            try:
                data = await self.stream.receive_some(65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not data:
                return
            self.reader.feed(data)
            for f in self.reader.read_frames():
                await self.handle(f)

    async def respond(
        self,
        opcode: int,
        opaque: int,
        status: int = 0,
        value: bytes = b"",
        extras: bytes = b"",
        cas: int = 0,
    ) -> None:
        await self.send(
            codec.response(opcode, status, opaque=opaque, value=value, extras=extras, cas=cas)
        )

    async def handle(self, f: Frame) -> None:
        p = self.producer
        op = f.opcode
        p.frames.append(f)
        if f.magic == Magic.RESPONSE:
            if op == Opcode.DCP_NOOP:
                p.noop_replies += 1
            return
        if op == Opcode.HELLO:
            feats = codec.parse_hello_features(bytes(f.value))
            p.hello_features.append(feats)
            self.features = set(feats)
            await self.respond(op, f.opaque, value=b"".join(struct.pack(">H", x) for x in feats))
        elif op == Opcode.DCP_OPEN:
            name, flags = codec.parse_open(f)
            self.name = name
            p.open_flags.append(flags)
            self.delete_times = bool(flags & DcpOpenFlag.INCLUDE_DELETE_TIMES)
            await self.respond(op, f.opaque)
        elif op == Opcode.DCP_CONTROL:
            key, val = bytes(f.key).decode(), bytes(f.value).decode()
            p.controls.append((key, val))
            if key in p.refuse_controls:
                await self.respond(op, f.opaque, Status.NOT_SUPPORTED)
                return
            if key == "connection_buffer_size":
                self.window = int(val)
            elif key == "enable_noop":
                self.noop_enabled = val == "true"
            elif key == "set_noop_interval":
                self.noop_interval = float(val)
                self.noop_changed.set()
            elif key == "enable_expiry_opcode":
                self.expiry_opcode = True
            await self.respond(op, f.opaque)
        elif op == Opcode.GET_ALL_VB_SEQNOS:
            pairs = [(vb, h.high) for vb, h in sorted(p.vbs.items())]
            await self.respond(op, f.opaque, value=codec.all_vb_seqnos_value(pairs))
        elif op == Opcode.DCP_GET_FAILOVER_LOG:
            h = p.vbs.get(f.vbucket)
            if h is None:
                await self.respond(op, f.opaque, Status.NOT_MY_VBUCKET)
            else:
                await self.respond(op, f.opaque, value=codec.failover_log_value(h.log))
        elif op == Opcode.DCP_STREAM_REQ:
            await self.stream_request(f)
        elif op == Opcode.GET_CLUSTER_CONFIG and p.cluster_config is not None:
            p.config_requests += 1
            await self.respond(op, f.opaque, value=p.cluster_config)
        elif op == Opcode.DCP_BUFFER_ACK:
            n = codec.parse_buffer_ack(f)
            p.acks.append(n)
            self.outstanding -= n
            self.poke()
        elif op == Opcode.DCP_CLOSE_STREAM:
            self.streams.pop(f.vbucket, None)
            await self.respond(op, f.opaque)
        elif op == Opcode.NOOP:
            p.client_noops += 1
            await self.respond(op, f.opaque)
        elif op in (Opcode.SET, Opcode.ADD, Opcode.REPLACE, Opcode.DELETE, Opcode.GET):
            await self.kv(f)
        else:
            await self.respond(op, f.opaque, Status.UNKNOWN_COMMAND)

    async def stream_request(self, f: Frame) -> None:
        p = self.producer
        req = codec.parse_stream_request(f)
        vb = req.vbucket
        p.stream_requests.append(
            StreamRequestRecord(
                vb,
                req.flags,
                req.start_seqno,
                req.end_seqno,
                req.vb_uuid,
                req.snap_start_seqno,
                req.snap_end_seqno,
                req.opaque,
                req.value,
            )
        )
        op = Opcode.DCP_STREAM_REQ
        script = p.stream_responses.get(vb)
        if script:
            kind, arg = script.popleft()
            if kind == "rollback":
                await self.respond(op, f.opaque, Status.ROLLBACK, value=U64.pack(arg))
            else:
                await self.respond(op, f.opaque, arg)
            return
        h = p.vbs.get(vb)
        if h is None:
            await self.respond(op, f.opaque, Status.NOT_MY_VBUCKET, value=p.nmvb_value)
            return
        if vb in self.streams and not self.streams[vb].done:
            await self.respond(op, f.opaque, Status.KEY_EEXISTS)
            return
        s, e = req.start_seqno, req.end_seqno
        if not (req.snap_start_seqno <= s <= req.snap_end_seqno) or s > e:
            await self.respond(op, f.opaque, Status.ERANGE)
            return
        r = h.needs_rollback(s, req.vb_uuid, req.snap_start_seqno, req.snap_end_seqno)
        if r is not None:
            await self.respond(op, f.opaque, Status.ROLLBACK, value=U64.pack(r))
            return
        if s > h.high:
            await self.respond(op, f.opaque, Status.ERANGE)
            return
        await self.respond(op, f.opaque, value=codec.failover_log_value(h.log))
        self.streams[vb] = ServerStream(self, h, f.opaque, s, e if e != SEQNO_MAX else SEQNO_MAX)
        self.poke()

    async def kv(self, f: Frame) -> None:
        p = self.producer
        op = f.opcode
        if p.kv_tmpfail > 0 and op != Opcode.GET:
            p.kv_tmpfail -= 1
            await self.respond(op, f.opaque, Status.ETMPFAIL)
            return
        h = p.vbs.get(f.vbucket)
        if h is None:
            await self.respond(op, f.opaque, Status.NOT_MY_VBUCKET)
            return
        key = bytes(f.key)
        docs = p.docs.setdefault(f.vbucket, {})
        if op == Opcode.GET:
            if key not in docs:
                await self.respond(op, f.opaque, Status.KEY_ENOENT)
            else:
                value, flags, cas = docs[key]
                await self.respond(
                    op, f.opaque, value=value, extras=struct.pack(">I", flags), cas=cas
                )
            return
        exists = key in docs
        if (op == Opcode.ADD and exists) or (op == Opcode.REPLACE and not exists):
            await self.respond(op, f.opaque, Status.KEY_EEXISTS if exists else Status.KEY_ENOENT)
            return
        if op == Opcode.DELETE:
            if not exists:
                await self.respond(op, f.opaque, Status.KEY_ENOENT)
                return
            del docs[key]
            snap = h.add_snapshot([Item(h.high + 1, key, kind="d")])
        else:
            flags, _exp = codec.parse_store_extras(f)
            snap = h.add_snapshot([Item(h.high + 1, key, bytes(f.value), flags=flags)])
        seqno = snap.end
        cas = seqno * 1000 + 1
        if op != Opcode.DELETE:
            docs[key] = (bytes(f.value), codec.parse_store_extras(f)[0], cas)
        extras = b""
        if HelloFeature.MUTATION_SEQNO in self.features:
            extras = codec.mutation_seqno_extras(h.log[0][0], seqno)
        p.wake_all()
        await self.respond(op, f.opaque, extras=extras, cas=cas)

    async def sender(self) -> None:
        p = self.producer
        while not self.closed:
            buf = bytearray()
            blocked = False
            progressed = True
            while progressed and len(buf) < 65536 and not blocked:
                progressed = False
                for st in list(self.streams.values()):
                    if self.window and self.outstanding >= self.window:
                        blocked = True
                        break
                    if not st.refill():
                        continue
                    frame, seqno = st.frames[0]
                    if seqno is not None:
                        fault = p.take_fault(st.vb, seqno)
                        if fault is not None:
                            await self.send(buf)
                            buf = bytearray()
                            await self.apply_fault(fault, st)
                            if self.closed or self.silenced:
                                return
                            progressed = True
                            continue
                    st.frames.popleft()
                    buf += frame
                    self.outstanding += len(frame)
                    p.max_outstanding = max(p.max_outstanding, self.outstanding)
                    p.bytes_sent += len(frame)
                    progressed = True
                    if st.done and not st.frames:
                        self.streams.pop(st.vb, None)
            if buf:
                await self.send(buf)
                continue
            self.wake = trio.Event()
            await self.wake.wait()

    async def apply_fault(self, fault: Fault, st: ServerStream) -> None:
        if fault.action == "disconnect":
            await self.close()
        elif fault.action == "silence":
            self.silenced = True
        elif fault.action == "stream_end":
            st.frames.clear()
            frame = codec.stream_end(st.vb, st.opaque, fault.reason)
            self.outstanding += len(frame)
            await self.send(frame)
            self.streams.pop(st.vb, None)

    async def noop_loop(self) -> None:
        while not self.closed:
            if not (self.noop_enabled and self.noop_interval):
                self.noop_changed = trio.Event()
                await self.noop_changed.wait()
                continue
            await trio.sleep(self.noop_interval)
            if self.silenced or self.closed or not self.producer.send_noops:
                continue
            self.noop_opaque += 1
            self.producer.noops_sent += 1
            await self.send(codec.request(Opcode.DCP_NOOP, opaque=self.noop_opaque))


@dataclass
class FakeProducer:
    """``async with FakeProducer() as p``: listens on 127.0.0.1:<p.port>."""

    vbs: dict[int, VbHistory] = field(default_factory=dict)
    stream_responses: dict[int, deque] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    refuse_controls: set[str] = field(default_factory=set)
    kv_tmpfail: int = 0
    send_noops: bool = True
    clamp_to_end: bool = True  # False: markers/items run past a stream's end seqno
    #: GET_CLUSTER_CONFIG's answer (None: UNKNOWN_COMMAND, as an old server)
    cluster_config: bytes | None = None
    #: the value of a NOT_MY_VBUCKET answer to a stream request (a cluster's config)
    nmvb_value: bytes = b""

    def __post_init__(self) -> None:
        self.port = 0
        self.connections: list[FakeConnection] = []
        self.accepted = 0
        self.frames: list[Frame] = []
        self.stream_requests: list[StreamRequestRecord] = []
        self.hello_features: list[list[int]] = []
        self.open_flags: list[int] = []
        self.controls: list[tuple[str, str]] = []
        self.acks: list[int] = []
        self.noop_replies = 0
        self.config_requests = 0
        self.noops_sent = 0
        self.client_noops = 0
        self.max_outstanding = 0
        self.bytes_sent = 0
        self.docs: dict[int, dict[bytes, tuple[bytes, int, int]]] = {}
        self._nursery: trio.Nursery | None = None

    def vb(self, vb: int, uuid: int | None = None) -> VbHistory:
        if vb not in self.vbs:
            self.vbs[vb] = VbHistory(vb, uuid if uuid is not None else 0xA000 + vb)
        return self.vbs[vb]

    def script(self, vb: int, *responses: tuple[str, int]) -> None:
        self.stream_responses.setdefault(vb, deque()).extend(responses)

    def fault(self, vb: int, seqno: int, action: str, **kw: Any) -> Fault:
        f = Fault(vb, seqno, action, **kw)
        self.faults.append(f)
        return f

    def take_fault(self, vb: int, seqno: int) -> Fault | None:
        for f in self.faults:
            if not f.fired and f.vb == vb and f.seqno == seqno:
                f.fired = True
                return f
        return None

    def wake_all(self) -> None:
        for c in self.connections:
            c.poke()

    def requests_for(self, vb: int) -> list[StreamRequestRecord]:
        return [r for r in self.stream_requests if r.vbucket == vb]

    async def drop_connections(self) -> None:
        for c in list(self.connections):
            await c.close()

    async def _serve(self, listener: trio.SocketListener) -> None:
        assert self._nursery is not None
        while True:
            stream = await listener.accept()
            self.accepted += 1
            conn = FakeConnection(self, stream)
            self.connections.append(conn)
            self._nursery.start_soon(conn.serve)

    async def __aenter__(self) -> FakeProducer:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        self._cm = trio.open_nursery()
        self._nursery = await self._cm.__aenter__()
        self._nursery.start_soon(self._serve, listeners[0])
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._nursery is not None
        self._nursery.cancel_scope.cancel()
        await self._cm.__aexit__(None, None, None)
