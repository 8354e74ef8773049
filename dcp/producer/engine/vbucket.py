"""One vbucket: state, seqnos, failover log, per-key metadata and the KV operations.

Rules of this module:
- Only an ACTIVE vbucket accepts front-end reads and writes: a PENDING one answers
  ``TemporaryFailure`` (ETMPFAIL: it is being handed over, retry), a REPLICA or DEAD one
  ``NotMyVbucket``. A replica changes only through ``apply_snapshot`` (whole snapshots
  from its source, with the source's seqnos, CAS and metadata) and ``reset_to`` (after
  a rollback); becoming ACTIVE (not by takeover) adds a failover entry at its high
  seqno, which is the end of its last whole snapshot.
  Every accepted write takes the next seqno, a new HLC CAS (nanoseconds from the
  injected clock, strictly increasing per vbucket) and is queued in the checkpoints.
- The in-memory key index maps key -> a tuple (seqno, rev seqno, CAS, flags, expiry,
  datatype, deleted): tuples of ints are cheap and untracked by the GC. Values are
  not kept in the index: a get finds the item in the checkpoints or reads it from
  LMDB by seqno.
- Expiry is absolute epoch seconds inside the engine (a client's relative expiry of
  up to 30 days is converted on write, as memcached does). Reads never return an item
  whose expiry has passed; only the expiry pass (``expire``) turns it into an
  expiration with a new seqno.
- Errors are the protocol's ``StatusError`` subclasses, so the server answers
  ``exc.status``; bad sizes and ranges are refused, never crash.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ...protocol.errors import (
    InvalidArguments,
    KeyExists,
    KeyNotFound,
    NotMyVbucket,
    TemporaryFailure,
    TooBig,
)
from ...protocol.opcodes import Status, VBucketState
from .checkpoint_manager import CheckpointManager, CheckpointMemory
from .failover import FailoverTable
from .item import GetResult, Item, ItemOp, MutationResult
from .records import VBStateRecord
from .replica import ReplicaVBucket

if TYPE_CHECKING:
    from .config import EngineConfig
    from .lmdb_compaction import VBucketCompaction
    from .storage import LmdbStorage

__all__ = ["StoreMode", "VBucket", "build_key_index"]

_ACTIVE = VBucketState.ACTIVE
_PENDING = VBucketState.PENDING
_REPLICA = VBucketState.REPLICA
_MUTATION = int(ItemOp.MUTATION)
_DELETION = int(ItemOp.DELETION)
_EXPIRATION = int(ItemOp.EXPIRATION)
_RELATIVE_EXPIRY_MAX = 30 * 24 * 3600


class StoreMode:
    """How a store treats an existing key (memcached SET / ADD / REPLACE)."""

    SET = 0
    ADD = 1
    REPLACE = 2


class VBucket(ReplicaVBucket):
    """One vbucket. Read the public attributes; change state only through methods."""

    __slots__ = (
        "_clock",
        "_config",
        "_expiries",
        "_index",
        "_max_cas",
        "_max_key",
        "_max_value",
        "_memory",
        "_notify",
        "_storage",
        "_uuid_source",
        "checkpoints",
        "failover_log",
        "high_seqno",
        "history_start",
        "persisted_seqno",
        "persisted_snap_end",
        "persisted_snap_start",
        "purge_seqno",
        "state",
        "state_version",
        "vbid",
    )

    def __init__(
        self,
        vbid: int,
        *,
        config: EngineConfig,
        memory: CheckpointMemory,
        storage: LmdbStorage,
        clock: Callable[[], float],
        uuid_source: Callable[[], int],
        notify: Callable[[int], None],
        state: VBucketState,
        failover_log: FailoverTable,
        high_seqno: int = 0,
        snap_start: int = 0,
        snap_end: int = 0,
        purge_seqno: int = 0,
        max_cas: int = 0,
        history_start: int = 0,
        index: dict[bytes, tuple] | None = None,
    ) -> None:
        """``index``: the key index warm-up rebuilt (``build_key_index``); the expiry
        heap is rebuilt from it."""
        self.vbid = vbid
        self.state = VBucketState(state)
        self.failover_log = failover_log
        self.high_seqno = high_seqno
        self.persisted_seqno = high_seqno
        self.persisted_snap_start = snap_start
        self.persisted_snap_end = snap_end
        self.purge_seqno = purge_seqno
        self.history_start = history_start
        self.checkpoints = CheckpointManager(
            vbid,
            memory,
            start_seqno=high_seqno + 1,
            max_items=config.checkpoint_max_items,
            max_bytes=config.checkpoint_max_bytes,
        )
        self._config = config
        self._memory = memory
        self._max_key = config.max_key_size
        self._max_value = config.max_value_size
        self._storage = storage
        self._clock = clock
        self._uuid_source = uuid_source
        self._notify = notify
        self._index: dict[bytes, tuple] = {} if index is None else index
        self._expiries = [(e[4], e[0], k) for k, e in self._index.items() if e[4] and not e[6]]
        heapq.heapify(self._expiries)
        self._max_cas = max_cas
        #: bumped by every state change: the flusher persists the state again until it
        #: has written this version (flusher.py)
        self.state_version = 0

    # ------------------------------------------------------------------ properties

    @property
    def uuid(self) -> int:
        """The vbucket uuid: the newest failover entry's."""
        return self.failover_log.entries[0][0]

    @property
    def num_keys(self) -> int:
        """Keys in the index, tombstones included."""
        return len(self._index)

    def stats_seqno(self) -> dict[str, int]:
        """Couchbase ``vbucket-seqno`` stats of this vbucket (without the vb_N: prefix)."""
        return {
            "high_seqno": self.high_seqno,
            "abs_high_seqno": self.high_seqno,
            "max_visible_seqno": self.high_seqno,
            "vb_uuid": self.uuid,
            "purge_seqno": self.purge_seqno,
            "last_persisted_seqno": self.persisted_seqno,
            "last_persisted_snap_start": self.persisted_snap_start,
            "last_persisted_snap_end": self.persisted_snap_end,
        }

    # ------------------------------------------------------------------ state

    def set_state(self, state: VBucketState, *, takeover: bool = False) -> bool:
        """Change state; returns False when it already was ``state`` (nothing happens).

        Becoming ACTIVE starts a new history branch at the high seqno (a replica holds
        whole snapshots only, so that is its last complete snapshot's end), except by
        takeover: the source handed over its own history. Every real change closes the
        open checkpoint, so no snapshot spans two states.
        """
        state = VBucketState(state)
        if state == self.state:
            return False
        if state == _ACTIVE and not takeover:
            self.failover_log.create_entry(self.high_seqno, self._uuid_source)
        self.checkpoints.create_checkpoint()
        self.state = state
        self._state_changed()
        return True

    def _refuse(self) -> None:
        """Raise the error a front-end operation gets from a vbucket that is not active."""
        if self.state is _PENDING:
            raise TemporaryFailure(
                Status.ETMPFAIL, f"vbucket {self.vbid} is pending (being handed over)"
            )
        raise NotMyVbucket(Status.NOT_MY_VBUCKET, f"vbucket {self.vbid} is {self.state.name}")

    def _state_changed(self) -> None:
        self.state_version += 1
        self._notify(self.vbid)

    def state_record(self, high_seqno: int, snap_start: int, snap_end: int) -> VBStateRecord:
        """What the flusher persists for this vbucket with items up to ``high_seqno``."""
        return VBStateRecord(
            int(self.state),
            self.failover_log.copy(),
            high_seqno,
            snap_start,
            snap_end,
            self.purge_seqno,
            self._max_cas,
            self.history_start,
        )

    # ------------------------------------------------------------------ writes

    def _check_key(self, key: bytes) -> bytes:
        if type(key) is not bytes:
            if not isinstance(key, (bytearray, memoryview)):
                raise InvalidArguments(Status.EINVAL, "key must be bytes")
            key = bytes(key)
        if not 0 < len(key) <= self._max_key:
            raise InvalidArguments(Status.EINVAL, f"key length {len(key)} not in 1..250")
        return key

    def store(
        self, key: bytes, value: bytes, flags: int, expiry: int, cas: int, datatype: int, mode: int
    ) -> MutationResult:
        """SET / ADD / REPLACE (``mode``), CAS-checked when ``cas`` != 0.

        The hot path of ingest: checks are ordered so the common case (bytes key and
        value, small ints, no CAS) costs a few comparisons; anything unusual goes
        through the slow checks.
        """
        if self.state is not _ACTIVE:
            self._refuse()
        if type(key) is not bytes or not 0 < len(key) <= self._max_key:
            key = self._check_key(key)
        if type(value) is not bytes:
            value = bytes(value)
        if len(value) > self._max_value:
            raise TooBig(Status.E2BIG, f"value of {len(value)} bytes")
        # a negative int shifted right stays negative (truthy): one test per range
        if (flags | expiry) >> 32 or datatype >> 8 or cas >> 64:
            raise InvalidArguments(Status.EINVAL, "flags/expiry/datatype/cas out of range")
        now = self._clock()
        old = self._index.get(key)
        if old is None:
            if mode == 2 or cas:  # REPLACE, or CAS on a missing key
                if mode == StoreMode.ADD:
                    raise InvalidArguments(Status.EINVAL, "add with a CAS")
                raise KeyNotFound(Status.KEY_ENOENT)
            rev = 1
        else:
            if mode or cas:
                self._check_existing(old, now, mode, cas)
            rev = old[1] + 1
        seqno, new_cas = self._apply(key, value, flags, expiry, datatype, now, rev)
        self._notify(self.vbid)
        return MutationResult(seqno, new_cas, self.failover_log.entries[0][0])

    def _apply(
        self, key: bytes, value: bytes, flags: int, expiry: int, datatype: int, now: float, rev: int
    ) -> tuple[int, int]:
        """Write a checked mutation: seqno, CAS, key index, expiry heap, checkpoint.
        Returns (seqno, CAS). Does not notify (callers do, per write or per batch)."""
        if expiry and expiry <= _RELATIVE_EXPIRY_MAX:
            expiry += int(now)
        seqno = self.high_seqno + 1
        self.high_seqno = seqno
        new_cas = int(now * 1e9)
        if new_cas <= self._max_cas:
            new_cas = self._max_cas + 1
        self._max_cas = new_cas
        self._index[key] = (seqno, rev, new_cas, flags, expiry, datatype, 0)
        if expiry:
            heapq.heappush(self._expiries, (expiry, seqno, key))
        # No body: the checkpoint encodes the frame into its wire log (checkpoint.py)
        self.checkpoints.queue(
            Item(
                self.vbid,
                seqno,
                rev,
                new_cas,
                flags,
                expiry,
                datatype,
                key,
                value,
                _MUTATION,
                0,
                b"",
            )
        )
        return seqno, new_cas

    def store_set(
        self, key: bytes, value: bytes, flags: int, expiry: int, datatype: int, now: float
    ) -> tuple[int, int, int] | None:
        """A plain SET (no CAS) of the batched ingest path; returns (CAS, vbucket uuid,
        seqno), or None (nothing changed) when ``store`` must handle it instead.

        The caller guarantees ``key`` and ``value`` are ``bytes``, ``0 < len(key) <= 250``
        and flags/expiry/datatype are in range (they come from a validated frame), and
        passes ``now`` (the clock read once per batch). It must then call
        ``Bucket.queued_many`` with the vbuckets it wrote to: this method does not
        notify (one notification per vbucket and batch instead of one per write).
        """
        if self.state is not _ACTIVE or len(value) > self._max_value or len(key) > self._max_key:
            return None  # ``store`` raises the right error
        old = self._index.get(key)
        seqno, new_cas = self._apply(
            key, value, flags, expiry, datatype, now, 1 if old is None else old[1] + 1
        )
        return new_cas, self.failover_log.entries[0][0], seqno

    @staticmethod
    def _check_existing(old: tuple, now: float, mode: int, cas: int) -> None:
        """ADD / REPLACE / CAS rules against the key's current version."""
        live = not old[6] and not (old[4] and old[4] <= now)
        if mode == StoreMode.ADD:
            if cas:
                raise InvalidArguments(Status.EINVAL, "add with a CAS")
            if live:
                raise KeyExists(Status.KEY_EEXISTS)
        elif mode == StoreMode.REPLACE and not live:
            raise KeyNotFound(Status.KEY_ENOENT)
        if cas:
            if not live:
                raise KeyNotFound(Status.KEY_ENOENT)
            if old[2] != cas:
                raise KeyExists(Status.KEY_EEXISTS, "CAS mismatch")

    def delete(self, key: bytes, cas: int = 0) -> MutationResult:
        """Replace a live key with a tombstone (CAS-checked when ``cas`` != 0)."""
        if self.state is not _ACTIVE:
            self._refuse()
        key = self._check_key(key)
        now = self._clock()
        old = self._index.get(key)
        if old is None or old[6] or (old[4] and old[4] <= now):
            raise KeyNotFound(Status.KEY_ENOENT)
        if cas and old[2] != cas:
            raise KeyExists(Status.KEY_EEXISTS, "CAS mismatch")
        return self._tombstone(key, old, now, _DELETION)

    def _tombstone(self, key: bytes, old: tuple, now: float, op: int) -> MutationResult:
        seqno = self.high_seqno + 1
        self.high_seqno = seqno
        new_cas = int(now * 1e9)
        if new_cas <= self._max_cas:
            new_cas = self._max_cas + 1
        self._max_cas = new_cas
        rev = old[1] + 1
        item = Item(self.vbid, seqno, rev, new_cas, 0, 0, 0, key, b"", op, int(now), b"")
        self._index[key] = (seqno, rev, new_cas, 0, 0, 0, 1)
        self.checkpoints.queue(item)
        self._notify(self.vbid)
        return MutationResult(seqno, new_cas, self.failover_log.entries[0][0])

    def expire(self, now: float) -> int:
        """Turn every item whose expiry passed into an expiration; returns how many."""
        if self.state is not _ACTIVE:
            return 0
        heap = self._expiries
        index = self._index
        n = 0
        while heap and heap[0][0] <= now:
            _exp, seqno, key = heapq.heappop(heap)
            e = index.get(key)
            if e is None or e[0] != seqno or e[6]:
                continue  # superseded since
            self._tombstone(key, e, now, _EXPIRATION)
            n += 1
        return n

    # ------------------------------------------------------------------ reads

    def get(self, key: bytes) -> GetResult:
        """The live document for ``key``; ``KeyNotFound`` if absent, deleted or expired."""
        if self.state is not _ACTIVE:
            self._refuse()
        key = self._check_key(key)
        e = self._index.get(key)
        if e is None or e[6] or (e[4] and e[4] <= self._clock()):
            raise KeyNotFound(Status.KEY_ENOENT)
        item = self.checkpoints.find_item(key)
        if item is None or item.seqno != e[0]:
            item = self._storage.get(self.vbid, e[0])
        if item is None:  # pragma: no cover - index and disk disagree
            raise KeyNotFound(Status.KEY_ENOENT, "value missing on disk")
        return GetResult(item.value, e[3], e[2], e[5], e[4])

    def key_meta(self, key: bytes) -> tuple | None:
        """The raw index entry (seqno, rev, cas, flags, expiry, datatype, deleted)."""
        return self._index.get(key)

    # ------------------------------------------------------------------ compaction

    def apply_compaction(self, vc: VBucketCompaction) -> None:
        """A compaction of this vbucket committed (compaction.py): its purged tombstones
        leave the key index (unless a newer version was written since), its purge seqno
        and history start rise (never fall)."""
        index = self._index
        for key, seqno in vc.purged:
            e = index.get(key)
            if e is not None and e[0] == seqno:
                del index[key]
        if vc.purge_seqno > self.purge_seqno:
            self.purge_seqno = vc.purge_seqno
        if vc.history_start > self.history_start:
            self.history_start = vc.history_start

    def __repr__(self) -> str:
        return (
            f"VBucket({self.vbid}, {self.state.name}, high={self.high_seqno}, "
            f"persisted={self.persisted_seqno}, uuid={self.uuid})"
        )


def build_key_index(records: Iterable[tuple], max_cas: int = 0) -> tuple[dict[bytes, tuple], int]:
    """The key index of a warm-up scan (``LmdbStorage.scan_for_warmup``: records in
    seqno order, so the newest version of a key wins) and the highest CAS seen, at
    least ``max_cas``. The index's tuple layout is this module's (module rules)."""
    index: dict[bytes, tuple] = {}
    for seqno, key, op, rev, cas, flags, exp, dt, _dtime in records:
        index[key] = (seqno, rev, cas, flags, exp, dt, 0 if op == _MUTATION else 1)
        if cas > max_cas:
            max_cas = cas
    return index, max_cas
