"""Framing: the 24-byte MCBP header, frames, and the incremental frame reader.

Rules of this module:
- Sans-I/O. ``FrameReader.feed`` takes bytes in any chunking; ``read_frames`` returns
  every complete frame and an empty list when it needs more data ("need more data" is a
  return value, not an exception).
- Every length in a header is untrusted. A header is validated (magic, extras + key +
  framing extras <= body, body <= ``max_body_size``) *before* the reader waits for its
  body, so an oversize frame is refused without buffering it.
- After a ``RemoteProtocolError`` the reader is broken for good: the stream position is
  unknown, so the only safe action for the caller is to answer/close that connection.
- Parsing many frames never copies the receive buffer per frame: frames are sliced out
  of one ``bytes`` object, and partial frames are joined once when complete.
"""

from __future__ import annotations

import struct

from .errors import LocalProtocolError, RemoteProtocolError
from .layout import ALT_HEADER, ALT_MAGIC, HEADER, HEADER_SIZE, KNOWN_MAGIC, RESPONSE_MAGIC

__all__ = [
    "DEFAULT_MAX_BODY_SIZE",
    "HEADER",
    "HEADER_SIZE",
    "Frame",
    "FrameReader",
    "encode_frame",
    "encode_frame_infos",
    "need_extras",
    "parse_frame_infos",
]


#: 20 MiB items plus room for key, extras and framing: the default body limit.
DEFAULT_MAX_BODY_SIZE = 20 * 1024 * 1024 + 4096

_KNOWN_MAGIC = KNOWN_MAGIC
_ALT_MAGIC = ALT_MAGIC
_RESPONSE_MAGIC = RESPONSE_MAGIC


class Frame:
    """One decoded frame. ``vbucket`` holds the status for responses (same header field).

    Slotted and built positionally by the reader (the hot path); treat as read-only.
    """

    __slots__ = (
        "cas",
        "datatype",
        "extras",
        "framing_extras",
        "key",
        "magic",
        "opaque",
        "opcode",
        "value",
        "vbucket",
    )

    def __init__(
        self,
        magic: int,
        opcode: int,
        datatype: int,
        vbucket: int,
        opaque: int,
        cas: int,
        framing_extras: bytes,
        extras: bytes,
        key: bytes,
        value: bytes,
    ) -> None:
        self.magic = magic
        self.opcode = opcode
        self.datatype = datatype
        self.vbucket = vbucket
        self.opaque = opaque
        self.cas = cas
        self.framing_extras = framing_extras
        self.extras = extras
        self.key = key
        self.value = value

    @property
    def status(self) -> int:
        """Response status (the vbucket field of a response header)."""
        return self.vbucket

    @property
    def is_response(self) -> bool:
        return self.magic in _RESPONSE_MAGIC

    @property
    def size(self) -> int:
        """Bytes this frame takes on the wire (what flow control counts)."""
        return (
            HEADER_SIZE
            + len(self.framing_extras)
            + len(self.extras)
            + len(self.key)
            + len(self.value)
        )

    def encode(self) -> bytes:
        return encode_frame(
            self.magic,
            self.opcode,
            vbucket=self.vbucket,
            opaque=self.opaque,
            cas=self.cas,
            datatype=self.datatype,
            framing_extras=self.framing_extras,
            extras=self.extras,
            key=self.key,
            value=self.value,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Frame):
            return NotImplemented
        return all(getattr(self, s) == getattr(other, s) for s in self.__slots__)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        kind = "status" if self.is_response else "vb"
        return (
            f"Frame(magic=0x{self.magic:02x}, opcode=0x{self.opcode:02x}, {kind}={self.vbucket}, "
            f"opaque={self.opaque}, cas={self.cas}, datatype={self.datatype}, "
            f"fe={bytes(self.framing_extras)!r}, extras={bytes(self.extras)!r}, "
            f"key={bytes(self.key)[:40]!r}, value={bytes(self.value)[:40]!r})"
        )


