"""The connection under ``KvClient``: one socket, pipelined requests, answers matched
by opaque.

Rules of this module:
- ``roundtrip`` encodes a batch into one buffer with each request's opaque patched in
  (requests are encoded once with opaque 0: a retry re-sends the same bytes) and makes
  one ``send_all``; one reader task matches the answers by opaque straight from the
  received bytes. A successful mutation answer (the bulk of pipelined writes) becomes a
  ``(cas, vb_uuid, seqno)`` tuple, any other answer a ``Frame``; ``Batch.others`` counts
  those, so a batch that only succeeded needs no per-answer inspection.
- Every received header is validated before its body is awaited (the limits of
  ``dcp.protocol.FrameReader``); a frame that breaks the protocol fails the connection
  with ``RemoteProtocolError``. A failed connection fails every waiting batch (their
  answers become None) and every later call; ``KvClient`` decides what may be retried.
"""

from __future__ import annotations

import struct
from typing import Any

import trio

from dcp.protocol.errors import RemoteProtocolError
from dcp.protocol.frames import DEFAULT_MAX_BODY_SIZE, Frame
from dcp.protocol.opcodes import Magic

from .errors import ConnectionLostError

__all__ = ["Batch", "KvConnection", "Op"]

_HDR = struct.Struct(">BBHBBHIIQ").unpack_from
_SEQNO = struct.Struct(">QQ").unpack_from  # MUTATION_SEQNO extras: vb_uuid, seqno
_put_opaque = struct.Struct(">I").pack_into
_KNOWN_MAGIC = frozenset(int(m) for m in Magic)
_ALT_MAGIC = frozenset((int(Magic.ALT_REQUEST), int(Magic.ALT_RESPONSE)))


class Op:
    __slots__ = ("frame", "key", "opcode", "safe_to_repeat", "vbucket")

    def __init__(self, opcode: int, key: bytes, vbucket: int, frame: bytes,
                 safe_to_repeat: bool) -> None:
        self.opcode = opcode
        self.key = key
        self.vbucket = vbucket
        self.frame = frame  # the encoded request, opaque 0 (patched per attempt)
        self.safe_to_repeat = safe_to_repeat


class Batch:
    __slots__ = ("event", "frames", "others", "remaining")

    def __init__(self, n: int) -> None:
        self.frames: list[Frame | None] = [None] * n
        self.remaining = n
        self.others = 0  # answers that are not a successful write's tuple
        self.event = trio.Event()


class KvConnection:
    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.lock = trio.StrictFIFOLock()
        self.waiting: dict[int, tuple[Batch, int]] = {}
        self.opaque = 0
        self.error: BaseException | None = None
        self.features: set[int] = set()
        self.closed = trio.Event()

    async def read_loop(self) -> None:
        try:
            pending = b""
            waiting = self.waiting
            while True:
                data = await self.stream.receive_some(256 * 1024)
                if not data:
                    raise ConnectionLostError("the server closed the connection")
                buf = pending + data if pending else bytes(data)
                n = len(buf)
                pos = 0
                while n - pos >= 24:
                    magic, op, kl, el, dt, status, body, opq, cas = _HDR(buf, pos)
                    if magic in _ALT_MAGIC:
                        fel = kl >> 8
                        kl &= 0xFF
                    elif magic in _KNOWN_MAGIC:
                        fel = 0
                    else:
                        raise RemoteProtocolError(f"bad magic 0x{magic:02x}")
                    if body > DEFAULT_MAX_BODY_SIZE or fel + el + kl > body:
                        raise RemoteProtocolError(f"bad lengths in an answer to 0x{op:02x}")
                    end = pos + 24 + body
                    if end > n:
                        break
                    entry = waiting.pop(opq, None)
                    if entry is not None:
                        batch, idx = entry
                        if status == 0 and magic == 0x81 and body == el == 16:
                            res: Any = (cas, *_SEQNO(buf, pos + 24))
                        elif status == 0 and magic == 0x81 and body == 0:
                            res = (cas, None, None)
                        else:
                            a = pos + 24
                            b = a + fel
                            c = b + el
                            d = c + kl
                            res = Frame(magic, op, dt, status, opq, cas, buf[a:b], buf[b:c],
                                        buf[c:d], buf[d:end])
                            batch.others += 1
                        batch.frames[idx] = res
                        batch.remaining -= 1
                        if batch.remaining == 0:
                            batch.event.set()
                    pos = end
                pending = buf[pos:] if pos < n else b""
        except Exception as exc:
            self.fail(exc if isinstance(exc, ConnectionLostError)
                      else ConnectionLostError(f"connection failed: {exc!r}"))
        finally:
            await trio.aclose_forcefully(self.stream)

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        for batch, _ in self.waiting.values():
            batch.event.set()
        self.waiting.clear()
        self.closed.set()

    async def roundtrip(self, ops: list[Op]) -> list[Frame | None]:
        """One write for all ``ops``; their responses (None where the connection died)."""
        return (await self.roundtrip_batch(ops)).frames

    async def roundtrip_batch(self, ops: list[Op]) -> Batch:
        """``roundtrip``, returning the whole ``Batch`` (its answers and their counts)."""
        if self.error is not None:
            raise self.error
        batch = Batch(len(ops))
        buf = bytearray()
        waiting = self.waiting
        opaque = self.opaque
        for i, op in enumerate(ops):
            opaque = (opaque + 1) & 0xFFFFFFFF or 1
            waiting[opaque] = (batch, i)
            p = len(buf)
            buf += op.frame
            _put_opaque(buf, p + 12, opaque)
        self.opaque = opaque
        try:
            async with self.lock:
                await self.stream.send_all(buf)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self.fail(ConnectionLostError(f"send failed: {exc!r}"))
        await batch.event.wait()
        return batch
