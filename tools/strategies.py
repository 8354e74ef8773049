"""Hypothesis strategies: spec-shaped fields for every frame kind the codec can build.

Each strategy draws the dict ``spec.build_frame`` takes, limited to what the fast codec's
builders can express (e.g. ``buffer_ack`` always has vbucket 0, reserved bytes are 0).
"""

from __future__ import annotations

from hypothesis import strategies as st

from dcp.protocol.opcodes import FrameInfoId, Magic, Opcode, Status

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFF_FFFF)
u64 = st.integers(0, 0xFFFF_FFFF_FFFF_FFFF)
doc_keys = st.binary(min_size=1, max_size=40)
values = st.binary(max_size=64)
ascii_text = st.text("abcdefghijklmnopqrstuvwxyz_0123456789.:", min_size=1, max_size=30)


def _frame(magic: int, opcode: int, **parts) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(
        {"magic": st.just(int(magic)), "opcode": st.just(int(opcode)), **parts}
    )


def req(opcode: int, **parts) -> st.SearchStrategy[dict]:
    return _frame(Magic.REQUEST, opcode, opaque=u32, **parts)


def resp(opcode: int, status=st.just(0), **parts) -> st.SearchStrategy[dict]:
    return _frame(Magic.RESPONSE, opcode, status=status, opaque=u32, **parts)


def _extras(**fields) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries(fields)


def _with_frame_infos(base: st.SearchStrategy[dict], infos) -> st.SearchStrategy[dict]:
    return st.tuples(base, infos).map(
        lambda t: {**t[0], "magic": int(Magic.ALT_REQUEST), "framing_extras": t[1]}
    )


mutation_extras = _extras(by_seqno=u64, rev_seqno=u64, flags=u32, expiration=u32, lock_time=u32)
dcp_mutation = req(
    Opcode.DCP_MUTATION,
    vbucket=u16,
    cas=u64,
    datatype=st.integers(0, 7),
    extras=mutation_extras,
    key=doc_keys,
    value=values,
)
stream_id_info = st.builds(
    lambda sid: [{"id": int(FrameInfoId.DCP_STREAM_ID), "stream_id": sid}], u16
)
durability_info = st.one_of(
    st.builds(lambda lvl: [{"id": int(FrameInfoId.DURABILITY), "level": lvl}], st.integers(1, 4)),
    st.builds(
        lambda lvl, t: [{"id": int(FrameInfoId.DURABILITY), "level": lvl, "timeout_ms": t}],
        st.integers(1, 4),
        u16,
    ),
)
store_extras = _extras(flags=u32, expiration=u32)
failover_log = st.lists(st.fixed_dictionaries({"vb_uuid": u64, "seqno": u64}), max_size=5)
write_seqno = st.one_of(st.none(), _extras(vb_uuid=u64, seqno=u64))
features = st.lists(u16, max_size=8)


def _store(op: int) -> st.SearchStrategy[dict]:
    return req(
        op,
        vbucket=u16,
        cas=u64,
        datatype=st.integers(0, 7),
        extras=store_extras,
        key=doc_keys,
        value=values,
    )


