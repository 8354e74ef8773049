"""A deliberately small raw-wire client for server tests (independent of the SDK).

It speaks only through ``dcp.protocol`` builders and a ``RawSession`` (the client session's
framing, which hands out every frame and acts on none), so a server test fails on the
server's bytes, not on SDK behaviour: noops, acks and opaques are this client's business.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable

import trio

from dcp.protocol import DcpOpenFlag, Frame, Opcode, Status, codec
from dcp.protocol.raw_session import RawSession


class WireClient:
    def __init__(self, stream: trio.SocketStream, num_vbuckets: int) -> None:
        self.stream = stream
        self.num_vbuckets = num_vbuckets
        self.session = RawSession()
        self.stash: deque[Frame] = deque()
        self.opaques = itertools.count(1000)
        self.eof = False
        self.acked = 0

    @classmethod
    async def connect(cls, port: int, num_vbuckets: int = 4) -> WireClient:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        return cls(stream, num_vbuckets)

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def _fill(self) -> bool:
        data = await self.stream.receive_some(1 << 16)
        if not data:
            self.eof = True
            return False
        self.stash.extend(self.session.receive_data(data))
        return True

    async def next_frame(self, timeout: float = 5.0) -> Frame:
        with trio.fail_after(timeout):
            while not self.stash:
                if not await self._fill():
                    raise EOFError("server closed the connection")
            return self.stash.popleft()

    async def wait_closed(self, timeout: float = 5.0) -> None:
        """Read until EOF (asserting the server closes us)."""
        with trio.fail_after(timeout):
            try:
                while await self._fill():
                    pass
            except trio.BrokenResourceError:
                self.eof = True

    async def frames_for(self, timeout: float) -> list[Frame]:
        """Everything that arrives within ``timeout`` seconds (stash included)."""
        out = list(self.stash)
        self.stash.clear()
        with trio.move_on_after(timeout):
            while await self._fill():
                out.extend(self.stash)
                self.stash.clear()
        return out

    async def call(self, frame: bytes, opaque: int, timeout: float = 5.0) -> Frame:
        """Send a request and return its response; other frames stay stashed."""
        await self.send(frame)
        with trio.fail_after(timeout):
            while True:
                for i, f in enumerate(self.stash):
                    if f.is_response and f.opaque == opaque:
                        del self.stash[i]
                        return f
                if not await self._fill():
                    raise EOFError("server closed the connection")

    def vb(self, key: bytes) -> int:
        return codec.vbucket_for_key(key, self.num_vbuckets)

    # ---- KV
    async def hello(self, features: list[int]) -> list[int]:
        op = next(self.opaques)
        r = await self.call(codec.hello("wire-test", features, op), op)
        assert r.status == Status.SUCCESS
        return codec.parse_hello_features(r.value)

    async def store(
        self,
        opcode: int,
        key: bytes,
        value: bytes,
        *,
        cas: int = 0,
        flags: int = 0,
        expiry: int = 0,
        durability: int | None = None,
        vb: int | None = None,
    ) -> Frame:
        op = next(self.opaques)
        fe = codec.durability_frame_info(durability) if durability is not None else b""
        frame = codec.request(
            opcode,
            vbucket=self.vb(key) if vb is None else vb,
            opaque=op,
            cas=cas,
            extras=codec.store_extras(flags, expiry),
            key=key,
            value=value,
            framing_extras=fe,
        )
        return await self.call(frame, op)

    async def set(self, key: bytes, value: bytes, **kw: int) -> Frame:
        r = await self.store(Opcode.SET, key, value, **kw)
        assert r.status == Status.SUCCESS, (key, r)
        return r

    async def set_many(self, pairs: list[tuple[bytes, bytes]]) -> list[Frame]:
        """Pipelined SETs: one write, then every response in order."""
        ops = []
        buf = bytearray()
        for k, v in pairs:
            op = next(self.opaques)
            ops.append(op)
            buf += codec.request(
                Opcode.SET,
                vbucket=self.vb(k),
                opaque=op,
                extras=codec.store_extras(0, 0),
                key=k,
                value=v,
            )
        await self.send(bytes(buf))
        out = []
        others: list[Frame] = []
        for op in ops:
            f = await self.next_frame()
            while not (f.is_response and f.opcode == Opcode.SET):
                others.append(f)  # stream traffic interleaved with the answers
                f = await self.next_frame()
            assert f.opaque == op, (f, op)
            assert f.status == Status.SUCCESS, f
            out.append(f)
        self.stash.extendleft(reversed(others))
        return out

    async def delete(self, key: bytes, cas: int = 0) -> Frame:
        op = next(self.opaques)
        return await self.call(
            codec.request(Opcode.DELETE, vbucket=self.vb(key), opaque=op, cas=cas, key=key), op
        )

    async def get(self, key: bytes) -> Frame:
        op = next(self.opaques)
        return await self.call(
            codec.request(Opcode.GET, vbucket=self.vb(key), opaque=op, key=key), op
        )

    async def stats(self, group: str = "") -> dict[str, str]:
        op = next(self.opaques)
        await self.send(codec.request(Opcode.STAT, opaque=op, key=group.encode()))
        out: dict[str, str] = {}
        others: list[Frame] = []
        while True:
            f = await self.next_frame()
            if not (f.is_response and f.opaque == op and f.opcode == Opcode.STAT):
                others.append(f)  # stream traffic interleaved with the STAT answer
                continue
            if f.status != Status.SUCCESS:
                raise AssertionError(f"STAT {group!r} failed: {f}")
            if not f.key:
                self.stash.extendleft(reversed(others))
                return out
            out[bytes(f.key).decode()] = bytes(f.value).decode()

    # ---- DCP
    async def dcp_open(self, name: str, flags: int = DcpOpenFlag.PRODUCER) -> Frame:
        op = next(self.opaques)
        return await self.call(codec.dcp_open(name, flags, op), op)

    async def control(self, key: str, value: str) -> Frame:
        op = next(self.opaques)
        return await self.call(codec.dcp_control(key, value, op), op)

    async def stream_req(
        self,
        vb: int,
        *,
        start: int = 0,
        end: int = 2**64 - 1,
        uuid: int = 0,
        snap_start: int | None = None,
        snap_end: int | None = None,
        flags: int = 0,
        opaque: int | None = None,
    ) -> Frame:
        op = next(self.opaques) if opaque is None else opaque
        frame = codec.stream_request(
            vb,
            op,
            flags=flags,
            start=start,
            end=end,
            vb_uuid=uuid,
            snap_start=start if snap_start is None else snap_start,
            snap_end=start if snap_end is None else snap_end,
        )
        return await self.call(frame, op)

    async def ack_all(self, frames: list[Frame]) -> None:
        n = sum(f.size for f in frames if not f.is_response and f.opcode != Opcode.DCP_NOOP)
        if n:
            self.acked += n
            await self.send(codec.buffer_ack(n))

    async def read_stream_until(
        self, pred: Callable[[Frame], bool], timeout: float = 10.0, ack: bool = False
    ) -> list[Frame]:
        """Read producer frames until ``pred(frame)``; answers noops; optionally acks."""
        out: list[Frame] = []
        with trio.fail_after(timeout):
            while True:
                f = await self.next_frame(timeout)
                if f.opcode == Opcode.DCP_NOOP and not f.is_response:
                    await self.send(codec.response(Opcode.DCP_NOOP, opaque=f.opaque))
                    continue
                out.append(f)
                if ack:
                    await self.ack_all([f])
                if pred(f):
                    return out


def items_of(frames: list[Frame]) -> list[tuple[int, int, bytes, bytes]]:
    """(opcode, seqno, key, value) of every data frame, in arrival order."""
    out = []
    for f in frames:
        if f.opcode == Opcode.DCP_MUTATION:
            out.append((f.opcode, codec.parse_mutation(f)[0], bytes(f.key), bytes(f.value)))
        elif f.opcode == Opcode.DCP_DELETION:
            out.append((f.opcode, codec.parse_deletion(f)[0], bytes(f.key), b""))
        elif f.opcode == Opcode.DCP_EXPIRATION:
            out.append((f.opcode, codec.parse_expiration(f)[0], bytes(f.key), b""))
    return out


def markers_of(frames: list[Frame]) -> list[tuple[int, int, int]]:
    return [
        codec.parse_snapshot_marker(f)[:3] for f in frames if f.opcode == Opcode.DCP_SNAPSHOT_MARKER
    ]


def keys_for_vb(vb: int, n: int, num_vbuckets: int, prefix: str = "k") -> list[bytes]:
    """The first ``n`` keys ``prefix-<i>`` that map to ``vb``."""
    out = []
    i = 0
    while len(out) < n:
        k = f"{prefix}-{i}".encode()
        if codec.vbucket_for_key(k, num_vbuckets) == vb:
            out.append(k)
        i += 1
    return out
