"""Privileges on the wire: before authentication only HELLO, NOOP and SASL; after it,
each served opcode is allowed exactly to the users whose privileges include what
``OPCODE_PRIVILEGES`` says (table-driven over every opcode, with and without it)."""

from __future__ import annotations

import pytest

from dcp.producer.auth import OPCODE_PRIVILEGES, PRE_AUTH_OPCODES
from dcp.producer.dispatch import HANDLERS
from dcp.producer.users import PRIVILEGES, privileges_of
from dcp.protocol import DcpOpenFlag, Opcode, Status, StreamRequestFlag, VBucketState, codec

from .conftest import USERS, connect, logged_in, request_status

SASL = {Opcode.SASL_LIST_MECHS, Opcode.SASL_AUTH, Opcode.SASL_STEP}


def test_the_privilege_table_covers_exactly_the_served_opcodes():
    assert set(OPCODE_PRIVILEGES) == set(HANDLERS.requests) | SASL
    assert set(OPCODE_PRIVILEGES.values()) == {None, *PRIVILEGES}
    assert {op for op in PRE_AUTH_OPCODES} <= {
        op for op, need in OPCODE_PRIVILEGES.items() if need is None
    }


def frame_for(op: int, opaque: int) -> bytes:
    """A well-formed request of ``op`` whose answer does no harm to the next ones."""
    key = b"k1"
    store = {"extras": codec.store_extras(0, 0), "key": key, "value": b"v"}
    match op:
        case Opcode.HELLO:
            return codec.hello("priv-test", [], opaque)
        case Opcode.SET | Opcode.ADD | Opcode.REPLACE:
            return codec.request(op, vbucket=codec.vbucket_for_key(key, 4), opaque=opaque, **store)
        case Opcode.GET | Opcode.DELETE:
            return codec.request(op, vbucket=codec.vbucket_for_key(key, 4), opaque=opaque, key=key)
        case Opcode.SET_VBUCKET_STATE:  # vbucket 0 is active already: a no-op
            return codec.set_vbucket_state(0, VBucketState.ACTIVE, opaque)
        case Opcode.DCP_OPEN:
            return codec.dcp_open("priv-test", DcpOpenFlag.PRODUCER, opaque)
        case Opcode.DCP_CONTROL:
            return codec.dcp_control("enable_noop", "true", opaque)
        case Opcode.DCP_STREAM_REQ:
            return codec.stream_request(0, opaque, flags=0, start=0, end=0, vb_uuid=0)
        case Opcode.DCP_BUFFER_ACK:
            return codec.buffer_ack(10, opaque)
        case Opcode.DCP_SEQNO_ACKNOWLEDGED:
            return codec.seqno_acknowledged(1, opaque, 0, 0)
        case Opcode.SASL_LIST_MECHS:
            return codec.sasl_list_mechs(opaque)
        case _:  # header-only requests (NOOP, VERSION, STAT, GET_VBUCKET, ...)
            return codec.request(op, opaque=opaque)


#: Checked on a plain connection, in this order (k1 exists beforehand, so each request
#: a user may make succeeds: GET finds it, REPLACE and DELETE too, ADD uses a new key)
KV_ORDER = [
    Opcode.HELLO,
    Opcode.NOOP,
    Opcode.VERSION,
    Opcode.GET_VBUCKET,
    Opcode.GET_CLUSTER_CONFIG,
    Opcode.SASL_LIST_MECHS,
    Opcode.GET,
    Opcode.SET,
    Opcode.REPLACE,
    Opcode.ADD,
    Opcode.DELETE,
    Opcode.STAT,
    Opcode.GET_ALL_VB_SEQNOS,
    Opcode.SET_VBUCKET_STATE,
]
#: Checked on a second connection, DCP_OPEN first: the others need an open producer
DCP_ORDER = [
    Opcode.DCP_OPEN,
    Opcode.DCP_CONTROL,
    Opcode.DCP_GET_FAILOVER_LOG,
    Opcode.DCP_STREAM_REQ,
    Opcode.DCP_CLOSE_STREAM,
    Opcode.DCP_BUFFER_ACK,
    Opcode.DCP_SEQNO_ACKNOWLEDGED,
]
#: What an allowed request answers (SUCCESS unless listed): a buffer ack has no answer;
#: a seqno ack reaches its handler, which wants a consumer_name this connection lacks
ALLOWED_STATUS = {Opcode.DCP_BUFFER_ACK: None, Opcode.DCP_SEQNO_ACKNOWLEDGED: Status.EINVAL}
OPEN_ENDED = 2**64 - 1


def ordered_frame(op: int, opaque: int) -> bytes:
    """``frame_for``, adjusted to the ordered run: ADD a new key; the stream request is
    open-ended on vbucket 1 so that CLOSE_STREAM finds it."""
    match op:
        case Opcode.ADD:
            key = b"k-added"
            return codec.request(
                op,
                vbucket=codec.vbucket_for_key(key, 4),
                opaque=opaque,
                extras=codec.store_extras(0, 0),
                key=key,
                value=b"v",
            )
        case Opcode.DCP_STREAM_REQ:
            return codec.stream_request(1, opaque, flags=0, start=0, end=OPEN_ENDED, vb_uuid=0)
        case Opcode.DCP_CLOSE_STREAM:
            return codec.request(op, vbucket=1, opaque=opaque)
        case _:
            return frame_for(op, opaque)


