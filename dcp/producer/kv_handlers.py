"""KV requests on the DCP port: HELLO, VERSION, NOOP, GET, SET/ADD/REPLACE, DELETE, STAT,
GET_ALL_VB_SEQNOS.

Rules of this module:
- Handlers are synchronous: parse (peer input -> ``RemoteProtocolError`` -> EINVAL by the
  caller), call the engine, queue exactly one response (STAT: a sequence ending with an
  empty one). Engine outcomes arrive as ``StatusError`` and become that status.
- A durable write (durability frame info, a persist level) is answered only once its
  seqno is persisted (``Connection.respond_when_persisted``).
- Writes are refused with ETMPFAIL while storage is failing or checkpoint memory is far
  over quota: accepting them would only grow memory that cannot be flushed.
- ``set_fast`` is the pipelined-ingest path the connection's reader takes for a plain
  SET (magic 0x80, 8-byte extras, no framing extras) straight from the received bytes:
  the same checks, engine call and response as ``store``, without building a ``Frame``,
  appending the response to the reader's per-chunk output. Anything it does not handle
  the ordinary way (an error, a refusal, a misrouted key) makes it return False and the
  reader sends the request through ``store``.
"""

from __future__ import annotations

import struct
import zlib
from typing import TYPE_CHECKING

from ..protocol import codec
from ..protocol.errors import RemoteProtocolError, StatusError
from ..protocol.frames import Frame
from ..protocol.opcodes import DurabilityLevel, HelloFeature, Opcode, Status, VBucketState
from .stats import stat_pairs

if TYPE_CHECKING:
    from .connection import Connection

__all__ = ["KV_HANDLERS"]

VERSION = b"dcp-stream/0.1.0"
_SUPPORTED_FEATURES = {
    HelloFeature.XERROR,
    HelloFeature.JSON,
    HelloFeature.MUTATION_SEQNO,
    HelloFeature.ALT_REQUEST_SUPPORT,
    HelloFeature.TCPNODELAY,
}
_PERSIST_LEVELS = (DurabilityLevel.MAJORITY_AND_PERSIST_TO_ACTIVE,
                   DurabilityLevel.PERSIST_TO_MAJORITY)
_SET = int(Opcode.SET)
_MUTATION_SEQNO = int(HelloFeature.MUTATION_SEQNO)
_resp_seqno = struct.Struct(">BBHBBHIIQQQ").pack  # response header + vb_uuid + seqno
_resp_plain = struct.Struct(">BBHBBHIIQ").pack
_crc32 = zlib.crc32


def hello(conn: Connection, f: Frame) -> None:
    requested = codec.parse_hello_features(f.value)
    conn.agent = bytes(f.key[:200]).decode("utf-8", "replace")
    accepted = []
    for feat in requested:
        if feat in _SUPPORTED_FEATURES and feat not in accepted:
            accepted.append(feat)
    conn.features = set(accepted)
    conn.respond(codec.response(Opcode.HELLO, opaque=f.opaque,
                                value=b"".join(codec.U16.pack(x) for x in accepted)))


def version(conn: Connection, f: Frame) -> None:
    conn.respond(codec.response(Opcode.VERSION, opaque=f.opaque, value=VERSION))


def noop(conn: Connection, f: Frame) -> None:
    conn.respond(codec.response(Opcode.NOOP, opaque=f.opaque))


def _check_key(f: Frame) -> bytes:
    if not f.key:
        raise RemoteProtocolError(f"opcode 0x{f.opcode:02x} needs a key")
    return bytes(f.key)


def _routed(conn: Connection, f: Frame, key: bytes) -> bool:
    """Clients route a key to ``crc32``'s vbucket (reference §9); a key sent elsewhere is
    NOT_MY_VBUCKET, so no write can land where other clients would never look for it."""
    n = conn.server.bucket.num_vbuckets
    if f.vbucket < n and ((zlib.crc32(key) >> 16) & 0x7FFF) & (n - 1) == f.vbucket:
        return True
    conn.error(f.opcode, Status.NOT_MY_VBUCKET, f.opaque,
               f"key does not belong to vbucket {f.vbucket} of {n}")
    return False


def _write_response(conn: Connection, f: Frame, result: object) -> bytes:
    extras = b""
    if HelloFeature.MUTATION_SEQNO in conn.features:
        extras = codec.mutation_seqno_extras(result.vb_uuid, result.seqno)  # type: ignore[attr-defined]
    return codec.response(f.opcode, opaque=f.opaque, cas=result.cas,  # type: ignore[attr-defined]
                          extras=extras)


def _writable(conn: Connection, f: Frame) -> bool:
    reason = conn.server.write_refusal()
    if reason:
        conn.error(f.opcode, Status.ETMPFAIL, f.opaque, reason)
        return False
    return True


def _finish_write(conn: Connection, f: Frame, vbid: int, result: object) -> None:
    level = codec.parse_durability(f)
    frame = _write_response(conn, f, result)
    conn.server.metrics.op(f.opcode)
    if level in _PERSIST_LEVELS:
        conn.respond_when_persisted(vbid, result.seqno, frame)  # type: ignore[attr-defined]
        conn.server.want_flush()
    elif level in (DurabilityLevel.NONE, DurabilityLevel.MAJORITY):
        conn.respond(frame)
    else:  # unreachable: validated before the write
        conn.respond(frame)


def _durability_ok(conn: Connection, f: Frame) -> bool:
    level = codec.parse_durability(f)
    if level > DurabilityLevel.PERSIST_TO_MAJORITY:
        conn.error(f.opcode, Status.DURABILITY_INVALID_LEVEL, f.opaque,
                   f"durability level {level} is not defined")
        return False
    return True


