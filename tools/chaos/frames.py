"""Frames for the ``fuzz`` scenario: valid ones from the project's hypothesis strategies and
hand-written templates, and their mutations.

Rules of this module:
- Pure and fast (``random.Random`` only, no I/O): millions of frames per run.
- Mutations are of two kinds. *In-sync* ones keep each header's lengths consistent with
  the bytes sent (opcode, vbucket, datatype, cas, reshaped extras/key split, flipped body
  bytes, absurd stream-request seqnos), so the server must keep answering. *Breaking*
  ones (bad magic, lengths past the body, huge or short body lengths, truncation,
  garbage) may make it close that connection.
- A client rejecting a DCP data message makes the server close the connection (as
  Couchbase does); such frames are kept rare so most bursts are read to the end.
"""

from __future__ import annotations

import random
import struct

from dcp.protocol import codec
from dcp.protocol.opcodes import DcpOpenFlag, Opcode

__all__ = ["FrameFactory", "hypothesis_corpus"]

_CONTROL_KEYS = [
    "enable_noop",
    "set_noop_interval",
    "connection_buffer_size",
    "supports_cursor_dropping",
    "send_stream_end_on_client_close_stream",
    "enable_expiry_opcode",
    "change_streams",
    "set_priority",
    "stream_buffer_size",
    "bogus_key",
    "",
]
_STAT_GROUPS = [
    "",
    "vbucket",
    "vbucket-seqno",
    "vbucket-seqno 3",
    "vbucket-seqno 99999",
    "vbucket-seqno x",
    "failovers",
    "failovers 2",
    "checkpoint",
    "checkpoint 1",
    "dcp",
    "dcp-streams",
    "nope",
    "checkpoint -1",
    " " * 5,
]
_U64 = (1 << 64) - 1


