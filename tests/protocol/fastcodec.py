"""The fast codec (codec.py builders, FrameReader, parse_*) seen through spec-shaped fields.

``encode(fields)`` builds a frame with the codec's builders from the same dict that
``spec.build_frame`` takes; ``decode(data)`` reads it back with ``FrameReader`` and the
``parse_*`` functions into the dict ``spec.to_plain(spec.parse_frame(data))`` gives. Tests
compare the two codecs through these. Fields the codec never writes (reserved bytes, nmeta,
nru) must be 0 when encoding; when decoding they are read with the codec's own structs.
"""

from __future__ import annotations

import json

from dcp.protocol import codec, spec
from dcp.protocol.errors import RollbackRequired, for_status
from dcp.protocol.frames import (
    HEADER_SIZE,
    Frame,
    FrameReader,
    encode_frame,
    encode_frame_infos,
    parse_frame_infos,
)
from dcp.protocol.opcodes import FrameInfoId, Magic, Opcode, Status

REQUEST_MAGIC = (Magic.REQUEST, Magic.ALT_REQUEST)
RESPONSE_MAGIC = (Magic.RESPONSE, Magic.ALT_RESPONSE)
STORE_OPS = (Opcode.SET, Opcode.ADD, Opcode.REPLACE)
WRITE_OPS = (*STORE_OPS, Opcode.DELETE)


def _zero(fields: dict, *names: str) -> None:
    for n in names:
        assert not fields.get(n), f"the fast codec always writes {n} = 0"


def _frame_infos(infos: list[dict]) -> bytes:
    pairs = []
    for fi in infos:
        if fi["id"] == FrameInfoId.DCP_STREAM_ID:
            pairs.append((fi["id"], codec.U16.pack(fi["stream_id"])))
        elif fi["id"] == FrameInfoId.DURABILITY:
            one = codec.durability_frame_info(fi["level"], fi.get("timeout_ms"))
            pairs.extend(parse_frame_infos(one))
        else:
            pairs.append((fi["id"], fi["payload"]))
    return encode_frame_infos(pairs)