def store(conn: Connection, f: Frame) -> None:
    """SET (upsert), ADD (only if absent), REPLACE (only if present); CAS-checked."""
    key = _check_key(f)
    flags, expiry = codec.parse_store_extras(f)
    if not _routed(conn, f, key) or not _durability_ok(conn, f) or not _writable(conn, f):
        return
    bucket = conn.server.bucket
    op = {Opcode.SET: bucket.set, Opcode.ADD: bucket.add, Opcode.REPLACE: bucket.replace}[
        f.opcode
    ]
    try:
        result = op(f.vbucket, key, bytes(f.value), flags=flags,
                    expiry=expiry, cas=f.cas, datatype=f.datatype)  # engine: relative <= 30 d
    except StatusError as exc:
        conn.error(f.opcode, exc.status, f.opaque, str(exc))
        return
    _finish_write(conn, f, f.vbucket, result)


def set_fast(conn: Connection, vbid: int, key: bytes, value: bytes, flags: int, expiry: int,
             cas: int, datatype: int, opaque: int, out: bytearray) -> bool:
    """A plain SET from the reader's fast path (see the module rules); True when handled
    (its response appended to ``out``), False to send it through ``store`` instead."""
    bucket = conn.server.bucket
    n = bucket.num_vbuckets
    if vbid >= n or ((_crc32(key) >> 16) & 0x7FFF) & (n - 1) != vbid or not 0 < len(key) <= 250:
        return False
    try:
        result = bucket._vbuckets[vbid].store(key, value, flags, expiry, cas, datatype, 0)
    except StatusError:
        return False  # ``store`` repeats the checks and answers the error
    if _MUTATION_SEQNO in conn.features:
        out += _resp_seqno(0x81, _SET, 0, 16, 0, 0, 16, opaque, result.cas, result.vb_uuid,
                           result.seqno)
    else:
        out += _resp_plain(0x81, _SET, 0, 0, 0, 0, 0, opaque, result.cas)
    conn.server.metrics.op(_SET)
    return True


def delete(conn: Connection, f: Frame) -> None:
    key = _check_key(f)
    if f.extras:
        raise RemoteProtocolError("DELETE must not have extras")
    if not _routed(conn, f, key) or not _durability_ok(conn, f) or not _writable(conn, f):
        return
    try:
        result = conn.server.bucket.delete(f.vbucket, key, cas=f.cas)
    except StatusError as exc:
        conn.error(f.opcode, exc.status, f.opaque, str(exc))
        return
    _finish_write(conn, f, f.vbucket, result)


def get(conn: Connection, f: Frame) -> None:
    key = _check_key(f)
    if not _routed(conn, f, key):
        return
    try:
        res = conn.server.bucket.get(f.vbucket, key)
    except StatusError as exc:
        conn.error(f.opcode, exc.status, f.opaque, str(exc))
        return
    conn.server.metrics.op(f.opcode)
    conn.respond(codec.response(Opcode.GET, opaque=f.opaque, cas=res.cas, datatype=res.datatype,
                                extras=codec.U32.pack(res.flags), value=res.value))


def stat(conn: Connection, f: Frame) -> None:
    group = bytes(f.key).decode("utf-8", "replace").strip()
    try:
        pairs = stat_pairs(conn.server, group)
    except KeyError as exc:
        conn.error(Opcode.STAT, Status.KEY_ENOENT, f.opaque, f"unknown stat group {exc}")
        return
    except ValueError as exc:
        conn.error(Opcode.STAT, Status.EINVAL, f.opaque, str(exc))
        return
    parts = [codec.response(Opcode.STAT, opaque=f.opaque, key=k.encode(), value=str(v).encode())
             for k, v in pairs]
    parts.append(codec.response(Opcode.STAT, opaque=f.opaque))
    conn.respond(b"".join(parts))


def get_all_vb_seqnos(conn: Connection, f: Frame) -> None:
    n = len(f.extras)
    if n not in (0, 4, 8):
        raise RemoteProtocolError(f"GET_ALL_VB_SEQNOS: extras length {n}, expected 0, 4 or 8")
    want = codec.U32.unpack_from(f.extras)[0] if n else 0
    if want and want not in VBucketState._value2member_map_:
        raise RemoteProtocolError(f"GET_ALL_VB_SEQNOS: unknown vbucket state {want}")
    bucket = conn.server.bucket
    pairs = []
    for vb in range(bucket.num_vbuckets):
        v = bucket.vbucket(vb)
        state = int(v.state)
        if (want and state == want) or (not want and state != VBucketState.DEAD):
            # Close the open checkpoint so the seqno we return is a snapshot boundary that
            # later writes can no longer deduplicate into: planners (the Spark source) cut
            # batches here and still get whole snapshots from memory.
            v.checkpoints.create_checkpoint()
            pairs.append((vb, v.high_seqno))
    conn.respond(codec.response(Opcode.GET_ALL_VB_SEQNOS, opaque=f.opaque,
                                value=codec.all_vb_seqnos_value(pairs)))


KV_HANDLERS = {
    Opcode.HELLO: hello,
    Opcode.VERSION: version,
    Opcode.NOOP: noop,
    Opcode.GET: get,
    Opcode.SET: store,
    Opcode.ADD: store,
    Opcode.REPLACE: store,
    Opcode.DELETE: delete,
    Opcode.STAT: stat,
    Opcode.GET_ALL_VB_SEQNOS: get_all_vb_seqnos,
}
