"""KV requests on the DCP port: HELLO, VERSION, NOOP, GET, SET/ADD/REPLACE, DELETE, STAT,
GET_ALL_VB_SEQNOS, GET_CLUSTER_CONFIG.

Rules of this module:
- Handlers are synchronous: parse (peer input -> ``RemoteProtocolError`` -> EINVAL by the
  caller), call the engine, queue exactly one response (STAT: a sequence ending with an
  empty one). Engine outcomes arrive as ``StatusError`` and become that status.
- A durable write (durability frame info, levels 1-4) is refused before anything is
  written when its level is undefined (DURABILITY_INVALID_LEVEL; so is the reserved
  timeout 0xFFFF, as memcached answers it) or when the vbucket's chain has too few copies
  for it (DURABILITY_IMPOSSIBLE, ``DurabilityMonitor.possible``). Otherwise it is applied
  like any write and answered at once if its level already holds (MAJORITY on a single
  node), else when it does (``Connection.respond_when_durable``, sync_writes.py), or
  SYNC_WRITE_AMBIGUOUS (ETMPFAIL without XERROR) at its deadline: the frame info's
  timeout (ms, 0 = default) or ``durability_timeout``; at once if the vbucket leaves
  active here meanwhile.
- STAT answers are produced lazily (``stats.stat_units`` through
  ``Connection.continue_with``): a group over every vbucket is encoded in steps.
- Writes are refused with ETMPFAIL while storage is failing or checkpoint memory is far
  over quota: accepting them would only grow memory that cannot be flushed. In cluster
  mode also while the node's write gate (``server.write_gate``, cluster/agent.py) is
  closed: it is asked on every write request and at the start of every ``set_run``,
  synchronously, because a process that was frozen may serve requests before its
  fencing task runs (a single node has no gate: one None check).
- ``set_run`` is the pipelined-ingest path the connection's reader takes for a run of
  plain SETs (magic 0x80, 8-byte extras, no framing extras, no CAS) straight from the
  received bytes: the same checks, engine effect and response as ``store``, without a
  ``Frame`` or a ``MutationResult``, appending the responses to the reader's per-chunk
  output. It stops before anything it does not handle (an error, a misrouted key, an
  unusual frame), which the reader then sends through ``store`` the ordinary way.
- Wire layouts, sizes and the key-to-vbucket hash are ``dcp.protocol.layout``'s; this
  module spells none of its own (hot loops bind them to locals).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ..protocol import codec
from ..protocol.errors import RemoteProtocolError, StatusError
from ..protocol.frames import Frame
from ..protocol.layout import (
    HDR_MUTATION_SEQNO,
    HDR_STORE,
    HEADER,
    HEADER_SIZE,
    MUTATION_SEQNO,
    STORE_EXTRAS,
    vbucket_for_key,
)
from ..protocol.opcodes import (
    Datatype,
    HelloFeature,
    Opcode,
    Status,
    VBucketState,
)
from .stats import Pairs, stat_units
from .sync_writes import answer_write, durability_possible, requested_durability

if TYPE_CHECKING:
    from .connection import Connection
    from .engine import MutationResult

__all__ = ["KV_HANDLERS"]

VERSION = b"dcp-stream/0.1.0"
_SUPPORTED_FEATURES = {
    HelloFeature.XERROR,
    HelloFeature.JSON,
    HelloFeature.MUTATION_SEQNO,
    HelloFeature.ALT_REQUEST_SUPPORT,
    HelloFeature.TCPNODELAY,
}
_SET = int(Opcode.SET)
_ADD = int(Opcode.ADD)
_REPLACE = int(Opcode.REPLACE)
_MUTATION_SEQNO = int(HelloFeature.MUTATION_SEQNO)
_STATES = frozenset(int(s) for s in VBucketState)
_resp_seqno = HDR_MUTATION_SEQNO.pack  # response header + vb_uuid + seqno
_resp_plain = HEADER.pack
_HDR_STORE = HDR_STORE.unpack_from  # request header + SET extras
_STORE_HEAD = HDR_STORE.size  # where a SET's key starts
_STORE_EXTRAS = STORE_EXTRAS.size
_SEQNO_EXTRAS = MUTATION_SEQNO.size
_FENCED = (
    "temporary failure: this node may not take writes now (fenced from the cluster, or "
    "not yet in its map); retry, or ask GET_CLUSTER_CONFIG where the vbucket lives"
)


def hello(conn: Connection, f: Frame) -> None:
    requested = codec.parse_hello_features(f.value)
    conn.agent = bytes(f.key[:200]).decode("utf-8", "replace")
    accepted = []
    for feat in requested:
        if feat in _SUPPORTED_FEATURES and feat not in accepted:
            accepted.append(feat)
    conn.features = set(accepted)
    conn.respond(
        codec.response(
            Opcode.HELLO, opaque=f.opaque, value=b"".join(codec.U16.pack(x) for x in accepted)
        )
    )


def version(conn: Connection, f: Frame) -> None:
    conn.respond(codec.response(Opcode.VERSION, opaque=f.opaque, value=VERSION))


def noop(conn: Connection, f: Frame) -> None:
    conn.respond(codec.response(Opcode.NOOP, opaque=f.opaque))


def _check_key(f: Frame) -> bytes:
    if not f.key:
        raise RemoteProtocolError(f"opcode 0x{f.opcode:02x} needs a key")
    return bytes(f.key)


def _routed(conn: Connection, f: Frame, key: bytes) -> bool:
    """Clients route a key with ``layout.vbucket_for_key``; a key sent elsewhere is
    NOT_MY_VBUCKET, so no write can land where other clients would never look for it."""
    n = conn.server.bucket.num_vbuckets
    if f.vbucket < n and vbucket_for_key(key, n) == f.vbucket:
        return True
    conn.error(
        f.opcode,
        Status.NOT_MY_VBUCKET,
        f.opaque,
        f"key does not belong to vbucket {f.vbucket} of {n}",
    )
    return False


def _write_response(conn: Connection, f: Frame, result: MutationResult) -> bytes:
    extras = b""
    if HelloFeature.MUTATION_SEQNO in conn.features:
        extras = codec.mutation_seqno_extras(result.vb_uuid, result.seqno)
    return codec.response(
        f.opcode,
        opaque=f.opaque,
        cas=result.cas,
        extras=extras,
    )


def _writable(conn: Connection, f: Frame) -> bool:
    gate = conn.server.write_gate
    if gate is not None and not gate():
        conn.error(f.opcode, Status.ETMPFAIL, f.opaque, _FENCED)
        return False
    reason = conn.server.persistence.write_refusal()
    if reason:
        conn.error(f.opcode, Status.ETMPFAIL, f.opaque, reason)
        return False
    return True


def _finish_write(
    conn: Connection, f: Frame, vbid: int, result: MutationResult, durability: tuple[int, int]
) -> None:
    frame = _write_response(conn, f, result)
    conn.server.metrics.op(f.opcode)
    answer_write(conn, f, vbid, result.seqno, frame, durability)


def store(conn: Connection, f: Frame) -> None:
    """SET (upsert), ADD (only if absent), REPLACE (only if present); CAS-checked."""
    key = _check_key(f)
    flags, expiry = codec.parse_store_extras(f)
    if not _routed(conn, f, key):
        return
    durability = requested_durability(conn, f)
    if durability is None or not _writable(conn, f):
        return
    if not durability_possible(conn, f, durability[0]):
        return
    bucket = conn.server.bucket
    op = {_SET: bucket.set, _ADD: bucket.add, _REPLACE: bucket.replace}[f.opcode]
    try:
        result = op(
            f.vbucket,
            key,
            bytes(f.value),
            flags=flags,
            expiry=expiry,
            cas=f.cas,
            datatype=f.datatype,
        )  # engine: relative <= 30 d
    except StatusError as exc:
        conn.error(f.opcode, exc.status, f.opaque, str(exc))
        return
    _finish_write(conn, f, f.vbucket, result, durability)


def set_run(
    conn: Connection, buf: bytes, pos: int, n: int, max_body: int, out: bytearray
) -> tuple[int, int]:
    """The plain SETs starting at ``buf[pos:]`` (see the module rules): applies each
    complete one and appends its answer to ``out``, and stops at the first frame it does
    not handle (another request, an incomplete frame, anything ``store`` must check or
    answer with an error). Returns (position after the last SET applied, SETs applied).

    The caller has checked ``Persistence.write_refusal()`` for this chunk. One clock read and
    one notification per vbucket for the whole run (``Bucket.queued_many``).
    """
    server = conn.server
    gate = server.write_gate
    if gate is not None and not gate():
        return pos, 0  # ``store`` answers each ETMPFAIL
    bucket = server.bucket
    vbs = server.vbuckets
    nvb = bucket.num_vbuckets
    route = vbucket_for_key
    head = _STORE_HEAD
    hsize = HEADER_SIZE
    store_extras = _STORE_EXTRAS
    seqno_extras = _SEQNO_EXTRAS  # also the body length: the answer has no key or value
    seqno_answer = _MUTATION_SEQNO in conn.features
    now = bucket.clock()
    touched: set[int] = set()
    touch = touched.add
    count = 0
    try:
        while n - pos >= head:
            magic, op, kl, el, dt, vb, body, opq, cas, flags, exp = _HDR_STORE(buf, pos)
            # the same limits as FrameReader's; anything unusual goes the ordinary way
            if (
                op != _SET
                or magic != 0x80
                or el != store_extras
                or cas
                or not 0 < kl <= 250
                or store_extras + kl > body
                or body > max_body
                or vb >= nvb
            ):
                break
            end = pos + hsize + body
            if end > n:
                break
            k = pos + head
            key = buf[k : k + kl]
            if route(key, nvb) != vb:
                break  # misrouted: ``store`` answers NOT_MY_VBUCKET
            r = vbs[vb].store_set(key, buf[k + kl : end], flags, exp, dt, now)
            if r is None:
                break
            touch(vb)
            new_cas, uuid, seqno = r
            if seqno_answer:
                out += _resp_seqno(
                    0x81, _SET, 0, seqno_extras, 0, 0, seqno_extras, opq, new_cas, uuid, seqno
                )
            else:
                out += _resp_plain(0x81, _SET, 0, 0, 0, 0, 0, opq, new_cas)
            pos = end
            count += 1
    finally:
        if count:
            bucket.queued_many(touched)
            server.metrics.ops[_SET] += count
    return pos, count


def delete(conn: Connection, f: Frame) -> None:
    key = _check_key(f)
    if f.extras:
        raise RemoteProtocolError("DELETE must not have extras")
    if not _routed(conn, f, key):
        return
    durability = requested_durability(conn, f)
    if durability is None or not _writable(conn, f):
        return
    if not durability_possible(conn, f, durability[0]):
        return
    try:
        result = conn.server.bucket.delete(f.vbucket, key, cas=f.cas)
    except StatusError as exc:
        conn.error(f.opcode, exc.status, f.opaque, str(exc))
        return
    _finish_write(conn, f, f.vbucket, result, durability)


def get(conn: Connection, f: Frame) -> None:
    key = _check_key(f)
    if f.extras or f.value:
        raise RemoteProtocolError(
            f"GET must have no extras and no value (extras "
            f"{len(f.extras)} bytes, value {len(f.value)} bytes)"
        )
    if not _routed(conn, f, key):
        return
    try:
        res = conn.server.bucket.get(f.vbucket, key)
    except StatusError as exc:
        conn.error(f.opcode, exc.status, f.opaque, str(exc))
        return
    conn.server.metrics.op(f.opcode)
    conn.respond(
        codec.response(
            Opcode.GET,
            opaque=f.opaque,
            cas=res.cas,
            datatype=res.datatype,
            extras=codec.U32.pack(res.flags),
            value=res.value,
        )
    )


def stat(conn: Connection, f: Frame) -> None:
    group = bytes(f.key).decode("utf-8", "replace").strip()
    try:
        units = stat_units(conn.server, group)
    except KeyError as exc:
        conn.error(Opcode.STAT, Status.KEY_ENOENT, f.opaque, f"unknown stat group {exc}")
        return
    except ValueError as exc:
        conn.error(Opcode.STAT, Status.EINVAL, f.opaque, str(exc))
        return
    conn.continue_with(_stat_frames(units, f.opaque))


def _stat_frames(units: Iterator[Pairs], opaque: int) -> Iterator[bytes]:
    """One chunk of STAT answers per unit, then the empty answer that ends the group."""
    response = codec.response
    for pairs in units:
        yield b"".join(
            response(Opcode.STAT, opaque=opaque, key=k.encode(), value=str(v).encode())
            for k, v in pairs
        )
    yield response(Opcode.STAT, opaque=opaque)


def get_cluster_config(conn: Connection, f: Frame) -> None:
    if f.key or f.extras or f.value:
        raise RemoteProtocolError("GET_CLUSTER_CONFIG takes no key, extras or value")
    config = conn.server.cluster.config_json()
    if not config:
        conn.error(f.opcode, Status.ETMPFAIL, f.opaque, "no cluster map yet; retry")
        return
    conn.respond(
        codec.response(
            Opcode.GET_CLUSTER_CONFIG, opaque=f.opaque, datatype=Datatype.JSON, value=config
        )
    )


def get_all_vb_seqnos(conn: Connection, f: Frame) -> None:
    n = len(f.extras)
    if n not in (0, 4, 8):
        raise RemoteProtocolError(f"GET_ALL_VB_SEQNOS: extras length {n}, expected 0, 4 or 8")
    want = codec.U32.unpack_from(f.extras)[0] if n else 0
    if want and want not in _STATES:
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
    conn.respond(
        codec.response(
            Opcode.GET_ALL_VB_SEQNOS, opaque=f.opaque, value=codec.all_vb_seqnos_value(pairs)
        )
    )


KV_HANDLERS: dict[int, Callable[[Connection, Frame], None]] = {
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
    Opcode.GET_CLUSTER_CONFIG: get_cluster_config,
}