def encode(f: dict) -> bytes:
    """Build ``f`` (spec-shaped fields) with the fast codec."""
    magic, op = f["magic"], f["opcode"]
    if magic == Magic.ALT_REQUEST:
        # Encode the classic frame, then move its parts behind the frame infos.
        inner = decode_frame(encode({**f, "magic": int(Magic.REQUEST), "framing_extras": []}))
        return codec.request(
            op,
            vbucket=inner.vbucket,
            opaque=inner.opaque,
            cas=inner.cas,
            datatype=inner.datatype,
            extras=inner.extras,
            key=inner.key,
            value=inner.value,
            framing_extras=_frame_infos(f["framing_extras"]),
        )
    vb, opaque, cas = f.get("vbucket", 0), f.get("opaque", 0), f.get("cas", 0)
    dt, key, value = f.get("datatype", 0), f.get("key", b""), f.get("value", b"")
    ex = f.get("extras")
    if magic == Magic.REQUEST:
        if op == Opcode.DCP_MUTATION:
            _zero(ex, "nmeta", "nru")
            return codec.mutation(
                vb,
                opaque,
                ex["by_seqno"],
                ex["rev_seqno"],
                key,
                value,
                cas=cas,
                datatype=dt,
                flags=ex["flags"],
                expiry=ex["expiration"],
                lock_time=ex["lock_time"],
            )
        if op == Opcode.DCP_DELETION:
            _zero(ex, "nmeta", "unused")
            return codec.deletion(
                vb,
                opaque,
                ex["by_seqno"],
                ex["rev_seqno"],
                key,
                cas=cas,
                datatype=dt,
                value=value,
                delete_time=ex.get("delete_time"),
            )
        if op == Opcode.DCP_EXPIRATION:
            assert dt == 0 and not value, "codec.expiration has no datatype or value"
            return codec.expiration(
                vb,
                opaque,
                ex["by_seqno"],
                ex["rev_seqno"],
                key,
                cas=cas,
                delete_time=ex["delete_time"],
            )
        if op == Opcode.DCP_SNAPSHOT_MARKER:
            assert cas == 0 and dt == 0
            if "version" in ex:
                assert ex["version"] == 0, "the codec builds V2.0 only"
                return codec.snapshot_marker(
                    vb,
                    opaque,
                    value["start_seqno"],
                    value["end_seqno"],
                    value["flags"],
                    max_visible_seqno=value["max_visible_seqno"],
                    high_completed_seqno=value["high_completed_seqno"],
                )
            return codec.snapshot_marker(
                vb, opaque, ex["start_seqno"], ex["end_seqno"], ex["flags"]
            )
        if op == Opcode.DCP_BUFFER_ACK:
            assert vb == 0 and cas == 0
            return codec.buffer_ack(ex["bytes_to_ack"], opaque)
        if op == Opcode.DCP_STREAM_END:
            return codec.stream_end(vb, opaque, ex["status"])
        if op == Opcode.DCP_SEQNO_ADVANCED:
            return codec.seqno_advanced(vb, opaque, ex["seqno"])
        if op == Opcode.DCP_SEQNO_ACKNOWLEDGED:
            assert cas == 0 and dt == 0 and not key
            persisted = value["persisted_seqno"] if value else None
            return codec.seqno_acknowledged(vb, opaque, ex["seqno"], persisted)
        if op == Opcode.DCP_OPEN:
            _zero(ex, "seqno")
            return codec.dcp_open(key, ex["flags"], opaque, value)
        if op == Opcode.DCP_CONTROL:
            return codec.dcp_control(key.decode(), value.decode(), opaque)
        if op == Opcode.DCP_STREAM_REQ:
            _zero(ex, "reserved")
            return codec.stream_request(
                vb,
                opaque,
                flags=ex["flags"],
                start=ex["start_seqno"],
                end=ex["end_seqno"],
                vb_uuid=ex["vb_uuid"],
                snap_start=ex["snap_start_seqno"],
                snap_end=ex["snap_end_seqno"],
                value=value,
            )
        if op == Opcode.HELLO:
            return codec.hello(key.decode(), value, opaque)
        if op == Opcode.SASL_LIST_MECHS:
            assert vb == cas == dt == 0 and not key and not value
            return codec.sasl_list_mechs(opaque)
        if op in (Opcode.SASL_AUTH, Opcode.SASL_STEP):
            assert vb == cas == dt == 0
            build = codec.sasl_auth if op == Opcode.SASL_AUTH else codec.sasl_step
            return build(key.decode(), value, opaque)
        if op == Opcode.SET_VBUCKET_STATE:
            assert cas == 0 and not key and dt == (0x01 if value else 0)
            options = json.loads(value) if value else None
            frame = codec.set_vbucket_state(vb, ex["state"], opaque, options)
            assert not value or frame.endswith(value), "the codec writes compact JSON"
            return frame
        if op == Opcode.DCP_SET_VBUCKET_STATE:
            assert cas == 0 and dt == 0 and not key and not value
            return codec.dcp_set_vbucket_state(vb, opaque, ex["state"])
        if op == Opcode.GET_ALL_VB_SEQNOS:
            extras = codec.U32.pack(ex["vbucket_state"]) if ex else b""
            if ex and "collection_id" in ex:
                extras += codec.U32.pack(ex["collection_id"])
            return codec.request(op, opaque=opaque, extras=extras)
        if op in STORE_OPS:
            extras = codec.store_extras(ex["flags"], ex["expiration"])
            return codec.request(
                op,
                vbucket=vb,
                opaque=opaque,
                cas=cas,
                datatype=dt,
                extras=extras,
                key=key,
                value=value,
            )
        return codec.request(
            op,
            vbucket=vb,
            opaque=opaque,
            cas=cas,
            datatype=dt,
            extras=ex or b"",
            key=key,
            value=value,
        )
    if magic == Magic.RESPONSE:
        status = f.get("status", 0)
        extras = ex or b""
        if op in WRITE_OPS and ex:
            extras = codec.mutation_seqno_extras(ex["vb_uuid"], ex["seqno"])
        elif op == Opcode.GET and ex:
            extras = codec.U32.pack(ex["flags"])
        if status == Status.SUCCESS and op in (Opcode.DCP_STREAM_REQ, Opcode.DCP_GET_FAILOVER_LOG):
            value = codec.failover_log_value([(e["vb_uuid"], e["seqno"]) for e in value])
        elif status == Status.ROLLBACK and op == Opcode.DCP_STREAM_REQ:
            value = codec.U64.pack(value["rollback_seqno"])
        elif status == Status.SUCCESS and op == Opcode.GET_ALL_VB_SEQNOS:
            value = codec.all_vb_seqnos_value([(e["vbucket"], e["seqno"]) for e in value])
        elif status == Status.SUCCESS and op == Opcode.HELLO:
            value = b"".join(codec.U16.pack(x) for x in value)
        elif status == Status.SUCCESS and op == Opcode.GET_VBUCKET:
            value = codec.get_vbucket_value(value["state"])
        return codec.response(
            op, status, opaque=opaque, cas=cas, datatype=dt, extras=extras, key=key, value=value
        )
    return encode_frame(
        magic,
        op,
        vbucket=f.get("vbucket", f.get("status", 0)),
        opaque=opaque,
        cas=cas,
        datatype=dt,
        extras=ex or b"",
        key=key,
        value=value,
    )