#: name -> strategy of fields; the hot-path kinds come first.
KINDS: dict[str, st.SearchStrategy[dict]] = {
    "dcp_mutation": dcp_mutation,
    "dcp_mutation_stream_id": _with_frame_infos(dcp_mutation, stream_id_info),
    "dcp_deletion_v1": req(
        Opcode.DCP_DELETION,
        vbucket=u16,
        cas=u64,
        datatype=st.integers(0, 7),
        extras=_extras(by_seqno=u64, rev_seqno=u64),
        key=doc_keys,
        value=values,
    ),
    "dcp_deletion_v2": req(
        Opcode.DCP_DELETION,
        vbucket=u16,
        cas=u64,
        datatype=st.integers(0, 7),
        extras=_extras(by_seqno=u64, rev_seqno=u64, delete_time=u32),
        key=doc_keys,
        value=values,
    ),
    "dcp_expiration": req(
        Opcode.DCP_EXPIRATION,
        vbucket=u16,
        cas=u64,
        extras=_extras(by_seqno=u64, rev_seqno=u64, delete_time=u32),
        key=doc_keys,
    ),
    "dcp_snapshot_marker_v1": st.builds(
        lambda f, a, b: {
            **f,
            "extras": {**f["extras"], "start_seqno": min(a, b), "end_seqno": max(a, b)},
        },
        req(Opcode.DCP_SNAPSHOT_MARKER, vbucket=u16, extras=_extras(flags=st.integers(0, 63))),
        u64,
        u64,
    ),
    "dcp_snapshot_marker_v2_0": st.builds(
        lambda f, a, b: {
            **f,
            "value": {**f["value"], "start_seqno": min(a, b), "end_seqno": max(a, b)},
        },
        req(
            Opcode.DCP_SNAPSHOT_MARKER,
            vbucket=u16,
            extras=st.just({"version": 0}),
            value=_extras(
                flags=st.integers(0, 63), max_visible_seqno=u64, high_completed_seqno=u64
            ),
        ),
        u64,
        u64,
    ),
    "dcp_buffer_ack": req(Opcode.DCP_BUFFER_ACK, extras=_extras(bytes_to_ack=u32)),
    "set_request": _store(Opcode.SET),
    "set_request_durable": _with_frame_infos(_store(Opcode.SET), durability_info),
    "set_response": resp(Opcode.SET, cas=u64, extras=write_seqno),
    "add_request": _store(Opcode.ADD),
    "replace_request": _store(Opcode.REPLACE),
    "delete_request": req(Opcode.DELETE, vbucket=u16, cas=u64, key=doc_keys),
    "delete_response": resp(Opcode.DELETE, cas=u64, extras=write_seqno),
    "get_request": req(Opcode.GET, vbucket=u16, key=doc_keys),
    "get_response": resp(
        Opcode.GET, cas=u64, datatype=st.integers(0, 7), extras=_extras(flags=u32), value=values
    ),
    "get_response_miss": resp(Opcode.GET, status=st.just(int(Status.KEY_ENOENT)), value=values),
    "dcp_stream_end": req(Opcode.DCP_STREAM_END, vbucket=u16, extras=_extras(status=u32)),
    "dcp_seqno_advanced": req(Opcode.DCP_SEQNO_ADVANCED, vbucket=u16, extras=_extras(seqno=u64)),
    "dcp_seqno_acknowledged": req(
        Opcode.DCP_SEQNO_ACKNOWLEDGED,
        vbucket=u16,
        extras=_extras(seqno=u64),
        value=st.one_of(st.just(b""), _extras(persisted_seqno=u64)),
    ),
    "dcp_open": req(
        Opcode.DCP_OPEN,
        extras=_extras(flags=u32),
        key=st.binary(min_size=1, max_size=200),
        value=values,
    ),
    "dcp_control": req(
        Opcode.DCP_CONTROL, key=ascii_text.map(str.encode), value=ascii_text.map(str.encode)
    ),
    "dcp_stream_req": req(
        Opcode.DCP_STREAM_REQ,
        vbucket=u16,
        extras=_extras(
            flags=u32,
            start_seqno=u64,
            end_seqno=u64,
            vb_uuid=u64,
            snap_start_seqno=u64,
            snap_end_seqno=u64,
        ),
        value=values,
    ),
    "dcp_stream_req_response_ok": resp(Opcode.DCP_STREAM_REQ, value=failover_log),
    "dcp_stream_req_response_rollback": resp(
        Opcode.DCP_STREAM_REQ,
        status=st.just(int(Status.ROLLBACK)),
        value=_extras(rollback_seqno=u64),
    ),
    "dcp_get_failover_log": req(Opcode.DCP_GET_FAILOVER_LOG, vbucket=u16),
    "dcp_get_failover_log_response": resp(Opcode.DCP_GET_FAILOVER_LOG, value=failover_log),
    "dcp_close_stream": req(Opcode.DCP_CLOSE_STREAM, vbucket=u16),
    "dcp_close_stream_response": resp(
        Opcode.DCP_CLOSE_STREAM, status=st.sampled_from([0, int(Status.KEY_ENOENT)])
    ),
    "dcp_noop": req(Opcode.DCP_NOOP),
    "dcp_noop_response": resp(Opcode.DCP_NOOP),
    "get_all_vb_seqnos": req(
        Opcode.GET_ALL_VB_SEQNOS,
        extras=st.one_of(
            st.none(),
            _extras(vbucket_state=st.integers(0, 4)),
            _extras(vbucket_state=st.integers(0, 4), collection_id=u32),
        ),
    ),
    "get_all_vb_seqnos_response": resp(
        Opcode.GET_ALL_VB_SEQNOS,
        value=st.lists(st.fixed_dictionaries({"vbucket": u16, "seqno": u64}), max_size=8),
    ),
    "set_vbucket_state": req(
        Opcode.SET_VBUCKET_STATE, vbucket=u16, extras=_extras(state=st.integers(1, 4))
    ),
    "set_vbucket_state_response": resp(
        Opcode.SET_VBUCKET_STATE, status=st.sampled_from([0, int(Status.NOT_MY_VBUCKET)])
    ),
    "get_vbucket": req(Opcode.GET_VBUCKET, vbucket=u16),
    "get_vbucket_response": resp(Opcode.GET_VBUCKET, value=_extras(state=st.integers(1, 4))),
    "dcp_set_vbucket_state": req(
        Opcode.DCP_SET_VBUCKET_STATE, vbucket=u16, extras=_extras(state=st.integers(1, 4))
    ),
    "dcp_set_vbucket_state_response": resp(Opcode.DCP_SET_VBUCKET_STATE),
    "hello": req(Opcode.HELLO, key=ascii_text.map(str.encode), value=features),
    "hello_response": resp(Opcode.HELLO, value=features),
    "noop": req(Opcode.NOOP),
    "version_response": resp(Opcode.VERSION, value=ascii_text.map(str.encode)),
    "stat_request": req(Opcode.STAT, key=ascii_text.map(str.encode)),
    "stat_response": resp(
        Opcode.STAT, key=ascii_text.map(str.encode), value=ascii_text.map(str.encode)
    ),
}

#: Frames of opcodes the spec does not type (and server-initiated magics): raw parts.
untyped_frames = st.fixed_dictionaries(
    {
        "magic": st.sampled_from(
            [
                int(Magic.REQUEST),
                int(Magic.RESPONSE),
                int(Magic.SERVER_REQUEST),
                int(Magic.SERVER_RESPONSE),
            ]
        ),
        "opcode": st.sampled_from([0x5A, 0x5F, 0x60, 0x89, 0xB7, 0xEE]),
        "datatype": u8,
        "opaque": u32,
        "cas": u64,
        "extras": st.binary(max_size=40),
        "key": st.binary(max_size=40),
        "value": values,
        "vbucket_or_status": u16,
    }
).map(
    lambda f: {
        **{k: v for k, v in f.items() if k != "vbucket_or_status"},
        ("status" if f["magic"] in (0x81, 0x83) else "vbucket"): f["vbucket_or_status"],
    }
)
