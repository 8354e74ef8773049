"""Stable-only gating of one ``ActiveStream`` alone, with stand-ins for its vbucket,
connection and the durability monitor: the paths the wire tests cannot easily reach
(a disk backfill that ends without any marker, an early wake-up, a dead stream)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from dcp.producer.active_stream import ActiveStream, StreamOptions
from dcp.protocol import Opcode, StreamEndStatus, codec
from dcp.protocol.raw_session import RawSession

from .test_stable_only import FakeDurability


class _Log:
    def can_send(self) -> bool:
        return True

    def record(self, n: int) -> None:
        pass


class _Checkpoints:
    """A vbucket whose memory no longer covers the stream: it must backfill."""

    def register_cursor(self, name: str, seqno: int) -> Any:
        return SimpleNamespace(cursor=SimpleNamespace(dropped=False), backfill=True)

    def remove_cursor(self, cursor: Any) -> None:
        pass

    def take_wire(self, cursor: Any, n: int) -> list[Any]:
        return []  # nothing new in memory


class _Conn:
    def __init__(self, durability: FakeDurability) -> None:
        self.server = SimpleNamespace(durability=durability)
        self.closed = False
        self.readied: list[ActiveStream] = []

    def mark_ready(self, stream: ActiveStream) -> None:
        self.readied.append(stream)


def _stream(end: int, fake: FakeDurability, **opts: bool) -> tuple[ActiveStream, _Conn]:
    s = ActiveStream(
        name="t",
        vbucket=SimpleNamespace(vbid=0, checkpoints=_Checkpoints(), high_seqno=end),
        opaque=7,
        start_seqno=0,
        end_seqno=end,
        options=StreamOptions(stable_only=True, **opts),
        on_backfill=lambda stream: None,
    )
    conn = s.conn = _Conn(fake)
    s.activate()
    return s, conn


def _fill(s: ActiveStream) -> list[Any]:
    buf = bytearray()
    s.fill(buf, _Log(), 1 << 20)
    return list(RawSession().receive_data(bytes(buf)))


def test_a_backfill_that_ends_without_a_marker_ends_the_stream_only_once_stable() -> None:
    fake = FakeDurability()
    s, conn = _stream(5, fake)
    s.push_backfill_done(5)  # the disk covered [0, 5] but held no item to send
    fake.stable[0] = 4
    assert _fill(s) == [] and _fill(s) == []
    assert fake.registered == 1
    fake.advance(0, 5)
    assert conn.readied == [s]
    (end,) = _fill(s)
    assert end.opcode == Opcode.DCP_STREAM_END
    assert codec.parse_stream_end(end) == StreamEndStatus.OK


def test_a_disk_snapshot_complete_by_seqno_advanced_announces_nothing_above_stable() -> None:
    fake = FakeDurability()
    s, _ = _stream(10, fake, seqno_advanced=True)
    s.push_backfill_marker(1, 5)
    fake.advance(0, 5)
    assert [f.opcode for f in _fill(s)] == [Opcode.DCP_SNAPSHOT_MARKER]
    s.push_backfill_done(5)  # no item at 5 (a purged tombstone): SEQNO_ADVANCED ends it
    fake.stable[0] = 4  # a replica rolled back: stable went down after the marker left
    assert _fill(s) == []
    fake.advance(0, 5)
    (adv,) = _fill(s)
    assert adv.opcode == Opcode.DCP_SEQNO_ADVANCED


def test_an_early_wake_up_waits_again_and_a_dead_stream_is_not_marked_ready() -> None:
    fake = FakeDurability()
    s, conn = _stream(5, fake)
    s.push_backfill_marker(1, 5)
    assert _fill(s) == []
    (_, seqno, wake) = fake.waits.pop()
    assert seqno == 5
    wake()  # a topology change: the monitor wakes every waiter, stable still 0
    assert conn.readied == [s]
    assert _fill(s) == [] and fake.registered == 2  # checked again, waiting again
    late = fake.waits[-1][2]
    assert s._queue  # the held marker
    s.release()
    assert fake.waits == []  # released: its callback is taken back
    assert not s._queue  # and what it held is let go
    late()  # one already on its way is harmless
    assert conn.readied == [s]  # nobody is woken for a released stream