def hypothesis_corpus(n: int, seed: int) -> list[bytes]:
    """``n`` valid frames drawn from the project's strategies (empty without hypothesis)."""
    try:
        from hypothesis import HealthCheck, given, settings
        from hypothesis import strategies as st

        from dcp.protocol import spec
        from tools.strategies import KINDS, untyped_frames
    except ImportError:
        return []
    out: list[bytes] = []
    kinds = st.one_of(*KINDS.values(), untyped_frames)

    @settings(
        max_examples=n,
        database=None,
        derandomize=False,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(fields=kinds)
    def draw(fields: dict) -> None:
        try:
            out.append(spec.build_frame(fields))
        except Exception:  # a combination the spec refuses to build: skip it
            pass

    rnd = random.getstate()
    random.seed(seed)
    try:
        draw()
    finally:
        random.setstate(rnd)
    return out


class FrameFactory:
    """Valid templates and their mutations, fast enough for millions of frames."""

    def __init__(self, rng: random.Random, num_vbuckets: int, corpus: list[bytes]) -> None:
        self.rng = rng
        self.nv = num_vbuckets
        self.corpus = corpus
        self.opaque = 0

    def _op(self) -> int:
        self.opaque = (self.opaque + 1) & 0x7FFFFFFF
        return self.opaque

    def _vb(self) -> int:
        r = self.rng.random()
        if r < 0.7:
            return self.rng.randrange(self.nv)
        return self.rng.choice([self.nv, 1023, 1024, 0xFFFF, self.rng.randrange(1 << 16)])

    def _seq(self) -> int:
        return self.rng.choice(
            [0, 1, 2, 5, 100, 10**6, _U64, _U64 - 1, 1 << 63, self.rng.randrange(1 << 64)]
        )

    def template(self) -> bytes:
        rng = self.rng
        op = self._op()
        k = rng.randrange(20)
        key = b"fz%x" % rng.randrange(1 << 20)
        if k == 0:
            return codec.hello("fz", [rng.randrange(0x40) for _ in range(rng.randrange(6))], op)
        if k == 1:
            return codec.request(rng.choice([Opcode.NOOP, Opcode.VERSION]), opaque=op)
        if k in (2, 3):
            vb = codec.vbucket_for_key(key, self.nv) if rng.random() < 0.6 else self._vb()
            return codec.request(Opcode.GET, vbucket=vb, opaque=op, key=key)
        if k in (4, 5, 6):
            vb = codec.vbucket_for_key(key, self.nv) if rng.random() < 0.6 else self._vb()
            fe = b""
            if rng.random() < 0.2:
                fe = (
                    codec.durability_frame_info(rng.randrange(6))
                    if rng.random() < 0.8
                    else bytes([0x10 | rng.randrange(16)]) + rng.randbytes(rng.randrange(4))
                )
            return codec.request(
                rng.choice([Opcode.SET, Opcode.ADD, Opcode.REPLACE]),
                vbucket=vb,
                opaque=op,
                cas=rng.choice([0, 0, 1, _U64]),
                extras=codec.store_extras(rng.randrange(1 << 32), rng.choice([0, 0, 1, 1 << 31])),
                key=key,
                value=rng.randbytes(rng.randrange(64)),
                framing_extras=fe,
                datatype=rng.choice([0, 0, 1, 7]),
            )
        if k == 7:
            vb = codec.vbucket_for_key(key, self.nv) if rng.random() < 0.6 else self._vb()
            return codec.request(Opcode.DELETE, vbucket=vb, opaque=op, key=key)
        if k == 8:
            return codec.request(Opcode.STAT, opaque=op, key=rng.choice(_STAT_GROUPS).encode())
        if k == 9:
            ext = rng.choice(
                [
                    b"",
                    struct.pack(">I", rng.randrange(6)),
                    struct.pack(">II", rng.randrange(6), rng.randrange(1 << 32)),
                    rng.randbytes(3),
                ]
            )
            return codec.request(Opcode.GET_ALL_VB_SEQNOS, opaque=op, extras=ext)
        if k == 10:
            name = b"fz-%x" % rng.randrange(1 << 32)
            flags = rng.choice([DcpOpenFlag.PRODUCER, 0, 2, 0x21, 0x49, rng.randrange(1 << 32)])
            return codec.request(
                Opcode.DCP_OPEN, opaque=op, extras=struct.pack(">II", 0, flags), key=name
            )
        if k == 11:
            return codec.request(
                Opcode.DCP_CONTROL,
                opaque=op,
                key=rng.choice(_CONTROL_KEYS).encode(),
                value=rng.choice(
                    [
                        b"true",
                        b"false",
                        b"0",
                        b"1048576",
                        b"-1",
                        b"0.05",
                        b"1e9",
                        b"high",
                        b"x" * 40,
                    ]
                ),
            )
        if k in (12, 13):
            s, e = self._seq(), self._seq()
            ss, se = rng.choice([(s, s), (self._seq(), self._seq()), (0, _U64)])
            value = rng.choice(
                [b"", b"", b'{"purge_seqno":"7"}', b"{", b"[1]", b'{"purge_seqno":[]}']
            )
            return codec.request(
                Opcode.DCP_STREAM_REQ,
                vbucket=self._vb(),
                opaque=op,
                extras=struct.pack(
                    ">IIQQQQQ",
                    rng.randrange(1 << 32) if rng.random() < 0.3 else 0,
                    0,
                    s,
                    e,
                    rng.randrange(1 << 64),
                    ss,
                    se,
                ),
                value=value,
            )
        if k == 14:
            return codec.request(
                rng.choice([Opcode.DCP_CLOSE_STREAM, Opcode.DCP_GET_FAILOVER_LOG]),
                vbucket=self._vb(),
                opaque=op,
            )
        if k == 15:
            return codec.buffer_ack(rng.randrange(1 << 32), op)
        if k == 16:  # a client sending producer-side messages
            return rng.choice(
                [
                    codec.mutation(self._vb(), op, self._seq(), 1, key, b"v"),
                    codec.deletion(self._vb(), op, self._seq(), 1, key),
                    codec.snapshot_marker(self._vb(), op, 5, 9, rng.randrange(64)),
                    codec.stream_end(self._vb(), op, rng.randrange(1 << 32)),
                    codec.seqno_advanced(self._vb(), op, self._seq()),
                ]
            )
        if k == 17:  # responses nobody asked for
            return codec.response(
                rng.choice(
                    [
                        Opcode.DCP_NOOP,
                        Opcode.DCP_MUTATION,
                        Opcode.DCP_STREAM_END,
                        Opcode.GET,
                        rng.randrange(256),
                    ]
                ),
                rng.choice([0, 0, 1, 0x23, rng.randrange(1 << 16)]),
                opaque=rng.randrange(1 << 32),
            )
        if k == 18:  # opcodes we do not speak
            return codec.request(
                rng.choice(
                    [
                        0x05,
                        0x06,
                        0x20,
                        0x51,
                        0x5A,
                        0x5B,
                        0x5F,
                        0x60,
                        0x89,
                        0xB5,
                        0xEE,
                        rng.randrange(256),
                    ]
                ),
                vbucket=self._vb(),
                opaque=op,
                key=key[: rng.randrange(4)],
                extras=rng.randbytes(rng.randrange(3)),
            )
        if self.corpus:
            return rng.choice(self.corpus)
        return codec.request(Opcode.NOOP, opaque=op)

    def mutate_in_sync(self, frame: bytes) -> bytes:
        """Change a frame without breaking the framing (lengths stay consistent)."""
        rng = self.rng
        b = bytearray(frame)
        opcode = b[1]
        body = struct.unpack_from(">I", b, 8)[0]
        for _ in range(rng.randint(1, 3)):
            m = rng.randrange(8)
            if m == 0:
                b[1] = rng.randrange(256)
            elif m == 1:
                struct.pack_into(">H", b, 6, rng.randrange(1 << 16))
            elif m == 2:
                b[5] = rng.randrange(256)
            elif m == 3 and len(b) > 24:
                i = rng.randrange(24, len(b))
                b[i] = rng.randrange(256)
            elif m == 4 and len(b) > 24:
                for _ in range(rng.randrange(1, 8)):
                    b[rng.randrange(24, len(b))] = rng.randrange(256)
            elif m == 5 and b[0] == 0x80:  # reshape: new extras/key split of the same body
                new_el = rng.randrange(min(body, 255) + 1)
                new_kl = rng.randrange(min(body - new_el, 0xFFFF) + 1)
                b[4] = new_el
                struct.pack_into(">H", b, 2, new_kl)
            elif m == 6:
                struct.pack_into(">Q", b, 16, rng.randrange(1 << 64))
            elif m == 7 and b[0] == 0x80 and len(b) >= 48 + 24 and opcode == 0x53:
                struct.pack_into(">QQ", b, 24 + 8, self._seq(), self._seq())
        return bytes(b)

    def breaking(self, frame: bytes) -> bytes:
        """A frame that breaks the byte stream (the server may close the connection)."""
        rng = self.rng
        b = bytearray(frame)
        m = rng.randrange(7)
        if m == 0:
            b[0] = rng.choice([0x00, 0x01, 0x7F, 0x90, 0xFF, 0x18, 0x83])
        elif m == 1:
            struct.pack_into(
                ">I",
                b,
                8,
                rng.choice([0xFFFFFFFF, 1 << 31, 20 * 1024 * 1024 + 5000, rng.randrange(1 << 32)]),
            )
        elif m == 2:
            struct.pack_into(">I", b, 8, len(b) - 24 + rng.randint(1, 64))  # body never comes
        elif m == 3:
            b[4] = 255
            struct.pack_into(">H", b, 2, 0xFFFF)
        elif m == 4:
            b = b[: rng.randrange(1, max(2, len(b)))]  # truncated
        elif m == 5:
            b = bytearray(rng.randbytes(rng.randrange(1, 64)))
        else:
            struct.pack_into(">I", b, 8, max(0, len(b) - 24 - rng.randint(1, 8)))  # short
        return bytes(b)

    def burst(self, n: int, break_it: bool) -> tuple[bytes, int]:
        """``n`` frames (in-sync), the last one breaking if ``break_it``; (bytes, frames)."""
        rng = self.rng
        parts = []
        for _ in range(n):
            f = self.template()
            if rng.random() < 0.5:
                f = self.mutate_in_sync(f)
            if (
                f[0] in (0x81, 0x18)
                and 0x55 <= f[1] <= 0x59
                and f[6:8] != b"\0\0"
                and rng.random() < 0.999
            ):
                # A client rejecting a data message makes the server close the connection
                # (as Couchbase does): keep that rare, or few frames would be read at all.
                f = f[:6] + b"\0\0" + f[8:]
            parts.append(f)
        if break_it:
            parts.append(self.breaking(self.template()))
        return b"".join(parts), len(parts)
