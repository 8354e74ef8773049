"""A real end-to-end session captured with tshark; Wireshark's couchbase dissector must
decode every frame the server sends with no malformed packet and no warning."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
import trio

from dcp.protocol import DcpOpenFlag, HelloFeature, Opcode, codec

from .conftest import client_of, running_server
from .wire import items_of, keys_for_vb

pytestmark = pytest.mark.tshark

# Dissector quirks that are not defects of our frames (protocol_spec/README.md,
# "Checking with Wireshark"):
# error responses without a value, and the failover-log "trailing stray characters".
ALLOWED = (
    "Stream Request: Rollback",
    "No DCP Stream",
    "must have Value",
    "Trailing stray characters",
)


def _tshark(*args: str) -> str:
    return subprocess.run(["tshark", *args], capture_output=True, text=True, timeout=60).stdout


@pytest.fixture
def capture(tmp_path: Path):  # type: ignore[no-untyped-def]
    if shutil.which("tshark") is None:
        pytest.skip("tshark is not installed (make test installs it when run as root)")
    if os.geteuid() != 0:
        pytest.skip("capturing on loopback needs root")
    procs = []

    def start(port: int) -> Path:
        pcap = tmp_path / "session.pcap"
        printed = tmp_path / "tshark.out"
        err = open(tmp_path / "tshark.err", "w")
        out = open(printed, "w")
        # -P -l: also print one flushed line per packet, so we can see capture is live.
        p = subprocess.Popen(
            ["tshark", "-i", "lo", "-f", f"tcp port {port}", "-P", "-l", "-w", str(pcap)],
            stdout=out,
            stderr=err,
        )
        procs.append((p, err))
        procs.append((None, out))
        # "Capturing on" is printed before packets are really seen: probe with empty
        # connections (no payload, so nothing for the couchbase judgement) until one shows.
        deadline = time.monotonic() + 20
        while printed.stat().st_size == 0:
            if time.monotonic() > deadline or p.poll() is not None:
                pytest.skip(
                    "tshark could not start capturing: "
                    + (tmp_path / "tshark.err").read_text()[-300:]
                )
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            time.sleep(0.05)
        return pcap

    yield start
    for p, f in procs:
        if p is not None:
            time.sleep(0.5)
            p.send_signal(2)
            p.wait(10)
        f.close()


async def test_end_to_end_session_capture_is_judged_clean(tmp_path, capture) -> None:
    async with running_server(
        tmp_path / "d", checkpoint_max_items=5, checkpoint_retain_seconds=0, tombstone_purge_age=0
    ) as server:
        pcap = capture(server.port)
        async with client_of(server) as c:
            await c.hello([HelloFeature.XERROR, HelloFeature.JSON, HelloFeature.MUTATION_SEQNO])
            keys = keys_for_vb(1, 12, 4)
            for k in keys[:8]:
                await c.set(k, b'{"v":1}')
            await c.delete(keys[0])
            await server.flush_all()
            await c.dcp_open("tshark", DcpOpenFlag.PRODUCER)
            await c.control("connection_buffer_size", "65536")
            await c.control("enable_noop", "true")
            await c.control("set_noop_interval", "0.2")
            r = await c.stream_req(1, end=9)
            uuid = codec.parse_failover_log(r.value)[0][0]
            frames = await c.read_stream_until(
                lambda f: f.opcode == Opcode.DCP_STREAM_END, ack=True
            )
            await c.stream_req(2, start=3, uuid=99, snap_start=3, snap_end=3)  # rollback answer
            await c.stream_req(1, start=9, uuid=uuid, snap_start=9, snap_end=9)
            await trio.sleep(0.5)  # at least one noop
            await c.frames_for(0.3)
            op = next(c.opaques)
            await c.call(codec.request(Opcode.DCP_GET_FAILOVER_LOG, vbucket=1, opaque=op), op)
            await c.stats("vbucket-seqno 1")
        async with client_of(server) as c:  # a disk snapshot ending in a purged tombstone
            k3 = keys_for_vb(3, 3, 4)
            await c.set_many([(k, b"x") for k in k3])
            await c.delete(k3[0])
            await server.flush_all()
            server.bucket.vbucket(3).checkpoints.create_checkpoint()
            await server.flush_all()
            await trio.sleep(0.01)
            assert await server.persistence.compact_now() >= 1
            await c.dcp_open("tshark-adv", DcpOpenFlag.PRODUCER)
            await c.control("send_seqno_advanced", "true")
            await c.stream_req(3)
            await c.read_stream_until(lambda f: f.opcode == Opcode.DCP_SEQNO_ADVANCED)
        await trio.sleep(0.3)
    d = ["-d", f"tcp.port=={server.port},couchbase"]
    await trio.to_thread.run_sync(time.sleep, 0.6)
    malformed = _tshark("-r", str(pcap), *d, "-Y", "_ws.malformed")
    assert not malformed.strip(), malformed
    expert = _tshark("-r", str(pcap), *d, "-q", "-z", "expert,warn")
    bad = [
        ln for ln in expert.splitlines() if "Couchbase" in ln and not any(a in ln for a in ALLOWED)
    ]
    assert not bad, "\n".join(bad)
    undissected = _tshark("-r", str(pcap), *d, "-Y", "tcp.len>0 && !couchbase")
    assert not undissected.strip(), undissected
    fields = _tshark(
        "-r",
        str(pcap),
        *d,
        "-Y",
        "couchbase",
        "-T",
        "fields",
        "-E",
        "occurrence=a",
        "-E",
        "aggregator=,",
        "-e",
        "couchbase.opcode",
        "-e",
        "couchbase.extras.by_seqno",
    )
    opcodes = {
        int(x, 16) for line in fields.splitlines() for x in line.split("\t")[0].split(",") if x
    }
    for op in (
        Opcode.DCP_OPEN,
        Opcode.DCP_CONTROL,
        Opcode.DCP_STREAM_REQ,
        Opcode.DCP_SNAPSHOT_MARKER,
        Opcode.DCP_MUTATION,
        Opcode.DCP_DELETION,
        Opcode.DCP_STREAM_END,
        Opcode.DCP_BUFFER_ACK,
        Opcode.DCP_NOOP,
        Opcode.SET,
        Opcode.STAT,
        Opcode.HELLO,
        Opcode.DCP_GET_FAILOVER_LOG,
        Opcode.DCP_SEQNO_ADVANCED,
    ):
        assert op in opcodes, f"opcode 0x{op:02x} missing from the capture"
    seqnos = {
        int(x)
        for line in fields.splitlines()
        if "\t" in line
        for x in line.split("\t")[1].split(",")
        if x
    }
    assert {s for _, s, _, _ in items_of(frames)} <= seqnos
