"""The ``--replay`` stand-in server of ``python -m tools.bench.spark`` (tools/bench/spark.py).

Rules of this module:
- It answers only what a Spark read needs (handshake, GET_ALL_VB_SEQNOS, failover logs,
  stream requests, close) and streams each requested vbucket from seqno 0 as
  pre-encoded memory snapshots, so a run measures the connector and Spark without the
  real server's disk backfill.
- It runs in its own process (``start_replay``), one thread per connection, and prints
  ``listening host=... port=N`` on stderr once it accepts connections.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def serve_replay(rows: int, vbuckets: int, value_size: int, snapshot: int) -> None:
    """The ``--replay`` stand-in server (run in its own process): answers the handshake,
    GET_ALL_VB_SEQNOS and failover-log requests, and streams each requested vbucket from
    seqno 0 as pre-encoded memory snapshots (only the opaque is patched per request)."""
    import socket

    from dcp.protocol import Frame, Opcode, ServerSession, codec
    from dcp.protocol.layout import U32

    per = {vb: rows // vbuckets + (1 if vb < rows % vbuckets else 0) for vb in range(vbuckets)}
    value = b"x" * value_size
    encoded: dict[int, tuple[bytes, list[int]]] = {}
    for vb in range(vbuckets):
        parts, offs, pos = [], [], 0
        for start in range(1, per[vb] + 1, snapshot):
            end = min(per[vb], start + snapshot - 1)
            for f in [codec.snapshot_marker(vb, 0, start, end, 0x05)] + [
                codec.mutation(
                    vb,
                    0,
                    i,
                    1,
                    b"doc%09d" % (i * vbuckets + vb),
                    value,
                    cas=1_700_000_000_000_000_000 + i,
                    flags=7,
                )
                for i in range(start, end + 1)
            ]:
                parts.append(f)
                offs.append(pos)
                pos += len(f)
        encoded[vb] = (b"".join(parts), offs)
    log = codec.failover_log_value([(0x1234, 0)])
    pack_into = U32.pack_into

    def handle(conn: socket.socket) -> None:
        session = ServerSession()  # frames requests; the client's answers are absorbed
        opaques: dict[int, int] = {}
        with conn:
            while True:
                try:
                    data = conn.recv(1 << 16)
                except OSError:
                    return
                if not data:
                    return
                for f in session.receive_data(data):
                    if not isinstance(f, Frame):
                        continue  # a refused DCP message: the replay does not care
                    op, o = f.opcode, f.opaque
                    if op == Opcode.GET_ALL_VB_SEQNOS:
                        out = codec.response(
                            op, opaque=o, value=codec.all_vb_seqnos_value(sorted(per.items()))
                        )
                    elif op in (Opcode.DCP_GET_FAILOVER_LOG,):
                        out = codec.response(op, opaque=o, value=log)
                    elif op == Opcode.DCP_CLOSE_STREAM:
                        out = codec.response(op, opaque=o) + codec.stream_end(
                            f.vbucket, opaques.get(f.vbucket, 0), 1
                        )
                    elif op == Opcode.DCP_STREAM_REQ:
                        opaques[f.vbucket] = o
                        raw, offs = encoded[f.vbucket]
                        buf = bytearray(raw)
                        for off in offs:
                            pack_into(buf, off + 12, o)
                        out = codec.response(op, opaque=o, value=log) + bytes(buf)
                    elif f.magic == 0x80 and op != Opcode.DCP_BUFFER_ACK:
                        out = codec.response(op, opaque=o)
                    else:
                        continue
                    try:
                        conn.sendall(out)
                    except OSError:
                        return

    srv = socket.create_server(("127.0.0.1", 0))
    print(f"listening host=127.0.0.1 port={srv.getsockname()[1]}", file=sys.stderr, flush=True)
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=handle, args=(conn,), daemon=True).start()


def start_replay(
    rows: int, vbuckets: int, value_size: int, snapshot: int
) -> tuple[subprocess.Popen, int]:
    code = (
        "from tools.bench.spark_replay import serve_replay; "
        f"serve_replay({rows}, {vbuckets}, {value_size}, {snapshot})"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, cwd=ROOT
    )  # ``-c`` puts the cwd first: ``tools`` imports from there
    assert proc.stderr is not None
    line = proc.stderr.readline()
    m = re.search(r"port=(\d+)", line)
    if not m:
        raise SystemExit(f"stand-in server did not start: {line}{proc.stderr.read()}")
    return proc, int(m.group(1))
