"""Disk backfill: one consistent scan of a vbucket's stored items, read in bounded chunks.

Rules of this module:
- One LMDB read transaction per scan, opened in ``__init__`` and held until ``close``:
  the whole scan sees one committed state, so it is ONE logical disk snapshot
  ``(start_seqno, end_seqno]`` where ``end_seqno`` is the persisted high seqno in that
  transaction.
- ``read`` is blocking (run it in a worker thread) and touches only LMDB and this
  object. py-lmdb opens environments with MDB_NOTLS, so a read transaction may move
  between threads as long as two threads never use it at once.
- Always ``close()`` (or use ``with``): an open scan pins old pages in the file and
  blocks map growth.
- ``read_frames`` is the streaming fast path: a stored mutation record is a 16-byte
  prefix plus the exact DCP mutation body plus a checksum trailer (records.py), so its
  frame is a packed 24-byte header plus ``record[16:-4]``. Frames come out back to
  back in one buffer with the stream's vbucket and opaque already in place (a
  ``WireRun`` without a checkpoint),
  never as ``Item`` objects: decoding each record into an ``Item`` and encoding it again
  was most of a disk stream's server CPU (docs/benchmarks.md, stream-disk).
- Every record is checked against its checksum before anything of it is used (one C
  CRC-32C call over the bytes LMDB returned). A damaged record raises ``ChecksumError``
  and ends the scan: nothing of that chunk is returned, so a damaged value never
  reaches a consumer (the server ends the stream with BACKFILL_FAIL, dcp/producer/backfills.py).
- With the history window on, the disk holds superseded versions. A scan opened with
  ``every_version=False`` (a stream that did not negotiate change streams) still gives
  one version per key: the newest at or below ``end_seqno``, as a disk without history
  would. ``__init__`` finds the superseded seqnos of the range in one backward pass in
  the scan's own transaction (a key met again further back is superseded), and the reads
  skip them. That pass holds the range's distinct keys in memory until it ends and only
  the superseded seqnos afterwards. It is skipped when the history window is off (the
  flush deletes superseded versions then) and when the storage's bound on superseded
  seqnos (``LmdbStorage.superseded_high``, read after the transaction began) is at or
  below the scan's start: insert-only data and resumes past the last overwrite pay
  nothing.
"""

from __future__ import annotations

import struct
from array import array
from typing import TYPE_CHECKING, Any

import lmdb

from ...protocol.layout import HEADER, MUTATION_FRAME_OVERHEAD
from .checkpoint import MUTATION, MUTATION_EXTLEN, REQUEST, WireRun
from .errors import StorageError
from .item import Item, ItemOp
from .records import (
    CRC_RESIDUE,
    CRC_SIZE,
    PREFIX,
    PREFIX_SEQNO,
    RECORD_HEAD,
    VB_KEY,
    VBStateRecord,
    checksum_error,
    crc32c,
    decode_item,
    item_key,
    record_intact,
)

#: a record's op, datatype, cas, key length (prefix) and by-seqno (first extras field)
_RECORD_HEAD = PREFIX_SEQNO.unpack_from
#: a record's key length (the prefix's fourth field, after op, datatype and cas)
_KEY_LEN = struct.Struct(">10xH").unpack_from
_FRAME_HEAD = HEADER.pack
_MUTATION = int(ItemOp.MUTATION)
_SHORTEST = RECORD_HEAD + CRC_SIZE
_BODY_AT = PREFIX.size  # the DCP body starts after the record's prefix
_BODY_OVERHEAD = _BODY_AT + CRC_SIZE  # record bytes that are not the DCP body

if TYPE_CHECKING:
    from .storage import LmdbStorage

__all__ = ["BackfillChunk", "BackfillScan"]


class BackfillChunk:
    """What ``read_frames`` returns: ``segments`` in seqno order, each a ``WireRun`` of
    ready mutation frames (``ckpt`` is None: the stream copies them as they are) or a
    list of other ``Item``s (deletions, expirations: their frames depend on stream
    options); ``count`` records, ``nbytes`` their approximate wire size, ``first`` and
    ``last`` their seqnos (0 when empty); ``beyond`` the seqno of the first record past
    ``upto`` when the scan met one (0 otherwise)."""

    __slots__ = ("beyond", "count", "first", "last", "nbytes", "segments")

    def __init__(self) -> None:
        self.segments: list[WireRun | list[Item]] = []
        self.count = 0
        self.nbytes = 0
        self.first = 0
        self.last = 0
        self.beyond = 0

    def __repr__(self) -> str:
        return (
            f"BackfillChunk({self.count} records, seqnos {self.first}..{self.last}, "
            f"{len(self.segments)} segments)"
        )