def need_extras(frame: Frame, size: int | tuple[int, ...], what: str) -> None:
    """Raise ``RemoteProtocolError`` unless ``frame``'s extras are ``size`` bytes long (or
    one of the sizes): parsers check before they unpack, never trusting the peer."""
    n = len(frame.extras)
    if (n != size) if isinstance(size, int) else (n not in size):
        raise RemoteProtocolError(f"{what}: extras length {n}, expected {size}")


def encode_frame(
    magic: int,
    opcode: int,
    *,
    vbucket: int = 0,
    opaque: int = 0,
    cas: int = 0,
    datatype: int = 0,
    framing_extras: bytes = b"",
    extras: bytes = b"",
    key: bytes = b"",
    value: bytes = b"",
) -> bytes:
    """Encode one frame. ``vbucket`` is the status field for responses.

    Raises:
        LocalProtocolError: a field does not fit its header slot, or framing extras are
            given with a magic that cannot carry them.
    """
    fel = len(framing_extras)
    el = len(extras)
    kl = len(key)
    body = fel + el + kl + len(value)
    if magic in _ALT_MAGIC:
        if kl > 0xFF or fel > 0xFF:
            raise LocalProtocolError("alt framing allows keys and framing extras of <= 255 bytes")
    elif fel:
        raise LocalProtocolError("framing extras need magic 0x08 or 0x18")
    elif kl > 0xFFFF:
        raise LocalProtocolError(f"key of {kl} bytes does not fit a 16-bit key length")
    if el > 0xFF:
        raise LocalProtocolError(f"extras of {el} bytes do not fit the 8-bit extras length")
    if body > 0xFFFFFFFF:
        raise LocalProtocolError("body larger than 4 GiB")
    try:
        if magic in _ALT_MAGIC:
            head = ALT_HEADER.pack(magic, opcode, fel, kl, el, datatype, vbucket, body, opaque, cas)
        else:
            head = HEADER.pack(magic, opcode, kl, el, datatype, vbucket, body, opaque, cas)
    except struct.error as exc:
        raise LocalProtocolError(f"header field out of range: {exc}") from exc
    return b"".join((head, framing_extras, extras, key, value))


def encode_frame_infos(infos: list[tuple[int, bytes]]) -> bytes:
    """Encode ``(id, payload)`` frame infos for alt framing (nibble escapes included)."""
    out = bytearray()
    for fid, data in infos:
        n = len(data)
        if fid < 0:
            raise LocalProtocolError(f"frame-info id {fid} is negative")
        if fid < 15 and n < 15:
            out.append((fid << 4) | n)
        else:
            first = (min(fid, 15) << 4) | min(n, 15)
            out.append(first)
            if fid >= 15:
                if fid - 15 > 0xFF:
                    raise LocalProtocolError("frame-info id too large")
                out.append(fid - 15)
            if n >= 15:
                if n - 15 > 0xFF:
                    raise LocalProtocolError("frame-info payload too large")
                out.append(n - 15)
        out += data
    return bytes(out)


def parse_frame_infos(data: bytes) -> list[tuple[int, bytes]]:
    """Decode framing extras into ``(id, payload)`` pairs.

    Raises:
        RemoteProtocolError: an object runs past the end of the framing extras.
    """
    out: list[tuple[int, bytes]] = []
    i, n = 0, len(data)
    while i < n:
        b = data[i]
        i += 1
        fid, ln = b >> 4, b & 0x0F
        if fid == 15:
            if i >= n:
                raise RemoteProtocolError("truncated frame-info id escape")
            fid = 15 + data[i]
            i += 1
        if ln == 15:
            if i >= n:
                raise RemoteProtocolError("truncated frame-info length escape")
            ln = 15 + data[i]
            i += 1
        if i + ln > n:
            raise RemoteProtocolError(
                f"frame info {fid} claims {ln} bytes, only {n - i} left in framing extras"
            )
        out.append((fid, bytes(data[i : i + ln])))
        i += ln
    return out


