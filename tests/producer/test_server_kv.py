"""KV requests on the DCP port: HELLO, writes with CAS, seqnos, durability, STAT."""

from __future__ import annotations

import trio

from dcp.protocol import DurabilityLevel, HelloFeature, Opcode, Status, codec

from .wire import keys_for_vb


async def test_hello_answers_the_supported_subset_in_request_order(client) -> None:
    got = await client.hello(
        [
            HelloFeature.COLLECTIONS,
            HelloFeature.JSON,
            HelloFeature.MUTATION_SEQNO,
            HelloFeature.XERROR,
        ]
    )
    assert got == [HelloFeature.JSON, HelloFeature.MUTATION_SEQNO, HelloFeature.XERROR]


async def test_version_and_noop(client) -> None:
    r = await client.call(codec.request(Opcode.VERSION, opaque=7), 7)
    assert r.status == 0 and bytes(r.value).startswith(b"dcp-stream/")
    r = await client.call(codec.request(Opcode.NOOP, opaque=8), 8)
    assert r.status == 0


async def test_writes_return_cas_and_with_mutation_seqno_the_vbucket_uuid_and_seqno(
    server, client
) -> None:
    await client.hello([HelloFeature.MUTATION_SEQNO])
    k1, k2 = keys_for_vb(2, 2, 4)
    r1 = await client.set(k1, b"one")
    r2 = await client.set(k2, b"two")
    uuid, seqno = codec.parse_mutation_seqno(r1)
    assert seqno == 1 and uuid == server.bucket.vbucket(2).uuid
    assert codec.parse_mutation_seqno(r2)[1] == 2
    assert r1.cas and r2.cas and r1.cas != r2.cas
    g = await client.get(k1)
    assert g.status == 0 and bytes(g.value) == b"one" and g.cas == r1.cas


async def test_add_replace_delete_and_cas_rules(client) -> None:
    (k,) = keys_for_vb(0, 1, 4)
    assert (await client.store(Opcode.REPLACE, k, b"x")).status == Status.KEY_ENOENT
    r = await client.store(Opcode.ADD, k, b"a", flags=0xDEADBEEF)
    assert r.status == Status.SUCCESS
    assert (await client.store(Opcode.ADD, k, b"b")).status == Status.KEY_EEXISTS
    assert (await client.store(Opcode.SET, k, b"c", cas=r.cas + 1)).status == Status.KEY_EEXISTS
    r2 = await client.store(Opcode.SET, k, b"c", cas=r.cas)
    assert r2.status == Status.SUCCESS
    g = await client.get(k)
    assert bytes(g.value) == b"c" and codec.U32.unpack(g.extras)[0] == 0
    assert (await client.delete(k, cas=r.cas)).status == Status.KEY_EEXISTS
    assert (await client.delete(k, cas=r2.cas)).status == Status.SUCCESS
    assert (await client.get(k)).status == Status.KEY_ENOENT
    assert (await client.delete(k)).status == Status.KEY_ENOENT


async def test_wrong_vbucket_and_oversize_key_are_errors_not_crashes(client) -> None:
    (k,) = keys_for_vb(0, 1, 4)
    assert (await client.store(Opcode.SET, k, b"x", vb=1)).status == Status.NOT_MY_VBUCKET
    assert (await client.store(Opcode.SET, k, b"x", vb=77)).status == Status.NOT_MY_VBUCKET
    big = b"k" * 251
    r = await client.store(Opcode.SET, big, b"x")
    assert r.status in (Status.EINVAL, Status.E2BIG)
    assert (await client.get(k)).status == Status.KEY_ENOENT


async def test_durable_write_is_acknowledged_only_after_it_is_persisted(server, client) -> None:
    await client.hello([HelloFeature.MUTATION_SEQNO, HelloFeature.ALT_REQUEST_SUPPORT])
    (k,) = keys_for_vb(3, 1, 4)
    server.pause_persistence()
    op = next(client.opaques)
    frame = codec.request(
        Opcode.SET,
        vbucket=3,
        opaque=op,
        extras=codec.store_extras(0, 0),
        key=k,
        value=b"durable",
        framing_extras=codec.durability_frame_info(DurabilityLevel.PERSIST_TO_MAJORITY),
    )
    await client.send(frame)
    assert not await client.frames_for(0.4), "durable write acked before persistence"
    server.resume_persistence()
    r = await client.next_frame(5)
    assert r.opaque == op and r.status == Status.SUCCESS
    seqno = codec.parse_mutation_seqno(r)[1]
    assert server.bucket.vbucket(3).persisted_seqno >= seqno


