"""Wireshark's couchbase dissector judges our frames on a real loopback TCP exchange.

A client socket sends requests built by ``codec``; a plain-socket fake server answers and
streams DCP messages, all built by ``codec``. tshark captures the exchange; then we require
what a clean capture needs (no malformed frame, no couchbase expert warning
beyond the known dissector quirks, no undissected payload) and that tshark reads back the
field values we meant (protocol_spec/README.md, "Checking with Wireshark").

Known dissector quirks we allow, each only on the frames where it is expected:
- every non-success status is reported as an expert warning "<Command>: <Status>";
- a GET error response (no extras, as memcached sends it) gets "Get Response must have Extras";
- binary values (failover log, vbucket seqnos, rollback seqno, GET_VBUCKET's state) get a
  tree-only "Trailing stray characters" (the value is also shown as a string);
- the ROLLBACK value, the STREAM_END extras and GET_VBUCKET's value are not decoded: we
  check their bytes instead; the 1-byte state extras of SET_VBUCKET_STATE and
  DCP_SET_VBUCKET_STATE are shown as raw "Unknown" extras (we compare those bytes);
- DCP_SEQNO_ACKNOWLEDGED (0x61) is decoded with its 8-byte extras as ``by_seqno``; its
  optional 8-byte value (the persisted seqno, our extension) gets the tree-only
  "Trailing stray characters" like the binary values above: we check its bytes;
- the durability frame info shows the level (our level 4 PERSIST_TO_ACTIVE as
  "Unknown (4)", with no warning) but not the timeout after it: we check those bytes;
- ``couchbase.opaque`` is shown little-endian: we never compare it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from dcp.protocol import codec
from dcp.protocol.frames import FrameReader
from dcp.protocol.opcodes import (
    Datatype,
    DcpOpenFlag,
    DurabilityLevel,
    HelloFeature,
    Opcode,
    SnapshotMarkerFlag,
    Status,
    StreamEndStatus,
    StreamRequestFlag,
    VBucketState,
)

pytestmark = pytest.mark.tshark

TSHARK = shutil.which("tshark")
UUID_A, UUID_B = 0x1122334455667788, 0xAABBCCDDEEFF0011
FAILOVER = [(UUID_A, 100), (UUID_B, 0)]
STRAY = "Trailing stray characters"


@dataclass
class Step:
    sender: str  # "client" or "server"
    data: bytes
    fields: dict[str, str] = field(default_factory=dict)  # tshark field -> shown value
    experts: frozenset[str] = frozenset()  # expert messages allowed on this frame


def c(data: bytes, experts: tuple[str, ...] = (), **fields: str) -> Step:
    return Step("client", data, _names(fields), frozenset(experts))


def s(data: bytes, experts: tuple[str, ...] = (), **fields: str) -> Step:
    return Step("server", data, _names(fields), frozenset(experts))


def _names(fields: dict[str, str]) -> dict[str, str]:
    """``extras__by_seqno`` -> ``couchbase.extras.by_seqno``."""
    return {"couchbase." + k.replace("__", "."): v for k, v in fields.items()}


def h(v: int, width: int) -> str:
    return f"0x{v:0{width}x}"


def exchange() -> list[Step]:
    """A session in the order a real client meets it: every frame kind we speak."""
    mut_extras = codec.MUTATION_EXTRAS.pack(6, 2, 0, 0, 0, 0, 0)
    return [
        c(
            codec.hello(
                "dcp-sdk/0.1",
                [
                    HelloFeature.XERROR,
                    HelloFeature.JSON,
                    HelloFeature.MUTATION_SEQNO,
                    HelloFeature.ALT_REQUEST_SUPPORT,
                ],
                1,
            ),
            hello__features__feature="0x0007;0x000b;0x0004;0x0010",
        ),
        s(
            codec.response(Opcode.HELLO, opaque=1, value=b"\x00\x07\x00\x0b\x00\x04\x00\x10"),
            hello__features__feature="0x0007;0x000b;0x0004;0x0010",
        ),
        c(
            codec.dcp_open(
                "sdk:conn-1", DcpOpenFlag.PRODUCER | DcpOpenFlag.INCLUDE_DELETE_TIMES, 2
            ),
            extras__seqno="0",
            extras__flags=h(0x21, 8),
        ),
        s(codec.response(Opcode.DCP_OPEN, opaque=2)),
        c(codec.dcp_control("enable_noop", "true", 3), value="true"),
        s(codec.response(Opcode.DCP_CONTROL, opaque=3)),
        c(codec.dcp_control("connection_buffer_size", "1048576", 4), value="1048576"),
        s(codec.response(Opcode.DCP_CONTROL, opaque=4)),
        c(codec.dcp_control("consumer_name", "n1", 22), value="n1"),
        s(codec.response(Opcode.DCP_CONTROL, opaque=22)),
        c(codec.dcp_control("stable_only", "true", 23), value="true"),
        s(codec.response(Opcode.DCP_CONTROL, opaque=23)),
        c(codec.dcp_control("no_such_key", "true", 5)),
        s(
            codec.response(Opcode.DCP_CONTROL, Status.EINVAL, opaque=5, value=b"unknown key"),
            ("DCP Control: Invalid arguments",),
        ),
        c(codec.request(Opcode.DCP_GET_FAILOVER_LOG, vbucket=5, opaque=6)),
        s(
            codec.response(
                Opcode.DCP_GET_FAILOVER_LOG, opaque=6, value=codec.failover_log_value(FAILOVER)
            ),
            (STRAY,),
            dcp__failover_log__vbucket_uuid=f"{h(UUID_A, 16)};{h(UUID_B, 16)}",
            dcp__failover_log__seqno="100;0",
        ),
        c(
            codec.stream_request(5, 0x2A, flags=StreamRequestFlag.ACTIVE_VB_ONLY),
            extras__flags=h(0x10, 8),
            extras__start_seqno="0",
            extras__end_seqno="18446744073709551615",
            extras__vbucket_uuid=h(0, 16),
            extras__snap_start_seqno="0",
            extras__snap_end_seqno="0",
        ),
        s(
            codec.response(
                Opcode.DCP_STREAM_REQ, opaque=0x2A, value=codec.failover_log_value(FAILOVER)
            ),
            (STRAY,),
            dcp__failover_log__vbucket_uuid=f"{h(UUID_A, 16)};{h(UUID_B, 16)}",
            dcp__failover_log__seqno="100;0",
        ),
        s(
            codec.snapshot_marker(5, 0x2A, 1, 5, SnapshotMarkerFlag.MEMORY),
            extras__start_seqno="1",
            extras__end_seqno="5",
            extras__flags=h(1, 8),
        ),
        s(
            codec.mutation(
                5,
                0x2A,
                1,
                1,
                b"doc-1",
                b'{"a":1}',
                cas=0x1234,
                datatype=Datatype.JSON,
                flags=0xDEADBEEF,
                expiry=7,
                lock_time=9,
            ),
            extras__by_seqno="1",
            extras__rev_seqno="1",
            extras__flags=h(0xDEADBEEF, 8),
            extras__expiration="7",
            extras__lock_time="9",
            value='{"a":1}',
        ),
        s(codec.deletion(5, 0x2A, 2, 2, b"doc-1"), extras__by_seqno="2", extras__rev_seqno="2"),
        s(
            codec.deletion(5, 0x2A, 3, 3, b"doc-2", delete_time=1700000000),
            extras__by_seqno="3",
            extras__delete_time="1700000000",
        ),
        s(
            codec.expiration(5, 0x2A, 4, 4, b"doc-3", delete_time=1700000001),
            extras__by_seqno="4",
            extras__delete_time="1700000001",
        ),
        s(
            codec.request(
                Opcode.DCP_MUTATION,
                vbucket=5,
                opaque=0x2A,
                key=b"doc-4",
                value=b"v",
                extras=codec.MUTATION_EXTRAS.pack(5, 1, 0, 0, 0, 0, 0),
                framing_extras=codec.stream_id_frame_info(7),
            ),
            flex_frame__frame__dcp_stream_id="7",
            extras__by_seqno="5",
        ),
        s(
            codec.snapshot_marker(
                5, 0x2A, 6, 9, SnapshotMarkerFlag.DISK, max_visible_seqno=8, high_completed_seqno=0
            ),
            extras__marker_version="0",
            extras__start_seqno="6",
            extras__end_seqno="9",
            extras__max_visible_seqno="8",
            extras__flags=h(2, 8),
        ),
        s(
            codec.request(
                Opcode.DCP_MUTATION,
                vbucket=5,
                opaque=0x2A,
                key=b"doc-5",
                extras=mut_extras,
                value=b"w",
            ),
            extras__by_seqno="6",
        ),
        s(codec.seqno_advanced(5, 0x2A, 9), extras__by_seqno="9"),
        # A replica acknowledges the whole snapshot [6, 9]: held only, then with persisted.
        c(codec.seqno_acknowledged(5, 0x2A, 9), extras__by_seqno="9"),
        c(codec.seqno_acknowledged(5, 0x2A, 9, 6), (STRAY,), extras__by_seqno="9"),
        s(codec.stream_end(5, 0x2A, StreamEndStatus.OK)),
        c(codec.buffer_ack(4096), extras__bytes_to_ack="4096"),
        s(codec.request(Opcode.DCP_NOOP, opaque=77)),
        c(codec.response(Opcode.DCP_NOOP, opaque=77)),
        c(
            codec.stream_request(
                6, 0x2B, start=1000, vb_uuid=UUID_A, snap_start=1000, snap_end=1000
            ),
            extras__start_seqno="1000",
            extras__vbucket_uuid=h(UUID_A, 16),
            extras__snap_start_seqno="1000",
            extras__snap_end_seqno="1000",
        ),
        s(
            codec.response(
                Opcode.DCP_STREAM_REQ, Status.ROLLBACK, opaque=0x2B, value=codec.U64.pack(90)
            ),
            ("DCP Stream Request: Rollback", STRAY),
        ),
        c(codec.request(Opcode.DCP_CLOSE_STREAM, vbucket=5, opaque=7)),
        s(codec.response(Opcode.DCP_CLOSE_STREAM, opaque=7)),
        c(
            codec.request(
                Opcode.GET_ALL_VB_SEQNOS, opaque=8, extras=codec.U32.pack(VBucketState.ACTIVE)
            )
        ),
        s(
            codec.response(
                Opcode.GET_ALL_VB_SEQNOS,
                opaque=8,
                value=codec.all_vb_seqnos_value([(0, 3), (5, 9)]),
            ),
            (STRAY,),
            vbucket_states__id="0;5",
            vbucket_states__seqno="3;9",
        ),
        c(
            codec.request(
                Opcode.SET,
                vbucket=115,
                opaque=9,
                extras=codec.store_extras(1, 0),
                key=b"foo",
                value=b"bar",
            ),
            extras__flags=h(1, 8),
            extras__expiration="0",
        ),
        s(
            codec.response(
                Opcode.SET, opaque=9, cas=0x99, extras=codec.mutation_seqno_extras(UUID_A, 10)
            ),
            extras__vbucket_uuid=h(UUID_A, 16),
            extras__mutation_seqno="10",
        ),
        c(
            codec.request(
                Opcode.SET,
                vbucket=115,
                opaque=10,
                extras=codec.store_extras(),
                key=b"foo",
                value=b"baz",
                framing_extras=codec.durability_frame_info(
                    DurabilityLevel.PERSIST_TO_MAJORITY, 2500
                ),
            ),
            flex_frame__frame__durability_req="3",
        ),
        s(
            codec.response(
                Opcode.SET, opaque=10, cas=0x9A, extras=codec.mutation_seqno_extras(UUID_A, 11)
            ),
            extras__mutation_seqno="11",
        ),
        c(
            codec.request(
                Opcode.SET,
                vbucket=115,
                opaque=24,
                extras=codec.store_extras(),
                key=b"foo",
                value=b"qux",
                framing_extras=codec.durability_frame_info(DurabilityLevel.PERSIST_TO_ACTIVE, 1500),
            ),
            flex_frame__frame__durability_req="4",
        ),
        s(
            codec.response(
                Opcode.SET, opaque=24, cas=0x9D, extras=codec.mutation_seqno_extras(UUID_A, 12)
            ),
            extras__mutation_seqno="12",
        ),
        c(
            codec.request(
                Opcode.ADD,
                vbucket=115,
                opaque=11,
                extras=codec.store_extras(),
                key=b"foo",
                value=b"x",
            )
        ),
        s(
            codec.response(Opcode.ADD, Status.KEY_EEXISTS, opaque=11, value=b"exists"),
            ("Add: Key exists",),
        ),
        c(
            codec.request(
                Opcode.REPLACE,
                vbucket=115,
                opaque=12,
                extras=codec.store_extras(),
                key=b"foo",
                value=b"y",
            )
        ),
        s(codec.response(Opcode.REPLACE, opaque=12, cas=0x9B)),
        c(codec.request(Opcode.GET, vbucket=115, opaque=13, key=b"foo")),
        s(
            codec.response(Opcode.GET, opaque=13, cas=0x9B, extras=codec.U32.pack(1), value=b"y"),
            extras__flags=h(1, 8),
            value="y",
        ),
        c(codec.request(Opcode.GET, vbucket=528, opaque=14, key=b"hello")),
        s(
            codec.response(Opcode.GET, Status.KEY_ENOENT, opaque=14, value=b"Not found"),
            ("Get: Key not found", "Get Response must have Extras"),
        ),
        c(codec.request(Opcode.DELETE, vbucket=115, opaque=15, key=b"foo")),
        s(
            codec.response(
                Opcode.DELETE, opaque=15, cas=0x9C, extras=codec.mutation_seqno_extras(UUID_A, 13)
            ),
            extras__mutation_seqno="13",
        ),
        c(
            codec.set_vbucket_state(
                5, VBucketState.REPLICA, 19, {"source": "127.0.0.1:11210", "takeover": True}
            ),
            extras__unknown="02",
            value='{"source":"127.0.0.1:11210","takeover":true}',
        ),
        s(codec.response(Opcode.SET_VBUCKET_STATE, opaque=19)),
        c(codec.set_vbucket_state(6, VBucketState.DEAD, 20), extras__unknown="04"),
        s(codec.response(Opcode.SET_VBUCKET_STATE, opaque=20)),
        c(codec.request(Opcode.GET_VBUCKET, vbucket=5, opaque=21)),
        s(
            codec.response(
                Opcode.GET_VBUCKET, opaque=21, value=codec.get_vbucket_value(VBucketState.PENDING)
            ),
            (STRAY,),
        ),
        s(codec.dcp_set_vbucket_state(5, 0x2C, VBucketState.PENDING), extras__unknown="03"),
        c(codec.response(Opcode.DCP_SET_VBUCKET_STATE, opaque=0x2C)),
        s(codec.dcp_set_vbucket_state(5, 0x2C, VBucketState.ACTIVE), extras__unknown="01"),
        c(codec.response(Opcode.DCP_SET_VBUCKET_STATE, opaque=0x2C)),
        c(codec.request(Opcode.NOOP, opaque=16)),
        s(codec.response(Opcode.NOOP, opaque=16)),
        c(codec.request(Opcode.VERSION, opaque=17)),
        s(codec.response(Opcode.VERSION, opaque=17, value=b"0.1.0"), value="0.1.0"),
        c(codec.request(Opcode.STAT, opaque=18, key=b"vbucket-seqno 5")),
        s(codec.response(Opcode.STAT, opaque=18, key=b"vb_5:high_seqno", value=b"9"), value="9"),
        s(codec.response(Opcode.STAT, opaque=18)),
    ]


# --------------------------------------------------------------------------- capture


def _send(sender: socket.socket, receiver: socket.socket, data: bytes) -> None:
    """Send one frame and read it whole on the other side, so each frame is its own segment."""
    sender.sendall(data)
    reader = FrameReader()
    got: list = []
    while not got:
        chunk = receiver.recv(65536)
        assert chunk, "peer closed"
        reader.feed(chunk)
        got = reader.read_frames()
    assert len(got) == 1 and got[0].encode() == data


def _run_exchange(listener: socket.socket, steps: list[Step]) -> tuple[int, int]:
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    server, _ = listener.accept()
    server.settimeout(10)
    with client, server:
        for sock in (client, server):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for step in steps:
            a, b = (client, server) if step.sender == "client" else (server, client)
            _send(a, b, step.data)
        return client.getsockname()[1], port


def _wait_until_capturing(
    proc: subprocess.Popen, listener: socket.socket, printed: Path, err: Path
) -> None:
    """ "Capturing on" comes before packets are really seen: probe until one is printed.

    Probes are empty TCP connections to the listener; they carry no payload, so they
    cannot disturb the couchbase judgement.
    """
    deadline = time.monotonic() + 20
    while printed.stat().st_size == 0:
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.skip(f"tshark cannot capture on lo: {err.read_text()[-300:]}")
        with socket.create_connection(listener.getsockname(), timeout=5):
            listener.accept()[0].close()
        time.sleep(0.05)


def _capture(pcap: Path, steps: list[Step]) -> tuple[int, int]:
    if TSHARK is None:
        pytest.skip("tshark is not installed (apt-get install tshark)")
    if os.geteuid() != 0:
        pytest.skip("capturing on loopback needs root (or CAP_NET_RAW)")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        printed, err = pcap.with_suffix(".txt"), pcap.with_suffix(".err")
        with printed.open("wb") as outf, err.open("wb") as errf:
            # -P -l: also print a line per packet, flushed, so readiness can be seen.
            proc = subprocess.Popen(
                [TSHARK, "-i", "lo", "-f", f"tcp port {port}", "-P", "-l", "-w", str(pcap)],
                stdout=outf,
                stderr=errf,
            )
        try:
            _wait_until_capturing(proc, listener, printed, err)
            ports = _run_exchange(listener, steps)
            time.sleep(0.5)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return ports


def _tshark(pcap: Path, port: int, *args: str) -> str:
    out = subprocess.run(
        [TSHARK, "-r", str(pcap), "-d", f"tcp.port=={port},couchbase", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    steps = exchange()
    pcap = tmp_path_factory.mktemp("tshark") / "dcp.pcapng"
    client_port, server_port = _capture(pcap, steps)
    return pcap, steps, client_port, server_port


# --------------------------------------------------------------------------- the judgement


def test_no_frame_is_malformed(captured):
    pcap, _, _, port = captured
    assert _tshark(pcap, port, "-Y", "_ws.malformed").strip() == ""


def test_no_payload_is_left_undissected(captured):
    pcap, _, _, port = captured
    assert _tshark(pcap, port, "-Y", "tcp.len>0 && !couchbase").strip() == ""


def test_couchbase_expert_warnings_are_only_the_known_quirks(captured):
    pcap, steps, _, port = captured
    allowed = {m for step in steps for m in step.experts if m != STRAY}
    report = _tshark(pcap, port, "-q", "-z", "expert,warn")
    lines = [ln for ln in report.splitlines() if "Couchbase" in ln]
    unexpected = [ln for ln in lines if not any(re.search(re.escape(m), ln) for m in allowed)]
    assert unexpected == []


def test_tshark_reads_back_every_frame_and_field_we_sent(captured):
    pcap, steps, client_port, port = captured
    names = sorted({name for step in steps for name in step.fields})
    columns = [
        "tcp.srcport",
        "tcp.payload",
        "_ws.expert.message",
        "couchbase.magic",
        "couchbase.opcode",
        "couchbase.vbucket",
        "couchbase.status",
        "couchbase.key",
        "couchbase.extras.length",
        "couchbase.cas",
        *names,
    ]
    out = _tshark(
        pcap,
        port,
        "-Y",
        "couchbase",
        "-T",
        "fields",
        "-E",
        "separator=/t",
        "-E",
        "aggregator=;",
        *(arg for col in columns for arg in ("-e", col)),
    )
    rows = [dict(zip(columns, line.split("\t"), strict=True)) for line in out.splitlines()]
    assert len(rows) == len(steps)
    for i, (row, step) in enumerate(zip(rows, steps, strict=True)):
        where = f"step {i} (opcode 0x{step.data[1]:02x})"
        assert bytes.fromhex(row["tcp.payload"]) == step.data, where
        want_port = client_port if step.sender == "client" else port
        assert int(row["tcp.srcport"]) == want_port, where
        frame = FrameReader()
        frame.feed(step.data)
        (f,) = frame.read_frames()
        assert row["couchbase.magic"] == h(f.magic, 2), where
        assert row["couchbase.opcode"] == h(f.opcode, 2), where
        if f.is_response:
            assert row["couchbase.status"] == h(f.status, 4), where
        else:
            assert row["couchbase.vbucket"] == str(f.vbucket), where
        assert row["couchbase.key"] == f.key.decode(), where
        assert row["couchbase.extras.length"] == str(len(f.extras)), where
        assert row["couchbase.cas"] == h(f.cas, 16), where
        for name, want in step.fields.items():
            assert row[name] == want, f"{where}: {name}"
        experts = {m for m in row["_ws.expert.message"].split(";") if m}
        assert experts <= step.experts, where


def _captured_frames(pcap: Path, port: int, display_filter: str) -> list:
    out = _tshark(pcap, port, "-Y", display_filter, "-T", "fields", "-e", "tcp.payload")
    reader = FrameReader()
    for line in out.split():
        reader.feed(bytes.fromhex(line))
    return reader.read_frames()


def test_values_tshark_does_not_decode_are_right_on_the_wire(captured):
    """Quirks 4 to 6: the ROLLBACK value, STREAM_END extras, GET_VBUCKET value, the
    persisted seqno of DCP_SEQNO_ACKNOWLEDGED and the durability timeouts, read from the
    capture by us."""
    pcap, _, _, port = captured
    acks = _captured_frames(pcap, port, "couchbase.opcode == 0x61")
    assert [codec.parse_seqno_acknowledged(f) for f in acks] == [(9, None), (9, 6)]
    assert [f.opaque for f in acks] == [0x2A, 0x2A]
    durable = _captured_frames(pcap, port, "couchbase.opcode == 0x01 && couchbase.magic == 0x08")
    assert [(codec.parse_durability(f), f.framing_extras[2:]) for f in durable] == [
        (DurabilityLevel.PERSIST_TO_MAJORITY, codec.U16.pack(2500)),
        (DurabilityLevel.PERSIST_TO_ACTIVE, codec.U16.pack(1500)),
    ]
    (rollback,) = _captured_frames(
        pcap, port, "couchbase.opcode == 0x53 && couchbase.status == 0x23"
    )
    assert codec.U64.unpack(rollback.value)[0] == 90
    (stream_end,) = _captured_frames(pcap, port, "couchbase.opcode == 0x55")
    assert codec.parse_stream_end(stream_end) == StreamEndStatus.OK
    (get_vbucket,) = _captured_frames(
        pcap, port, "couchbase.opcode == 0x3e && couchbase.magic == 0x81"
    )
    assert get_vbucket.value == b"\x00\x00\x00\x03"