class FrameReader:
    """Incremental, bounded frame parser for one connection's byte stream.

    Resource handling: holds at most one incomplete frame (bounded by
    ``max_body_size`` + 24) plus whatever was fed since the last ``read_frames``.
    """

    __slots__ = ("_broken", "_buf", "_need", "_pending", "_pending_len", "_pos", "max_body_size")

    def __init__(self, max_body_size: int = DEFAULT_MAX_BODY_SIZE) -> None:
        self.max_body_size = max_body_size
        self._buf = b""
        self._pos = 0
        self._pending: list[bytes] = []
        self._pending_len = 0
        self._need = HEADER_SIZE  # bytes (from _pos) needed before parsing can progress
        self._broken: str | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as frames."""
        return len(self._buf) - self._pos + self._pending_len

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._broken is not None:
            raise RemoteProtocolError(f"stream already broken: {self._broken}")
        if data:
            self._pending.append(bytes(data))
            self._pending_len += len(data)

    def _fail(self, why: str) -> RemoteProtocolError:
        self._broken = why
        return RemoteProtocolError(why)

    def read_frames(self) -> list[Frame]:
        """Return every complete frame buffered so far (possibly an empty list).

        Raises:
            RemoteProtocolError: bad magic, inconsistent lengths or an oversize body.
        """
        if self._broken is not None:
            raise RemoteProtocolError(f"stream already broken: {self._broken}")
        avail = len(self._buf) - self._pos + self._pending_len
        if avail < self._need:
            return []
        if self._pending:
            rest = self._buf[self._pos :] if self._pos < len(self._buf) else b""
            if rest:
                self._pending.insert(0, rest)
            buf = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
            self._pending = []
            self._pending_len = 0
        else:
            buf = self._buf
        pos = self._pos if buf is self._buf else 0
        n = len(buf)
        out: list[Frame] = []
        append = out.append
        unpack = HEADER.unpack_from
        max_body = self.max_body_size
        while n - pos >= HEADER_SIZE:
            magic, opcode, kl, el, dt, vb, body, opaque, cas = unpack(buf, pos)
            if magic in _ALT_MAGIC:
                fel = kl >> 8
                kl &= 0xFF
            elif magic in _KNOWN_MAGIC:
                fel = 0
            else:
                self._buf, self._pos = buf, pos
                raise self._fail(f"bad magic 0x{magic:02x} at opcode 0x{opcode:02x}")
            if body > max_body:
                self._buf, self._pos = buf, pos
                raise self._fail(
                    f"body of {body} bytes exceeds the limit of {max_body} (opcode 0x{opcode:02x})"
                )
            if fel + el + kl > body:
                self._buf, self._pos = buf, pos
                raise self._fail(
                    f"framing extras {fel} + extras {el} + key {kl} exceed body length {body} "
                    f"(opcode 0x{opcode:02x})"
                )
            end = pos + HEADER_SIZE + body
            if end > n:
                self._need = HEADER_SIZE + body
                break
            a = pos + HEADER_SIZE
            if fel:
                fe = buf[a : a + fel]
                a += fel
            else:
                fe = b""
            b = a + el
            c = b + kl
            append(Frame(magic, opcode, dt, vb, opaque, cas, fe, buf[a:b], buf[b:c], buf[c:end]))
            pos = end
        else:
            self._need = HEADER_SIZE
        if pos >= n:
            self._buf, self._pos = b"", 0
        elif pos:
            # Keep only the unparsed tail (< one frame), not the consumed frames before it:
            # retained memory stays within max_body_size + 24 plus what the next feed adds.
            self._buf, self._pos = buf[pos:], 0
        else:
            self._buf, self._pos = buf, 0
        return out
