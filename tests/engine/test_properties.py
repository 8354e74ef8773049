"""Property tests: whatever the interleaving, a stream that follows the contract ends with
exactly the bucket's state, sees strictly increasing seqnos, and never a partial
snapshot's inconsistency at snapshot ends."""

from __future__ import annotations

import itertools
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp.producer.engine import Bucket, ItemOp

from .conftest import FakeClock, small_config

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("set"), st.integers(0, 7)),
        st.tuples(st.just("del"), st.integers(0, 7)),
        st.tuples(st.just("flush"), st.just(0)),
        st.tuples(st.just("ckpt"), st.just(0)),
        st.tuples(st.just("take"), st.just(0)),
    ),
    max_size=80,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, quota=st.sampled_from([1 << 30, 3000]))
def test_stream_converges_to_bucket_state(ops, quota) -> None:
    uuid = itertools.count(1)
    with tempfile.TemporaryDirectory() as d:
        b = Bucket.open(
            d,
            small_config(checkpoint_max_items=3, checkpoint_memory_quota=quota),
            clock=FakeClock(),
            uuid_source=lambda: next(uuid),
        )
        try:
            seen: dict[bytes, bytes | None] = {}
            state: dict[bytes, bytes | None] = {}
            last = 0

            def apply(items) -> None:
                nonlocal last
                for it in items:
                    assert it.seqno > last
                    last = it.seqno
                    seen[it.key] = it.value if it.op == ItemOp.MUTATION else None

            def resume():
                reg = b.vbucket(0).checkpoints.register_cursor("s", last)
                skip = last
                if reg.backfill:
                    with b.storage.open_backfill(0, last) as scan:
                        apply(scan.read(1 << 30))
                        skip = scan.end_seqno
                return reg.cursor, skip

            cursor, skip = resume()

            def take() -> None:
                nonlocal cursor, skip
                if cursor.dropped:
                    cursor, skip = resume()
                for snap in b.vbucket(0).checkpoints.take(cursor, 1 << 30):
                    apply(it for it in snap.items if it.seqno > skip)
                    if snap.end > skip:
                        # at a snapshot end the stream's view is a real past state
                        assert {k: v for k, v in seen.items() if v is not None} == {
                            k: v for k, v in history[snap.end].items() if v is not None
                        }

            history: dict[int, dict[bytes, bytes | None]] = {0: {}}
            for i, (op, k) in enumerate(ops):
                key = b"k%d" % k
                if op == "set":
                    r = b.set(0, key, b"v%d" % i)
                    state[key] = b"v%d" % i
                    history[r.seqno] = dict(state)
                elif op == "del" and state.get(key) is not None:
                    r = b.delete(0, key)
                    state[key] = None
                    history[r.seqno] = dict(state)
                elif op == "flush":
                    b.flusher.flush_all()
                elif op == "ckpt":
                    b.vbucket(0).checkpoints.create_checkpoint()
                elif op == "take":
                    take()
            take()
            if cursor.dropped:
                take()
            live = {k: v for k, v in state.items() if v is not None}
            assert {k: v for k, v in seen.items() if v is not None} == live
        finally:
            b.close(clean=False)