def test_the_ordered_runs_cover_every_opcode():
    assert set(KV_ORDER) | set(DCP_ORDER) | {Opcode.SASL_AUTH, Opcode.SASL_STEP} == set(
        OPCODE_PRIVILEGES
    )


@pytest.mark.parametrize("user", sorted(USERS))
async def test_each_privilege_allows_its_opcodes_and_nothing_more(server, user):
    """Each well-formed request a user may make succeeds; each it may not is EACCESS."""
    privileges = privileges_of(USERS[user])
    async with logged_in(server, "u_all") as c:
        assert (await c.set(b"k1", b"v")).status == Status.SUCCESS
    seen = {}
    for order in (KV_ORDER, DCP_ORDER):
        async with logged_in(server, user) as c:
            for op in order:
                opaque = next(c.opaques)
                seen[op] = await request_status(c, ordered_frame(op, opaque), opaque)
    expected = {
        op: Status.EACCESS
        if need is not None and need not in privileges
        else ALLOWED_STATUS.get(op, Status.SUCCESS)
        for op, need in OPCODE_PRIVILEGES.items()
        if op in seen
    }
    wrong = {Opcode(op).name: (seen[op], expected[op]) for op in seen if seen[op] != expected[op]}
    assert not wrong, wrong


@pytest.mark.parametrize("user", sorted(USERS))
async def test_a_takeover_stream_request_needs_admin(server, user):
    """A TAKEOVER stream hands the vbucket over (this node's copy dies): ``stream``
    alone must not allow it, however the flags are combined."""
    privileges = USERS[user][0]
    async with logged_in(server, user) as c:
        opaque = next(c.opaques)
        opened = await request_status(c, frame_for(Opcode.DCP_OPEN, opaque), opaque)
        for flags in (StreamRequestFlag.TAKEOVER, StreamRequestFlag.TAKEOVER | 0x10):
            opaque = next(c.opaques)
            request = codec.stream_request(0, opaque, flags=int(flags), start=0, end=0, vb_uuid=0)
            status = await request_status(c, request, opaque)
            if privileges == "all":
                assert status == Status.SUCCESS  # an admin may move vbucket 0
                return
            assert status == Status.EACCESS, (user, opened, status)
    assert server.bucket.vbucket(0).state is VBucketState.ACTIVE  # untouched


async def test_before_authentication_everything_else_is_eaccess(server):
    allowed = {int(op) for op in PRE_AUTH_OPCODES}
    async with connect(server) as c:
        statuses = {}
        for op in range(256):
            if op in (Opcode.SASL_AUTH, Opcode.SASL_STEP):
                continue  # they answer (AUTH_ERROR/EINVAL) and count as failures
            opaque = next(c.opaques)
            statuses[op] = await request_status(c, frame_for(op, opaque), opaque)
    wrong = {
        hex(op): s
        for op, s in statuses.items()
        if (s == Status.EACCESS) == (op in allowed) or s is None
    }
    assert not wrong, wrong
    assert statuses[Opcode.HELLO] == statuses[Opcode.NOOP] == Status.SUCCESS


async def test_pipelined_sets_cannot_bypass_the_gate(server):
    """The SET fast path applies runs of SETs straight from the bytes: it must refuse
    them before authentication and for a user without ``write``, one EACCESS each."""
    pairs = [(f"key{i}".encode(), b"value") for i in range(50)]

    async def pipelined(c) -> list[int]:
        ops = [next(c.opaques) for _ in pairs]
        await c.send(
            b"".join(
                codec.request(
                    Opcode.SET,
                    vbucket=c.vb(k),
                    opaque=op,
                    extras=codec.store_extras(0, 0),
                    key=k,
                    value=v,
                )
                for op, (k, v) in zip(ops, pairs, strict=True)
            )
        )
        return [(await c.next_frame()).status for _ in ops]

    async with connect(server) as c:
        assert await pipelined(c) == [Status.EACCESS] * len(pairs)
    async with logged_in(server, "u_read") as c:
        assert await pipelined(c) == [Status.EACCESS] * len(pairs)
        assert (await c.get(b"key1")).status == Status.KEY_ENOENT  # nothing was stored
    async with logged_in(server, "u_write") as c:
        assert await pipelined(c) == [Status.SUCCESS] * len(pairs)
    async with logged_in(server, "u_read") as c:
        assert (await c.get(b"key1")).status == Status.SUCCESS


async def test_stream_request_needs_stream(server):
    async with logged_in(server, "u_read") as c:
        op = next(c.opaques)
        assert await request_status(c, frame_for(Opcode.DCP_OPEN, op), op) == Status.EACCESS
    async with logged_in(server, "u_stream") as c:
        op = next(c.opaques)
        assert await request_status(c, frame_for(Opcode.DCP_OPEN, op), op) == Status.SUCCESS
        op = next(c.opaques)
        r = await c.call(codec.stream_request(0, op, flags=0, start=0, end=0, vb_uuid=0), op)
        assert r.status == Status.SUCCESS


async def test_eaccess_says_why(server):
    async with connect(server) as c:
        op = next(c.opaques)
        r = await c.call(frame_for(Opcode.GET, op), op)
        assert r.status == Status.EACCESS and b"authenticate first" in bytes(r.value)
    async with logged_in(server, "u_stats") as c:
        op = next(c.opaques)
        r = await c.call(frame_for(Opcode.SET, op), op)
        assert r.status == Status.EACCESS
        assert b"lacks the 'write' privilege" in bytes(r.value)
