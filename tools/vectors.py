"""Generate the golden vectors in protocol_spec/vectors/ from the construct spec.

Usage:
    python -m tools.vectors            # (re)write protocol_spec/vectors/*.json
    python -m tools.vectors --check    # exit 1 if the checked-in files differ

Rules of this tool:
- Only ``dcp.protocol.spec`` builds and decodes here; the fast codec is checked against
  these files by tests/protocol/test_vectors.py, never used to make them.
- Output is deterministic: fixed field values, insertion-ordered keys, one file per vector,
  ``indent=2`` and a trailing newline. Running it twice changes nothing.
- JSON form of decoded fields: integers as JSON numbers (up to 2**64 - 1, so parse them
  with a 64-bit-exact reader); byte strings as ``{"text": "..."}`` when every byte is
  printable ASCII, else ``{"hex": "..."}``; absent parts (no extras, the vbucket field of a
  response) are left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dcp.protocol import spec
from dcp.protocol.opcodes import (
    SEQNO_MAX,
    Datatype,
    DcpOpenFlag,
    DurabilityLevel,
    FrameInfoId,
    HelloFeature,
    Magic,
    Opcode,
    SnapshotMarkerFlag,
    Status,
    StreamEndStatus,
    StreamRequestFlag,
    VBucketState,
)

ROOT = Path(__file__).resolve().parent.parent
VECTORS_DIR = ROOT / "protocol_spec" / "vectors"
C2S, S2C = "client->server", "server->client"


def _req(opcode: int, **fields: Any) -> dict:
    return {"magic": int(Magic.REQUEST), "opcode": int(opcode), **fields}


def _alt_req(opcode: int, **fields: Any) -> dict:
    return {"magic": int(Magic.ALT_REQUEST), "opcode": int(opcode), **fields}


def _resp(opcode: int, status: int = Status.SUCCESS, **fields: Any) -> dict:
    return {"magic": int(Magic.RESPONSE), "opcode": int(opcode), "status": int(status), **fields}


_MUT = {"by_seqno": 7, "rev_seqno": 3, "flags": 0xDEADBEEF, "expiration": 0, "lock_time": 0}
_FAILOVER = [
    {"vb_uuid": 0x1122334455667788, "seqno": 100},
    {"vb_uuid": 0xAABBCCDDEEFF0011, "seqno": 0},
]

#: a two-node, two-vbucket bucket config (cluster/vbmap.py ``bucket_config``), as sent
_CLUSTER_CONFIG = (
    b'{"rev":7,"revEpoch":1,"name":"default","uuid":"","nodeLocator":"vbucket",'
    b'"bucketType":"membase","numVBuckets":2,"collectionsManifestUid":"0",'
    b'"bucketCapabilitiesVer":"","bucketCapabilities":["dcp","cbhello","cccp","nodesExt"],'
    b'"nodes":[{"hostname":"10.0.0.1:11210","ports":{"direct":11210}},'
    b'{"hostname":"10.0.0.2:11210","ports":{"direct":11210}}],'
    b'"nodesExt":[{"hostname":"10.0.0.1","services":{"kv":11210},"nodeName":"n1",'
    b'"thisNode":true},{"hostname":"10.0.0.2","services":{"kv":11210},"nodeName":"n2"}],'
    b'"vBucketServerMap":{"hashAlgorithm":"CRC","numReplicas":1,'
    b'"serverList":["10.0.0.1:11210","10.0.0.2:11210"],"vBucketMap":[[0,1],[1,0]]},'
    b'"clusterCapabilitiesVer":[1,0],"clusterCapabilities":{}}'
)

#: (name, direction, description, fields given to ``spec.build_frame``)
CASES: list[tuple[str, str, str, dict]] = [
    (
        "hello_request",
        C2S,
        "HELLO: key = user agent, value = the uint16 features asked for "
        "(XERROR, JSON, MUTATION_SEQNO, ALT_REQUEST_SUPPORT).",
        _req(
            Opcode.HELLO,
            opaque=1,
            key=b"dcp-sdk/0.1",
            value=[
                HelloFeature.XERROR,
                HelloFeature.JSON,
                HelloFeature.MUTATION_SEQNO,
                HelloFeature.ALT_REQUEST_SUPPORT,
            ],
        ),
    ),
    (
        "hello_response",
        S2C,
        "HELLO reply: the subset of features the server honours.",
        _resp(
            Opcode.HELLO,
            opaque=1,
            value=[
                HelloFeature.XERROR,
                HelloFeature.JSON,
                HelloFeature.MUTATION_SEQNO,
                HelloFeature.ALT_REQUEST_SUPPORT,
            ],
        ),
    ),
    (
        "dcp_open_request",
        C2S,
        "DCP_OPEN as a consumer: extras = reserved seqno 0 + flags "
        "PRODUCER|INCLUDE_DELETE_TIMES, key = connection name.",
        _req(
            Opcode.DCP_OPEN,
            opaque=2,
            key=b"sdk:conn-1",
            extras={"seqno": 0, "flags": DcpOpenFlag.PRODUCER | DcpOpenFlag.INCLUDE_DELETE_TIMES},
        ),
    ),
    ("dcp_open_response", S2C, "DCP_OPEN accepted: status only.", _resp(Opcode.DCP_OPEN, opaque=2)),
    (
        "dcp_control_request",
        C2S,
        "DCP_CONTROL: key = setting name, value = ASCII value (here enable_noop=true).",
        _req(Opcode.DCP_CONTROL, opaque=3, key=b"enable_noop", value=b"true"),
    ),
    (
        "dcp_control_request_stable_only",
        C2S,
        "DCP_CONTROL stable_only=true (our extension): every snapshot of this connection's "
        "streams leaves only once its end is at or below the vbucket's stable seqno.",
        _req(Opcode.DCP_CONTROL, opaque=22, key=b"stable_only", value=b"true"),
    ),
    (
        "dcp_control_request_consumer_name",
        C2S,
        "DCP_CONTROL consumer_name=n1 (our extension): the node name a replica's "
        "SEQNO_ACKNOWLEDGED frames on this connection speak for.",
        _req(Opcode.DCP_CONTROL, opaque=23, key=b"consumer_name", value=b"n1"),
    ),
    ("dcp_control_response", S2C, "DCP_CONTROL accepted.", _resp(Opcode.DCP_CONTROL, opaque=3)),
    (
        "dcp_control_response_einval",
        S2C,
        "DCP_CONTROL with an unknown key: EINVAL (0x04), error text in the value.",
        _resp(Opcode.DCP_CONTROL, Status.EINVAL, opaque=4, value=b"unknown control key"),
    ),
    (
        "dcp_get_failover_log_request",
        C2S,
        "DCP_GET_FAILOVER_LOG for vbucket 5: header only.",
        _req(Opcode.DCP_GET_FAILOVER_LOG, vbucket=5, opaque=5),
    ),
    (
        "dcp_get_failover_log_response",
        S2C,
        "Failover log of vbucket 5, newest entry first: N x {uint64 vb_uuid, uint64 seqno}.",
        _resp(Opcode.DCP_GET_FAILOVER_LOG, opaque=5, value=_FAILOVER),
    ),
    (
        "dcp_stream_req_request",
        C2S,
        "DCP_STREAM_REQ from scratch for vbucket 5, endless "
        "(end = 2**64-1), flag ACTIVE_VB_ONLY; the opaque 0x2a tags every message of the stream.",
        _req(
            Opcode.DCP_STREAM_REQ,
            vbucket=5,
            opaque=0x2A,
            extras={
                "flags": StreamRequestFlag.ACTIVE_VB_ONLY,
                "reserved": 0,
                "start_seqno": 0,
                "end_seqno": SEQNO_MAX,
                "vb_uuid": 0,
                "snap_start_seqno": 0,
                "snap_end_seqno": 0,
            },
        ),
    ),
    (
        "dcp_stream_req_request_resume",
        C2S,
        "DCP_STREAM_REQ resuming vbucket 5 at seqno 100 "
        "with the newest failover uuid and the snapshot [90, 100] it had completed.",
        _req(
            Opcode.DCP_STREAM_REQ,
            vbucket=5,
            opaque=0x2B,
            extras={
                "flags": 0,
                "reserved": 0,
                "start_seqno": 100,
                "end_seqno": SEQNO_MAX,
                "vb_uuid": 0x1122334455667788,
                "snap_start_seqno": 90,
                "snap_end_seqno": 100,
            },
        ),
    ),
    (
        "dcp_stream_req_response_ok",
        S2C,
        "Stream accepted: the value is the failover log "
        "(newest first) the client must store in place of its own.",
        _resp(Opcode.DCP_STREAM_REQ, opaque=0x2A, value=_FAILOVER),
    ),
    (
        "dcp_stream_req_response_rollback",
        S2C,
        "Stream refused with ROLLBACK (0x23): the value is the 8-byte seqno to roll back to.",
        _resp(Opcode.DCP_STREAM_REQ, Status.ROLLBACK, opaque=0x2B, value={"rollback_seqno": 90}),
    ),
    (
        "dcp_snapshot_marker_v1_request",
        S2C,
        "SNAPSHOT_MARKER V1: 20-byte extras "
        "{start, end, flags}; a memory snapshot [1, 7] with the CHECKPOINT flag.",
        _req(
            Opcode.DCP_SNAPSHOT_MARKER,
            vbucket=5,
            opaque=0x2A,
            extras={
                "start_seqno": 1,
                "end_seqno": 7,
                "flags": SnapshotMarkerFlag.MEMORY | SnapshotMarkerFlag.CHECKPOINT,
            },
        ),
    ),
    (
        "dcp_snapshot_marker_v2_0_request",
        S2C,
        "SNAPSHOT_MARKER V2.0: 1-byte extras (version "
        "0) and a 36-byte value; a disk snapshot [1, 1000] with max visible seqno 1000.",
        _req(
            Opcode.DCP_SNAPSHOT_MARKER,
            vbucket=5,
            opaque=0x2A,
            extras={"version": 0},
            value={
                "start_seqno": 1,
                "end_seqno": 1000,
                "flags": SnapshotMarkerFlag.DISK,
                "max_visible_seqno": 1000,
                "high_completed_seqno": 0,
            },
        ),
    ),
    (
        "dcp_mutation_request",
        S2C,
        "MUTATION: 31-byte extras, key = document key, value = "
        "document (JSON datatype); CAS = document CAS.",
        _req(
            Opcode.DCP_MUTATION,
            vbucket=5,
            opaque=0x2A,
            cas=0x16F3A9B2C4D50000,
            datatype=Datatype.JSON,
            extras=_MUT,
            key=b"doc-1",
            value=b'{"a":1}',
        ),
    ),
    (
        "dcp_mutation_request_stream_id",
        S2C,
        "MUTATION in alt framing (magic 0x08) carrying "
        "the stream-id frame info (id 2, 2 bytes): bytes 2 and 3 of the header are the "
        "framing-extras and key lengths.",
        _alt_req(
            Opcode.DCP_MUTATION,
            vbucket=5,
            opaque=0x2A,
            cas=0x16F3A9B2C4D50000,
            framing_extras=[{"id": FrameInfoId.DCP_STREAM_ID, "stream_id": 7}],
            extras=_MUT,
            key=b"doc-1",
            value=b"raw",
        ),
    ),
    (
        "dcp_deletion_v1_request",
        S2C,
        "DELETION V1: 18-byte extras {by_seqno, rev_seqno, nmeta}, no value.",
        _req(
            Opcode.DCP_DELETION,
            vbucket=5,
            opaque=0x2A,
            cas=0x16F3A9B2C4D60000,
            extras={"by_seqno": 8, "rev_seqno": 4, "nmeta": 0},
            key=b"doc-1",
        ),
    ),
    (
        "dcp_deletion_v2_request",
        S2C,
        "DELETION V2 (DCP_OPEN flag INCLUDE_DELETE_TIMES): 21-byte extras with the delete time.",
        _req(
            Opcode.DCP_DELETION,
            vbucket=5,
            opaque=0x2A,
            cas=0x16F3A9B2C4D60000,
            extras={"by_seqno": 8, "rev_seqno": 4, "delete_time": 1700000000, "unused": 0},
            key=b"doc-1",
        ),
    ),
    (
        "dcp_expiration_request",
        S2C,
        "EXPIRATION (INCLUDE_DELETE_TIMES + enable_expiry_opcode):"
        " 20-byte extras {by_seqno, rev_seqno, delete_time}.",
        _req(
            Opcode.DCP_EXPIRATION,
            vbucket=5,
            opaque=0x2A,
            cas=0x16F3A9B2C4D70000,
            extras={"by_seqno": 9, "rev_seqno": 5, "delete_time": 1700000100},
            key=b"doc-2",
        ),
    ),
    (
        "dcp_seqno_advanced_request",
        S2C,
        "SEQNO_ADVANCED: 8-byte extras, the seqno the stream has moved to without items.",
        _req(Opcode.DCP_SEQNO_ADVANCED, vbucket=5, opaque=0x2A, extras={"seqno": 12}),
    ),
    (
        "dcp_seqno_acknowledged_request",
        C2S,
        "SEQNO_ACKNOWLEDGED (0x61), a replica to its active on the stream's opaque: 8-byte "
        "extras = the highest seqno it holds in whole snapshots; no value, no reply.",
        _req(Opcode.DCP_SEQNO_ACKNOWLEDGED, vbucket=5, opaque=0x2A, extras={"seqno": 9}),
    ),
    (
        "dcp_seqno_acknowledged_request_persisted",
        C2S,
        "SEQNO_ACKNOWLEDGED with our extension: an 8-byte value = the highest seqno the "
        "replica has persisted (at most the held seqno); no reply.",
        _req(
            Opcode.DCP_SEQNO_ACKNOWLEDGED,
            vbucket=5,
            opaque=0x2A,
            extras={"seqno": 9},
            value={"persisted_seqno": 6},
        ),
    ),
    (
        "dcp_stream_end_request",
        S2C,
        "STREAM_END: 4-byte extras = reason (0 OK: end seqno reached).",
        _req(Opcode.DCP_STREAM_END, vbucket=5, opaque=0x2A, extras={"status": StreamEndStatus.OK}),
    ),
    (
        "dcp_noop_request",
        S2C,
        "DCP_NOOP from the producer (noop enabled): header only.",
        _req(Opcode.DCP_NOOP, opaque=0x10000001),
    ),
    (
        "dcp_noop_response",
        C2S,
        "The client's DCP_NOOP reply: magic 0x81, same opaque.",
        _resp(Opcode.DCP_NOOP, opaque=0x10000001),
    ),
    (
        "dcp_buffer_ack_request",
        C2S,
        "BUFFER_ACK: 4-byte extras = bytes processed (whole frames, header included).",
        _req(Opcode.DCP_BUFFER_ACK, extras={"bytes_to_ack": 4096}),
    ),
    (
        "dcp_close_stream_request",
        C2S,
        "CLOSE_STREAM for vbucket 5: header only.",
        _req(Opcode.DCP_CLOSE_STREAM, vbucket=5, opaque=6),
    ),
    (
        "dcp_close_stream_response",
        S2C,
        "CLOSE_STREAM accepted.",
        _resp(Opcode.DCP_CLOSE_STREAM, opaque=6),
    ),
    (
        "get_all_vb_seqnos_request",
        C2S,
        "GET_ALL_VB_SEQNOS without extras: every live vbucket.",
        _req(Opcode.GET_ALL_VB_SEQNOS, opaque=7),
    ),
    (
        "get_all_vb_seqnos_request_active",
        C2S,
        "GET_ALL_VB_SEQNOS with 4-byte extras: only vbuckets in state active (1).",
        _req(Opcode.GET_ALL_VB_SEQNOS, opaque=8, extras={"vbucket_state": VBucketState.ACTIVE}),
    ),
    (
        "get_all_vb_seqnos_request_collection",
        C2S,
        "GET_ALL_VB_SEQNOS with 8-byte extras: "
        "state filter + collection id (this server has no collections and ignores the id).",
        _req(Opcode.GET_ALL_VB_SEQNOS, opaque=9, extras={"vbucket_state": 0, "collection_id": 0}),
    ),
    (
        "get_all_vb_seqnos_response",
        S2C,
        "GET_ALL_VB_SEQNOS reply: {uint16 vbucket, uint64 high seqno} pairs sorted by vbucket.",
        _resp(
            Opcode.GET_ALL_VB_SEQNOS,
            opaque=8,
            value=[
                {"vbucket": 0, "seqno": 0},
                {"vbucket": 5, "seqno": 12},
                {"vbucket": 1023, "seqno": 3},
            ],
        ),
    ),
    (
        "set_request",
        C2S,
        "SET: 8-byte extras {flags, expiration}, key, value.",
        _req(
            Opcode.SET,
            vbucket=115,
            opaque=9,
            datatype=Datatype.JSON,
            extras={"flags": 0, "expiration": 0},
            key=b"foo",
            value=b'{"v":1}',
        ),
    ),
    (
        "set_request_durable",
        C2S,
        "Durable SET: alt magic 0x08 with the durability frame "
        "info (id 1, level PERSIST_TO_MAJORITY, timeout 2500 ms); answered once a majority "
        "of the copies (the active among them) has persisted it, or SYNC_WRITE_AMBIGUOUS "
        "when the timeout passes first.",
        _alt_req(
            Opcode.SET,
            vbucket=115,
            opaque=10,
            framing_extras=[
                {
                    "id": FrameInfoId.DURABILITY,
                    "level": DurabilityLevel.PERSIST_TO_MAJORITY,
                    "timeout_ms": 2500,
                }
            ],
            extras={"flags": 0, "expiration": 0},
            key=b"foo",
            value=b"bar",
        ),
    ),
    (
        "set_request_persist_to_active",
        C2S,
        "SET with durability level 4 PERSIST_TO_ACTIVE (our extension), no timeout: "
        "answered once persisted on the active, whatever the replicas hold; the server's "
        "durability_timeout applies.",
        _alt_req(
            Opcode.SET,
            vbucket=115,
            opaque=24,
            framing_extras=[
                {"id": FrameInfoId.DURABILITY, "level": DurabilityLevel.PERSIST_TO_ACTIVE}
            ],
            extras={"flags": 0, "expiration": 0},
            key=b"foo",
            value=b"bar",
        ),
    ),
    (
        "set_request_persist_to_active_timeout",
        C2S,
        "SET with durability level 4 PERSIST_TO_ACTIVE and a 1500 ms timeout (3-byte frame "
        "info payload: level, uint16 ms); SYNC_WRITE_AMBIGUOUS if not persisted by then.",
        _alt_req(
            Opcode.SET,
            vbucket=115,
            opaque=25,
            framing_extras=[
                {
                    "id": FrameInfoId.DURABILITY,
                    "level": DurabilityLevel.PERSIST_TO_ACTIVE,
                    "timeout_ms": 1500,
                }
            ],
            extras={"flags": 0, "expiration": 0},
            key=b"foo",
            value=b"bar",
        ),
    ),
    (
        "set_response",
        S2C,
        "SET reply with MUTATION_SEQNO negotiated: 16-byte extras "
        "{vb_uuid, seqno}; CAS of the new document.",
        _resp(
            Opcode.SET,
            opaque=9,
            cas=0x16F3A9B2C4D80000,
            extras={"vb_uuid": 0x1122334455667788, "seqno": 13},
        ),
    ),
    (
        "set_response_without_seqno",
        S2C,
        "SET reply without MUTATION_SEQNO: no extras.",
        _resp(Opcode.SET, opaque=9, cas=0x16F3A9B2C4D80000),
    ),
    (
        "add_request",
        C2S,
        "ADD (fails with KEY_EEXISTS if the key exists); expiry 3600 s.",
        _req(
            Opcode.ADD,
            vbucket=528,
            opaque=11,
            extras={"flags": 1, "expiration": 3600},
            key=b"hello",
            value=b"world",
        ),
    ),
    (
        "add_response_exists",
        S2C,
        "ADD refused: KEY_EEXISTS (0x02).",
        _resp(Opcode.ADD, Status.KEY_EEXISTS, opaque=11),
    ),
    (
        "replace_request",
        C2S,
        "REPLACE with a CAS check.",
        _req(
            Opcode.REPLACE,
            vbucket=115,
            opaque=12,
            cas=0x16F3A9B2C4D80000,
            extras={"flags": 0, "expiration": 0},
            key=b"foo",
            value=b"baz",
        ),
    ),
    (
        "delete_request",
        C2S,
        "DELETE: key only.",
        _req(Opcode.DELETE, vbucket=115, opaque=13, key=b"foo"),
    ),
    (
        "delete_response",
        S2C,
        "DELETE reply with MUTATION_SEQNO extras.",
        _resp(
            Opcode.DELETE,
            opaque=13,
            cas=0x16F3A9B2C4D90000,
            extras={"vb_uuid": 0x1122334455667788, "seqno": 14},
        ),
    ),
    ("get_request", C2S, "GET: key only.", _req(Opcode.GET, vbucket=528, opaque=14, key=b"hello")),
    (
        "get_response",
        S2C,
        "GET hit: 4-byte extras = the document's flags, CAS, value.",
        _resp(Opcode.GET, opaque=14, cas=0x16F3A9B2C4DA0000, extras={"flags": 1}, value=b"world"),
    ),
    (
        "get_response_not_found",
        S2C,
        "GET miss: KEY_ENOENT (0x01), no extras.",
        _resp(Opcode.GET, Status.KEY_ENOENT, opaque=15, value=b"Not found"),
    ),
    ("noop_request", C2S, "Plain memcached NOOP (0x0a).", _req(Opcode.NOOP, opaque=16)),
    ("noop_response", S2C, "NOOP reply.", _resp(Opcode.NOOP, opaque=16)),
    ("version_request", C2S, "VERSION.", _req(Opcode.VERSION, opaque=17)),
    (
        "version_response",
        S2C,
        "VERSION reply: the value is the version string.",
        _resp(Opcode.VERSION, opaque=17, value=b"0.1.0"),
    ),
    (
        "set_vbucket_state_request",
        C2S,
        "SET_VBUCKET_STATE: 1-byte extras = the new state (2 replica), no key, no value.",
        _req(Opcode.SET_VBUCKET_STATE, vbucket=5, opaque=19, extras={"state": 2}),
    ),
    (
        "set_vbucket_state_request_json",
        C2S,
        "SET_VBUCKET_STATE with our JSON options (datatype JSON): state 2 replica, "
        "fed by a takeover stream from the node named in source.",
        _req(
            Opcode.SET_VBUCKET_STATE,
            vbucket=5,
            opaque=20,
            datatype=Datatype.JSON,
            extras={"state": VBucketState.REPLICA},
            value=b'{"source":"127.0.0.1:11210","takeover":true}',
        ),
    ),
    (
        "set_vbucket_state_response",
        S2C,
        "SET_VBUCKET_STATE accepted: status only.",
        _resp(Opcode.SET_VBUCKET_STATE, opaque=20),
    ),
    (
        "get_vbucket_request",
        C2S,
        "GET_VBUCKET for vbucket 5: header only.",
        _req(Opcode.GET_VBUCKET, vbucket=5, opaque=21),
    ),
    (
        "get_vbucket_response",
        S2C,
        "GET_VBUCKET reply: the value is the state as a big-endian uint32 (3 pending).",
        _resp(Opcode.GET_VBUCKET, opaque=21, value={"state": VBucketState.PENDING}),
    ),
    (
        "get_cluster_config_request",
        C2S,
        "GET_CLUSTER_CONFIG (0xB5): header only; asks for the bucket config clients route with.",
        _req(Opcode.GET_CLUSTER_CONFIG, opaque=0x2A),
    ),
    (
        "get_cluster_config_response",
        S2C,
        "GET_CLUSTER_CONFIG reply: datatype JSON, value = the bucket config (rev = the map's "
        "epoch; vBucketServerMap.serverList and vBucketMap route a key's vbucket to a node). "
        "A single node sends one naming itself active for every vbucket, rev 1.",
        _resp(
            Opcode.GET_CLUSTER_CONFIG,
            opaque=0x2A,
            datatype=Datatype.JSON,
            value=_CLUSTER_CONFIG,
        ),
    ),
    (
        "get_response_not_my_vbucket_config",
        S2C,
        "NOT_MY_VBUCKET (0x07) in cluster mode: the value is the bucket config (datatype "
        "JSON) instead of an error context, so the client re-routes from the answer itself.",
        _resp(
            Opcode.GET,
            Status.NOT_MY_VBUCKET,
            opaque=0x2B,
            datatype=Datatype.JSON,
            value=_CLUSTER_CONFIG,
        ),
    ),
    (
        "dcp_set_vbucket_state_request",
        S2C,
        "DCP_SET_VBUCKET_STATE in a takeover stream (the stream's opaque): 1-byte extras = "
        "the state the consumer must apply (3 pending, later 1 active), no key, no value.",
        _req(
            Opcode.DCP_SET_VBUCKET_STATE,
            vbucket=5,
            opaque=0x2A,
            extras={"state": VBucketState.PENDING},
        ),
    ),
    (
        "dcp_set_vbucket_state_response",
        C2S,
        "The consumer applied the state: SUCCESS with the stream's opaque (an error status "
        "makes the producer close the connection and undo the hand-over).",
        _resp(Opcode.DCP_SET_VBUCKET_STATE, opaque=0x2A),
    ),
    (
        "stat_request",
        C2S,
        "STAT group 'vbucket-seqno 5': key = group name and argument.",
        _req(Opcode.STAT, opaque=18, key=b"vbucket-seqno 5"),
    ),
    (
        "stat_response",
        S2C,
        "One STAT reply: key = stat name, value = ASCII value.",
        _resp(Opcode.STAT, opaque=18, key=b"vb_5:high_seqno", value=b"12"),
    ),
    (
        "stat_response_end",
        S2C,
        "The empty STAT reply that ends the group.",
        _resp(Opcode.STAT, opaque=18),
    ),
    # SASL: the SCRAM frames carry RFC 7677's example exchange (user "user", password
    # "pencil"), so the messages inside can be checked against the RFC too.
    (
        "sasl_list_mechs_request",
        C2S,
        "SASL_LIST_MECHS: header only.",
        _req(Opcode.SASL_LIST_MECHS, opaque=30),
    ),
    (
        "sasl_list_mechs_response",
        S2C,
        "SASL_LIST_MECHS reply: the mechanisms, space-separated, strongest first (PLAIN only "
        "on TLS or loopback connections).",
        _resp(Opcode.SASL_LIST_MECHS, opaque=30, value=b"SCRAM-SHA512 SCRAM-SHA256 PLAIN"),
    ),
    (
        "sasl_auth_request_plain",
        C2S,
        "SASL_AUTH with PLAIN: key = mechanism, value = authzid (empty) NUL user NUL password.",
        _req(Opcode.SASL_AUTH, opaque=31, key=b"PLAIN", value=b"\x00alice\x00secret"),
    ),
    (
        "sasl_auth_response_plain",
        S2C,
        "PLAIN accepted: SUCCESS, nothing else; the connection is authenticated as alice.",
        _resp(Opcode.SASL_AUTH, opaque=31),
    ),
    (
        "sasl_auth_request_scram",
        C2S,
        "SASL_AUTH with SCRAM-SHA256: value = the client-first message (GS2 header 'n,,', "
        "user name, client nonce).",
        _req(
            Opcode.SASL_AUTH,
            opaque=32,
            key=b"SCRAM-SHA256",
            value=b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO",
        ),
    ),
    (
        "sasl_auth_response_continue",
        S2C,
        "AUTH_CONTINUE (0x21): value = the server-first message (combined nonce, base64 "
        "salt, iterations).",
        _resp(
            Opcode.SASL_AUTH,
            Status.AUTH_CONTINUE,
            opaque=32,
            value=b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
            b"s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096",
        ),
    ),
    (
        "sasl_step_request",
        C2S,
        "SASL_STEP: key = the same mechanism, value = the client-final message (channel "
        "binding 'biws' = base64 of 'n,,', the combined nonce, the base64 proof).",
        _req(
            Opcode.SASL_STEP,
            opaque=33,
            key=b"SCRAM-SHA256",
            value=b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
            b"p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=",
        ),
    ),
    (
        "sasl_step_response",
        S2C,
        "SCRAM accepted: SUCCESS with the server-final message (the server's signature, "
        "which the client checks).",
        _resp(
            Opcode.SASL_STEP,
            opaque=33,
            value=b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=",
        ),
    ),
    (
        "sasl_step_response_auth_error",
        S2C,
        "AUTH_ERROR (0x20): wrong password, unknown user (not told apart) or unknown "
        "mechanism; the error context is JSON. The third failure closes the connection.",
        _resp(
            Opcode.SASL_STEP,
            Status.AUTH_ERROR,
            opaque=33,
            datatype=Datatype.JSON,
            value=b'{"error":{"context":"authentication failed"}}',
        ),
    ),
    (
        "get_response_eaccess",
        S2C,
        "EACCESS (0x24): a GET before authenticating (or by a user without the read "
        "privilege); the error context says which.",
        _resp(
            Opcode.GET,
            Status.EACCESS,
            opaque=34,
            datatype=Datatype.JSON,
            value=b'{"error":{"context":"authenticate first (SASL_AUTH)"}}',
        ),
    ),
]


def bytes_to_json(b: bytes) -> dict:
    if all(0x20 <= c < 0x7F for c in b):
        return {"text": b.decode("ascii")}
    return {"hex": b.hex()}


def to_json(obj: Any) -> Any:
    """Plain decoded fields (``spec.to_plain``) -> JSON-ready objects."""
    if isinstance(obj, bytes | bytearray):
        return bytes_to_json(bytes(obj))
    if isinstance(obj, dict):
        return {k: to_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_json(v) for v in obj]
    return int(obj) if isinstance(obj, int) else obj


def from_json(obj: Any) -> Any:
    """Inverse of ``to_json``."""
    if isinstance(obj, dict):
        if obj.keys() == {"text"}:
            return obj["text"].encode("ascii")
        if obj.keys() == {"hex"}:
            return bytes.fromhex(obj["hex"])
        return {k: from_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_json(v) for v in obj]
    return obj


def vector(name: str, direction: str, description: str, fields: dict) -> dict:
    data = spec.build_frame(fields)
    decoded = spec.to_plain(spec.parse_frame(data))
    return {
        "name": name,
        "direction": direction,
        "description": description,
        "hex": data.hex(),
        "fields": to_json(decoded),
    }


def render_all() -> dict[str, str]:
    """File name -> file text, for every vector."""
    out = {}
    for name, direction, description, fields in CASES:
        text = json.dumps(vector(name, direction, description, fields), indent=2) + "\n"
        out[f"{name}.json"] = text
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tools.vectors", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--check", action="store_true", help="compare, do not write")
    ap.add_argument("--out", type=Path, default=VECTORS_DIR)
    args = ap.parse_args(argv)
    files = render_all()
    existing = {p.name for p in args.out.glob("*.json")} if args.out.exists() else set()
    if args.check:
        stale = sorted(existing - files.keys())
        differ = sorted(
            n
            for n, t in files.items()
            if not (args.out / n).exists() or (args.out / n).read_text() != t
        )
        for n in differ:
            print(f"differs or missing: {n}")
        for n in stale:
            print(f"not generated any more: {n}")
        return 1 if differ or stale else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for n in existing - files.keys():
        (args.out / n).unlink()
    for n, t in files.items():
        (args.out / n).write_text(t)
    print(f"wrote {len(files)} vectors to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