async def test_flush_interval_batches_plain_writes_but_never_delays_a_durable_one(tmp_path) -> None:
    from .conftest import client_of, running_server

    async with running_server(tmp_path / "d", flush_interval=30.0) as server:
        async with client_of(server) as client:
            await client.hello([HelloFeature.MUTATION_SEQNO])
            k1, k2, k3 = keys_for_vb(1, 3, 4)
            await client.set(k1, b"first")  # the flusher writes it, then pauses 30 s
            with trio.fail_after(5):
                while server.bucket.vbucket(1).persisted_seqno < 1:
                    await trio.sleep(0.01)
            await client.set(k2, b"plain")  # waits for the next flush
            await trio.sleep(0.3)
            assert server.bucket.vbucket(1).persisted_seqno == 1
            op = next(client.opaques)
            await client.send(
                codec.request(
                    Opcode.SET,
                    vbucket=1,
                    opaque=op,
                    extras=codec.store_extras(0, 0),
                    key=k3,
                    value=b"durable",
                    framing_extras=codec.durability_frame_info(DurabilityLevel.PERSIST_TO_MAJORITY),
                )
            )
            r = await client.next_frame(2)  # not after 30 s: the durable write cut it short
            assert r.opaque == op and r.status == Status.SUCCESS
            assert server.bucket.vbucket(1).persisted_seqno == 3


async def test_a_durable_write_behind_a_flush_backlog_is_not_held_by_the_interval(tmp_path) -> None:
    """Batches capped at 4 items, a 30 s interval, one pending item on each of 64
    vbuckets: the flusher drains the backlog without pausing, so a durable write on
    any vbucket is answered at once."""
    from .conftest import client_of, running_server

    async with running_server(
        tmp_path / "d", num_vbuckets=64, flush_interval=30.0, flush_batch_items=4
    ) as server:
        async with client_of(server) as client:
            await client.hello([HelloFeature.MUTATION_SEQNO])
            server.pause_persistence()
            await client.set_many([(keys_for_vb(vb, 1, 64)[0], b"x") for vb in range(64)])
            server.resume_persistence()
            k = keys_for_vb(63, 2, 64)[1]
            op = next(client.opaques)
            await client.send(
                codec.request(
                    Opcode.SET,
                    vbucket=63,
                    opaque=op,
                    extras=codec.store_extras(0, 0),
                    key=k,
                    value=b"durable",
                    framing_extras=codec.durability_frame_info(DurabilityLevel.PERSIST_TO_MAJORITY),
                )
            )
            r = await client.next_frame(3)
            assert r.opaque == op and r.status == Status.SUCCESS
            assert all(server.bucket.vbucket(vb).persisted_seqno >= 1 for vb in range(64))


async def test_pipelined_requests_are_answered_in_order(client) -> None:
    keys = [b"p-%d" % i for i in range(300)]
    frames = await client.set_many([(k, k) for k in keys])
    assert [f.opaque for f in frames] == sorted(f.opaque for f in frames)


async def test_stat_groups_use_couchbase_key_names(server, client) -> None:
    for k in keys_for_vb(1, 3, 4):
        await client.set(k, b"x")
    s = await client.stats("vbucket-seqno 1")
    assert s["vb_1:high_seqno"] == "3"
    assert s["vb_1:vb_uuid"] == str(server.bucket.vbucket(1).uuid)
    f = await client.stats("failovers 1")
    assert f["vb_1:num_entries"] == "1" and f["vb_1:0:seq"] == "0"
    c = await client.stats("checkpoint 1")
    assert any(k.startswith("vb_1:") for k in c)
    await client.dcp_open("t-stats")
    await client.stream_req(1)
    await trio.sleep(0.1)
    d = await client.stats("dcp")
    assert d["ep_dcp_count"] == "1"
    assert any(":stream_1_" in k for k in d)
    general = await client.stats("")
    assert general["ep_num_vbuckets"] == "4"
    op = next(client.opaques)
    r = await client.call(codec.request(Opcode.STAT, opaque=op, key=b"no-such-group"), op)
    assert r.status == Status.KEY_ENOENT


async def test_get_all_vb_seqnos_lists_high_seqnos(client) -> None:
    for k in keys_for_vb(2, 4, 4):
        await client.set(k, b"x")
    op = next(client.opaques)
    r = await client.call(
        codec.request(Opcode.GET_ALL_VB_SEQNOS, opaque=op, extras=codec.U32.pack(1)), op
    )
    assert codec.parse_all_vb_seqnos(r.value) == [(0, 0), (1, 0), (2, 4), (3, 0)]
