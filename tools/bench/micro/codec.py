"""Encode/decode rates of DCP_MUTATION frames: the struct codec against the construct spec.

Usage:
    python -m tools.bench.micro.codec              # default n, about 10-20 s on a 2-core box
    python -m tools.bench.micro.codec --n 1000     # smoke run, about 1 s

Frames are shaped like a typical small document: 24-byte header, 31-byte extras, 16-byte key,
83-byte value (154 bytes). "fast" encodes with ``codec.mutation`` and decodes a 64 KiB-chunked
stream with ``FrameReader`` + ``codec.parse_mutation``; "construct" builds and parses one
frame at a time with ``spec.Frame`` (plain) and ``spec.Frame.compile()``. A benchmark, not a
test: numbers go to protocol_spec/README.md ("Performance") with the command that made them.
"""

from __future__ import annotations

import argparse
import gc
import platform
import sys
import time
from collections.abc import Callable

import construct

from dcp.protocol import codec, spec
from dcp.protocol.frames import FrameReader
from dcp.protocol.opcodes import Datatype, Magic, Opcode

DEFAULT_N = 100_000
CHUNK = 64 * 1024
VALUE = b'{"v":"' + b"x" * 75 + b'"}'  # 83 bytes


def _items(n: int) -> list[tuple[int, bytes]]:
    return [(i + 1, b"key-%012d" % i) for i in range(n)]


def _fields(seqno: int, key: bytes) -> dict:
    return {
        "magic": int(Magic.REQUEST),
        "opcode": int(Opcode.DCP_MUTATION),
        "vbucket": 5,
        "opaque": 0x2A,
        "cas": seqno << 16,
        "datatype": int(Datatype.JSON),
        "extras": {"by_seqno": seqno, "rev_seqno": 1, "flags": 0, "expiration": 0, "lock_time": 0},
        "key": key,
        "value": VALUE,
    }


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        result = fn()
        return time.perf_counter() - start, result
    finally:
        gc.enable()


def fast_encode(items: list[tuple[int, bytes]]) -> list[bytes]:
    mutation = codec.mutation
    return [mutation(5, 0x2A, s, 1, k, VALUE, cas=s << 16, datatype=1) for s, k in items]


def fast_decode(stream: bytes) -> list[tuple]:
    reader = FrameReader()
    parse = codec.parse_mutation
    out = []
    for i in range(0, len(stream), CHUNK):
        reader.feed(stream[i : i + CHUNK])
        out.extend((parse(f), f.key, f.value) for f in reader.read_frames())
    return out


def construct_encode(frame: construct.Construct, fields: list[dict]) -> list[bytes]:
    return [spec.build_frame(f, frame) for f in fields]


def construct_decode(frame: construct.Construct, frames: list[bytes]) -> list:
    parse = frame.parse
    return [parse(b) for b in frames]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.bench.micro.codec", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--n", type=int, default=DEFAULT_N, help=f"frames (default {DEFAULT_N})")
    n = ap.parse_args(argv).n
    items = _items(n)
    fields = [_fields(s, k) for s, k in items]

    t_compile, compiled = _timed(spec.Frame.compile)
    rows: dict[str, tuple[float, float]] = {}
    t_enc, frames = _timed(lambda: fast_encode(items))
    stream = b"".join(frames)
    t_dec, decoded = _timed(lambda: fast_decode(stream))
    assert len(decoded) == n and decoded[-1][0][0] == n
    rows["fast (struct: codec.py + FrameReader)"] = (t_enc, t_dec)
    for name, frame in (("construct compiled", compiled), ("construct plain", spec.Frame)):
        t_enc, built = _timed(lambda frame=frame: construct_encode(frame, fields))
        assert built == frames, f"{name} built different bytes"
        t_dec, parsed = _timed(lambda frame=frame: construct_decode(frame, frames))
        assert parsed[-1].extras.by_seqno == n
        rows[name] = (t_enc, t_dec)

    print(
        f"DCP_MUTATION frames: n={n}, {len(frames[0])} bytes each; Python "
        f"{platform.python_version()}, construct {construct.__version__}; "
        f"spec.Frame.compile() took {t_compile:.2f} s"
    )
    print(f"{'codec':40} {'encode frames/s':>16} {'decode frames/s':>16}")
    for name, (te, td) in rows.items():
        print(f"{name:40} {n / te:16,.0f} {n / td:16,.0f}")
    fe, fd = rows["fast (struct: codec.py + FrameReader)"]
    for name in ("construct compiled", "construct plain"):
        ce, cd = rows[name]
        print(f"{'fast / ' + name:40} {ce / fe:15.1f}x {cd / fd:15.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