class BackfillScan:
    """Every live item and tombstone of ``vbucket`` with start_seqno < seqno <= end_seqno.

    ``every_version`` (default): with the history window on, superseded versions are
    returned too. False: only each key's newest version at or below ``end_seqno`` (module
    rules), what a client that did not ask for change streams must get.
    ``history`` is True when the snapshot holds every version of that range (history
    window on, ``every_version`` and the range inside it): the marker gets the History
    flag. ``may_contain_duplicates`` is True whenever superseded versions can appear.
    """

    __slots__ = (
        "_cur",
        "_done",
        "_iter",
        "_skip",
        "_storage",
        "_txn",
        "end_seqno",
        "history",
        "may_contain_duplicates",
        "start_seqno",
        "vbucket",
    )

    def __init__(
        self, storage: LmdbStorage, vbucket: int, start_seqno: int, *, every_version: bool = True
    ) -> None:
        self.vbucket = vbucket
        self.start_seqno = start_seqno
        self._txn = None
        self._cur: lmdb.Cursor | None = None
        self._iter = None
        #: seqnos of superseded versions to leave out (None: nothing to leave out)
        self._skip: frozenset[int] | None = None
        self._done = True
        self._storage = None
        storage.scan_opened()  # may block while the map is being grown
        self._storage = storage
        try:
            txn = storage.env.begin(buffers=False)
            self._txn = txn
            raw = txn.get(VB_KEY.pack(vbucket), db=storage.state_db)
            rec = VBStateRecord.decode(raw) if raw else None
            self.end_seqno = rec.high_seqno if rec else 0
            hist_on = storage.history_enabled and every_version
            self.may_contain_duplicates = hist_on
            self.history = hist_on and rec is not None and start_seqno + 1 >= rec.history_start
            self._done = start_seqno >= self.end_seqno
            if (
                not self._done
                and storage.history_enabled
                and not every_version
                and storage.superseded_high[vbucket] > start_seqno  # read after begin
            ):
                skip = _superseded(
                    txn.cursor(db=storage.item_db(vbucket)), vbucket, start_seqno, self.end_seqno
                )
                self._skip = skip or None
            if not self._done:
                cur = txn.cursor(db=storage.item_db(vbucket))
                if cur.set_range(item_key(vbucket, start_seqno + 1)):
                    self._cur = cur
                    self._iter = cur.iternext(keys=False)  # the seqno is in the record
                else:
                    self._done = True
        except lmdb.Error as exc:
            self.close()
            raise StorageError(f"cannot open backfill of vb {vbucket}: {exc}") from exc
        except BaseException:
            self.close()
            raise

    def read(self, max_items: int) -> list[Item]:
        """Up to ``max_items`` items in seqno order; ``[]`` once the scan is done."""
        if self._done:
            return []
        out: list[Item] = []
        append = out.append
        vb = self.vbucket
        end = self.end_seqno
        skip = self._skip
        seqno_of = _RECORD_HEAD
        try:
            for v in self._iter:  # type: ignore[union-attr]
                if not record_intact(v):
                    self._done = True
                    raise checksum_error(vb, self._seqno_here(), v)
                seqno = seqno_of(v)[5]
                if seqno > end:
                    self._done = True
                    break
                if skip is not None and seqno in skip:
                    continue
                append(decode_item(vb, v))
                if len(out) >= max_items:
                    break
            else:
                self._done = True
        except lmdb.Error as exc:
            self._done = True
            raise StorageError(f"backfill of vb {vb} failed: {exc}") from exc
        return out

    def read_frames(self, max_items: int, upto: int, opaque: int) -> BackfillChunk:
        """Up to ``max_items`` records with seqno <= ``upto`` as ready-to-send segments
        (module rules); the scan is done once it passed ``upto`` or the disk snapshot's end.

        This is most of a disk stream's server CPU, so the loop is spare: values only
        (the seqno is in the record head; the LMDB key is fetched only to name a damaged
        record), and a run's frames are gathered as parts and joined once, which costs
        less than growing a bytearray twice per record.
        """
        chunk = BackfillChunk()
        if self._done:
            return chunk
        segs = chunk.segments
        vb = self.vbucket
        limit = min(upto, self.end_seqno)
        head = _RECORD_HEAD
        pack = _FRAME_HEAD
        crc = crc32c
        shortest, residue, overhead = _SHORTEST, CRC_RESIDUE, _BODY_OVERHEAD
        body_at, trailer = _BODY_AT, -CRC_SIZE
        req, dcp_mutation, extlen = REQUEST, MUTATION, MUTATION_EXTLEN
        # a frame is the 24-byte header plus the record less its prefix and trailer
        grow = HEADER.size - overhead
        mutation = _MUTATION
        charge = MUTATION_FRAME_OVERHEAD
        parts: list[bytes] = []
        put = parts.append
        starts = array("I")
        at = starts.append
        pos = 0  # bytes of the run being gathered
        others: list[Item] | None = None
        skip = self._skip
        n = 0
        nbytes = 0
        first = last = 0
        try:
            for raw in self._iter:  # type: ignore[union-attr]
                if len(raw) < shortest or crc(raw) != residue:
                    self._done = True
                    raise checksum_error(vb, self._seqno_here(), raw)
                op, dt, cas, kl, _dtime, seqno = head(raw)
                if seqno > limit:
                    self._done = True
                    chunk.beyond = seqno
                    break
                if skip is not None and seqno in skip:  # superseded (module rules)
                    if seqno >= limit:
                        self._done = True
                        break
                    continue
                if op == mutation:
                    others = None
                    at(pos)
                    size = len(raw)
                    put(pack(req, dcp_mutation, kl, extlen, dt, vb, size - overhead, opaque, cas))
                    put(raw[body_at:trailer])
                    pos += size + grow
                else:
                    if starts:
                        segs.append(WireRun(None, bytearray().join(parts), starts, pos))
                        nbytes += pos
                        starts = array("I")
                        at = starts.append
                        parts = []
                        put = parts.append
                        pos = 0
                    if others is None:
                        others = []
                        segs.append(others)
                    it = decode_item(vb, raw)
                    others.append(it)
                    # the stream counts an item out as this (stream_frames.write_items)
                    nbytes += charge + len(it.key) + len(it.value)
                if not first:
                    first = seqno
                last = seqno
                n += 1
                if seqno >= limit:
                    self._done = True
                    break
                if n >= max_items:
                    break
            else:
                self._done = True
        except lmdb.Error as exc:
            self._done = True
            raise StorageError(f"backfill of vb {vb} failed: {exc}") from exc
        if starts:
            segs.append(WireRun(None, bytearray().join(parts), starts, pos))
            nbytes += pos
        chunk.count = n
        chunk.nbytes = nbytes
        chunk.first = first
        chunk.last = last
        return chunk

    def _seqno_here(self) -> int:
        """The seqno of the record the cursor is on, from its LMDB key (which LMDB's own
        structure protects): how a damaged record is named."""
        key = self._cur.key() if self._cur is not None else b""
        return int.from_bytes(key[2:10], "big")

    @property
    def done(self) -> bool:
        return self._done

    def close(self) -> None:
        """Release the read transaction (idempotent)."""
        txn, self._txn = self._txn, None
        self._iter = self._cur = None
        self._done = True
        if txn is not None:
            try:
                txn.abort()
            except lmdb.Error:  # pragma: no cover - invalidated by a forced close
                pass
        if self._storage is not None:
            self._storage.scan_closed()
            self._storage = None

    def __enter__(self) -> BackfillScan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"BackfillScan(vb={self.vbucket}, {self.start_seqno}..{self.end_seqno}, "
            f"history={self.history}, done={self._done})"
        )