def decode_frame(data: bytes) -> Frame:
    """Exactly one frame out of ``data`` through ``FrameReader``."""
    reader = FrameReader()
    reader.feed(data)
    frames = reader.read_frames()
    assert len(frames) == 1 and reader.buffered == 0, (frames, reader.buffered)
    return frames[0]


def _decode_frame_infos(frame: Frame) -> list[dict]:
    out = []
    for fid, data in parse_frame_infos(frame.framing_extras):
        if fid == FrameInfoId.DCP_STREAM_ID:
            out.append({"id": fid, "stream_id": codec.parse_stream_id(frame)})
        elif fid == FrameInfoId.DURABILITY:
            fi = {"id": fid, "level": codec.parse_durability(frame)}
            if len(data) == 3:
                fi["timeout_ms"] = codec.U16.unpack_from(data, 1)[0]
            out.append(fi)
        else:
            out.append({"id": fid, "payload": data})
    return out


def _request_extras_value(fr: Frame) -> tuple[object, object]:
    op, ex, value = fr.opcode, fr.extras, bytes(fr.value)
    if op == Opcode.DCP_MUTATION:
        by, rev, flags, exp, lock = codec.parse_mutation(fr)
        *_, nmeta, nru = codec.MUTATION_EXTRAS.unpack(ex)
        return {
            "by_seqno": by,
            "rev_seqno": rev,
            "flags": flags,
            "expiration": exp,
            "lock_time": lock,
            "nmeta": nmeta,
            "nru": nru,
        }, value
    if op == Opcode.DCP_DELETION:
        by, rev, dt = codec.parse_deletion(fr)
        if dt is None:
            return {
                "by_seqno": by,
                "rev_seqno": rev,
                "nmeta": codec.DELETION_V1_EXTRAS.unpack(ex)[2],
            }, value
        return {
            "by_seqno": by,
            "rev_seqno": rev,
            "delete_time": dt,
            "unused": codec.DELETION_V2_EXTRAS.unpack(ex)[3],
        }, value
    if op == Opcode.DCP_EXPIRATION:
        by, rev, dt = codec.parse_expiration(fr)
        return {"by_seqno": by, "rev_seqno": rev, "delete_time": dt}, value
    if op == Opcode.DCP_SNAPSHOT_MARKER:
        s, e, flags, mvs, hcs = codec.parse_snapshot_marker(fr)
        if mvs is None:
            return {"start_seqno": s, "end_seqno": e, "flags": flags}, value
        return {"version": ex[0]}, {
            "start_seqno": s,
            "end_seqno": e,
            "flags": flags,
            "max_visible_seqno": mvs,
            "high_completed_seqno": hcs,
        }
    if op == Opcode.DCP_BUFFER_ACK:
        return {"bytes_to_ack": codec.parse_buffer_ack(fr)}, value
    if op == Opcode.DCP_STREAM_END:
        return {"status": codec.parse_stream_end(fr)}, value
    if op == Opcode.DCP_SEQNO_ADVANCED:
        return {"seqno": codec.parse_seqno_advanced(fr)}, value
    if op == Opcode.DCP_SEQNO_ACKNOWLEDGED:
        held, persisted = codec.parse_seqno_acknowledged(fr)
        return {"seqno": held}, (value if persisted is None else {"persisted_seqno": persisted})
    if op == Opcode.DCP_OPEN:
        _name, flags = codec.parse_open(fr)
        return {"seqno": codec.OPEN_EXTRAS.unpack(ex)[0], "flags": flags}, value
    if op == Opcode.DCP_STREAM_REQ:
        sr = codec.parse_stream_request(fr)
        return {
            "flags": sr.flags,
            "reserved": codec.STREAM_REQ_EXTRAS.unpack(ex)[1],
            "start_seqno": sr.start_seqno,
            "end_seqno": sr.end_seqno,
            "vb_uuid": sr.vb_uuid,
            "snap_start_seqno": sr.snap_start_seqno,
            "snap_end_seqno": sr.snap_end_seqno,
        }, sr.value
    if op in STORE_OPS:
        flags, exp = codec.parse_store_extras(fr)
        return {"flags": flags, "expiration": exp}, value
    if op == Opcode.HELLO:
        return None, codec.parse_hello_features(value)
    if op == Opcode.SET_VBUCKET_STATE:
        state, _options = codec.parse_set_vbucket_state(fr)
        return {"state": state}, value
    if op == Opcode.DCP_SET_VBUCKET_STATE:
        return {"state": codec.parse_dcp_set_vbucket_state(fr)}, value
    if op == Opcode.GET_ALL_VB_SEQNOS and ex:
        state = {"vbucket_state": codec.U32.unpack_from(ex)[0]}
        if len(ex) == 8:
            state["collection_id"] = codec.U32.unpack_from(ex, 4)[0]
        return state, value
    # Opcodes the spec does not type keep raw extras (b"" too); typed ones have none here.
    return (None if op in spec.REQUESTS else bytes(ex)), value


