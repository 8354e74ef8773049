"""The per-frame hot paths of a stream: ``FrameWriter``, one per ``ActiveStream``.

Rules of this module:
- A ``FrameWriter`` is the stream's collaborator for frame output (composition: the
  stream holds one and has no base class). It owns the send position (``cur``, the
  items list or wire run being sent, and ``i``, the next frame of it), the frame
  counters and ``last_seqno``, the seqno of the last frame written; the stream decides
  what to send next (``start``) and reads the rest back (active_stream.py's rules
  apply). Nothing here awaits or touches a socket.
- ``write_run`` copies runs of ready frames (the checkpoint's wire log, or a disk
  backfill's frames, which already carry this stream's opaque); ``write_items`` encodes
  ``Item``s (a 24-byte header in front of a stored body where there is one); both stop
  at the batch size or the flow-control window, the last frame may overshoot.
- With ``count_disk`` (the stream still has disk bytes charged) both return the bytes
  to count out, exactly as ``push_backfill_*`` charged them, or a backfill would keep
  its connection's slot forever (``Backfills.run``); the stream counts them out.
- ``StreamOptions`` are the connection's choices that shape every frame a writer
  writes (kept here, beside their only reader; active_stream.py re-exports them).
- Wire sizes come from ``dcp.protocol.layout``: the header struct, the mutation extras'
  size and ``MUTATION_FRAME_OVERHEAD`` (the per-item charge of a disk item).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from ..protocol import codec
from ..protocol.layout import HEADER, HEADER_SIZE, MUTATION_EXTRAS, MUTATION_FRAME_OVERHEAD
from ..protocol.opcodes import Opcode
from .engine.checkpoint import WireRun

__all__ = ["FrameWriter", "StreamOptions", "cut_segments"]

_HDR = HEADER.pack
_MUT_EXTRAS = MUTATION_EXTRAS.size
_MUT = Opcode.DCP_MUTATION
_EXP = Opcode.DCP_EXPIRATION


class StreamOptions:
    """Per-connection choices that shape every frame of its streams."""

    __slots__ = (
        "expiry_opcode",
        "include_delete_times",
        "keep_datatype",
        "no_value",
        "seqno_advanced",
        "stable_only",
    )

    def __init__(
        self,
        *,
        no_value: bool = False,
        include_delete_times: bool = False,
        expiry_opcode: bool = False,
        keep_datatype: bool = False,
        seqno_advanced: bool = False,
        stable_only: bool = False,
    ) -> None:
        self.no_value = no_value
        #: control ``stable_only`` (our extension): a snapshot leaves only once its end is
        #: at or below the vbucket's stable seqno (``DurabilityMonitor.stable_seqno``)
        self.stable_only = stable_only
        #: control ``send_seqno_advanced``: end a disk snapshot whose last seqno has no
        #: item (a purged tombstone) with DCP_SEQNO_ADVANCED, so the client knows it is
        #: complete without waiting for the vbucket's next change.
        self.seqno_advanced = seqno_advanced
        #: Open flag 0x40: the value is stripped but the datatype reports the stored one.
        self.keep_datatype = keep_datatype
        self.include_delete_times = include_delete_times
        self.expiry_opcode = expiry_opcode


class FrameWriter:
    """Frame output of one stream (see the module rules)."""

    __slots__ = (
        "bytes_sent",
        "cur",
        "i",
        "items_sent",
        "last_seqno",
        "opaque",
        "opaque_bytes",
        "options",
        "vbid",
    )

    def __init__(self, vbid: int, opaque: int, options: Any, last_seqno: int) -> None:
        self.vbid = vbid
        self.opaque = opaque
        self.opaque_bytes = opaque.to_bytes(4, "big")
        self.options = options
        self.cur: Any = None  # list[Item] | WireRun | None
        self.i = 0
        self.last_seqno = last_seqno
        self.items_sent = 0
        self.bytes_sent = 0

    def start(self, segment: list[Any] | WireRun) -> None:
        """Send ``segment`` (items or a wire run) next, from its first frame."""
        self.cur = segment
        self.i = 0

    def write_items(self, buf: bytearray, buffer_log: Any, max_bytes: int, count_disk: int) -> int:
        """The hot path: encode items of the current snapshot. Mutations use the body the
        engine encoded once; only the 24-byte header is packed per stream. Returns the
        disk bytes to count out (0 unless ``count_disk``)."""
        items = self.cur
        assert items is not None and items.__class__ is not WireRun
        i0 = i = self.i
        n = len(items)
        hdr = _HDR
        hsize = HEADER_SIZE
        extras = _MUT_EXTRAS
        vb = self.vbid
        opaque = self.opaque
        opts = self.options
        fast = not opts.no_value
        window = buffer_log.window or (1 << 62)
        outstanding = buffer_log.outstanding
        start_len = len(buf)
        sent_bytes = 0
        last = self.last_seqno
        while i < n:
            it = items[i]
            op = it.op
            if op == _MUT and fast and it.body:
                body = it.body
                kl = len(it.key)
                frame_len = hsize + len(body)
                buf += hdr(0x80, _MUT, kl, extras, it.datatype, vb, len(body), opaque, it.cas)
                buf += body
            else:
                frame = self.encode_other(it)
                frame_len = len(frame)
                buf += frame
            sent_bytes += frame_len
            outstanding += frame_len
            last = it.seqno
            i += 1
            if outstanding >= window or len(buf) >= max_bytes:
                break
        self.items_sent += i - i0
        self.i = i
        self.last_seqno = last
        self.bytes_sent += len(buf) - start_len
        buffer_log.record(sent_bytes)
        if i >= n:
            self.cur = None
        if count_disk:
            # disk items are counted as they were charged (push_backfill_*), not by the
            # size of the frames this stream's options gave them
            overhead = MUTATION_FRAME_OVERHEAD
            return sum(overhead + len(it.key) + len(it.value) for it in items[i0:i])
        return 0

    def write_run(self, buf: bytearray, buffer_log: Any, max_bytes: int, count_disk: int) -> int:
        """The hot path: copy frames of a wire run, as many as the batch and the window
        allow (the last one may overshoot, as with items), patching in our opaque.
        Returns the disk bytes to count out (0 unless ``count_disk``)."""
        run = self.cur
        assert run is not None and run.__class__ is WireRun
        i = self.i
        starts = run.starts
        k = len(starts)
        room = max_bytes - len(buf)
        window = buffer_log.window
        if window:
            w = window - buffer_log.outstanding
            if w < room:
                room = w
        b0 = starts[i]
        # frames [i, j): the last one is the first whose end reaches ``room`` bytes
        j = bisect_left(starts, b0 + room, i + 1, k) if room < run.end - b0 else k
        b1 = starts[j] if j < k else run.end
        ob = self.opaque_bytes
        wire = run.wire
        ckpt = run.ckpt
        disk = 0
        if ckpt is None:  # read from disk for this stream: frames are ready as they are
            buf += wire[b0:b1]
            if count_disk:
                disk = b1 - b0
        elif ckpt.wire is wire and (ckpt.stamp_opaque == ob or ckpt.stamp_from == ckpt.stamp_upto):
            # our opaque is (or becomes) the one stamped in the wire: see checkpoint.py
            lo = ckpt.stamp_from
            hi = ckpt.stamp_upto
            if lo <= b0 and b1 <= hi:
                buf += wire[b0:b1]  # stamped already: a plain copy
            else:
                if lo == hi or b0 > hi or b1 < lo:  # disjoint: (re)start the stamped range
                    lo = hi = b0
                p0 = len(buf)
                buf += wire[b0:b1]  # a sequential read first: the patches below hit cache
                for st in starts[i:j]:
                    if st < lo or st >= hi:
                        wire[st + 12 : st + 16] = ob
                with memoryview(wire) as mv:
                    buf[p0:] = mv[b0:b1]
                ckpt.stamp_opaque = ob
                ckpt.stamp_from = min(lo, b0)
                ckpt.stamp_upto = max(hi, b1)
        else:
            base = len(buf) - b0 + 12
            buf += wire[b0:b1]
            for st in starts[i:j]:
                p = base + st
                buf[p : p + 4] = ob
        nbytes = b1 - b0
        self.items_sent += j - i
        self.bytes_sent += nbytes
        buffer_log.record(nbytes)
        self.last_seqno = run.seqno(j - 1)
        if j >= k:
            self.cur = None
        else:
            self.i = j
        return disk

    def encode_other(self, it: Any) -> bytes:
        """A frame for an item that has none ready: deletions, expirations, and mutations
        of streams that strip values (their frames depend on the stream's options)."""
        opts = self.options
        op = it.op
        if op == _MUT:
            if not opts.no_value:  # a queued mutation (its frame lives in the wire log)
                return codec.mutation(
                    self.vbid,
                    self.opaque,
                    it.seqno,
                    it.rev_seqno,
                    it.key,
                    it.value,
                    cas=it.cas,
                    datatype=it.datatype,
                    flags=it.flags,
                    expiry=it.expiry,
                )
            return codec.mutation(
                self.vbid,
                self.opaque,
                it.seqno,
                it.rev_seqno,
                it.key,
                b"",
                cas=it.cas,
                datatype=it.datatype if opts.keep_datatype else 0,
                flags=it.flags,
                expiry=it.expiry,
            )
        if op == _EXP and opts.expiry_opcode and opts.include_delete_times:
            return codec.expiration(
                self.vbid,
                self.opaque,
                it.seqno,
                it.rev_seqno,
                it.key,
                cas=it.cas,
                delete_time=it.delete_time,
            )
        return codec.deletion(
            self.vbid,
            self.opaque,
            it.seqno,
            it.rev_seqno,
            it.key,
            cas=it.cas,
            delete_time=it.delete_time if opts.include_delete_times else None,
        )


def cut_segments(segs: list, skip: int, end: int) -> list:
    """The parts of ``segs`` (wire runs and items, seqno order) with skip < seqno <= end."""
    out: list = []
    for seg in segs:
        if seg.__class__ is WireRun:
            n = len(seg)
            lo = seg.count_upto(skip) if seg.seqno(0) <= skip else 0
            hi = seg.count_upto(end) if seg.seqno(n - 1) > end else n
            if lo < hi:
                out.append(seg if lo == 0 and hi == n else seg.cut(lo, hi))
        elif skip < seg.seqno <= end:
            out.append(seg)
    return out