def _superseded(cur: lmdb.Cursor, vb: int, start_seqno: int, end_seqno: int) -> frozenset[int]:
    """Seqnos in ``(start_seqno, end_seqno]`` whose key has a newer version in that range.

    One pass from ``end_seqno`` down: the first version of a key met is its newest, every
    later one is superseded. A damaged record counts as no key here (its own read raises
    ``ChecksumError`` when the scan reaches it).
    """
    first_key = item_key(vb, start_seqno + 1)
    if cur.set_range(item_key(vb, end_seqno + 1)):
        if not cur.prev():
            return frozenset()
    elif not cur.last():
        return frozenset()
    seen: set[bytes] = set()
    skip: list[int] = []
    add, note = seen.add, skip.append
    crc, residue, shortest, head = crc32c, CRC_RESIDUE, _SHORTEST, _KEY_LEN
    key_at = RECORD_HEAD
    records: Any = cur.iterprev()  # (bytes, bytes): the scan's transaction has buffers=False
    for k, raw in records:
        if k < first_key:
            break
        if len(raw) < shortest or crc(raw) != residue:
            continue
        key = raw[key_at : key_at + head(raw)[0]]
        if key in seen:
            note(int.from_bytes(k[2:10], "big"))
        else:
            add(key)
    return frozenset(skip)