def _response_extras_value(fr: Frame) -> tuple[object, object]:
    op, status, value = fr.opcode, fr.status, bytes(fr.value)
    extras: object = None
    if op in WRITE_OPS:
        seq = codec.parse_mutation_seqno(fr)
        extras = None if seq is None else {"vb_uuid": seq[0], "seqno": seq[1]}
    elif op == Opcode.GET and fr.extras:
        extras = {"flags": codec.U32.unpack(fr.extras)[0]}
    elif op not in spec.RESPONSES:
        extras = bytes(fr.extras)
    if status == Status.SUCCESS and op in (Opcode.DCP_STREAM_REQ, Opcode.DCP_GET_FAILOVER_LOG):
        value = [{"vb_uuid": u, "seqno": s} for u, s in codec.parse_failover_log(value)]
    elif status == Status.ROLLBACK and op == Opcode.DCP_STREAM_REQ:
        err = for_status(status, value)
        assert isinstance(err, RollbackRequired)
        value = {"rollback_seqno": err.rollback_seqno}
    elif status == Status.SUCCESS and op == Opcode.GET_ALL_VB_SEQNOS:
        value = [{"vbucket": v, "seqno": s} for v, s in codec.parse_all_vb_seqnos(value)]
    elif status == Status.SUCCESS and op == Opcode.HELLO:
        value = codec.parse_hello_features(value)
    elif status == Status.SUCCESS and op == Opcode.GET_VBUCKET:
        assert len(value) == 4, "GET_VBUCKET answers 4 bytes"
        value = {"state": codec.U32.unpack(value)[0]}
    return extras, value


def decode(data: bytes) -> dict:
    """``data`` (one frame) read by the fast codec, as spec-shaped plain fields."""
    fr = decode_frame(data)
    response = fr.magic in RESPONSE_MAGIC
    out: dict = {
        "magic": fr.magic,
        "opcode": fr.opcode,
        "framing_extras_length": len(fr.framing_extras),
        "key_length": len(fr.key),
        "extras_length": len(fr.extras),
        "datatype": fr.datatype,
        ("status" if fr.is_response else "vbucket"): fr.vbucket,
        "body_length": fr.size - HEADER_SIZE,
        "opaque": fr.opaque,
        "cas": fr.cas,
    }
    if fr.magic in (Magic.ALT_REQUEST, Magic.ALT_RESPONSE):
        out["framing_extras"] = _decode_frame_infos(fr)
    if fr.magic in REQUEST_MAGIC:
        extras, value = _request_extras_value(fr)
    elif response:
        extras, value = _response_extras_value(fr)
    else:
        extras, value = bytes(fr.extras), bytes(fr.value)
    if extras is not None:
        out["extras"] = extras
    out["key"] = bytes(fr.key)
    out["value"] = value
    return out
