"""Engine configuration: every limit of the storage/replication engine in one place.

Rules of this module:
- Plain data. No behaviour beyond ``validate()``; the engine reads these values, the
  server builds them (from its CLI / config file) and passes them to ``Bucket.open``.
- Sizes are bytes, ages are seconds. A limit of 0 means "off" where the field says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...protocol.opcodes import VBucketState

__all__ = ["EngineConfig"]

MiB = 1024 * 1024
GiB = 1024 * MiB


@dataclass(slots=True)
class EngineConfig:
    """Limits and policies of one bucket.

    Attributes:
        num_vbuckets: number of vbuckets, a power of two (Couchbase uses 1024).
        max_key_size: longest key accepted (memcached: 250 bytes).
        max_value_size: largest value accepted (Couchbase: 20 MiB); larger -> ``TooBig``.
        checkpoint_max_items: the open checkpoint is closed once this many items were queued
            into it (deduplicated ones included).
        checkpoint_max_bytes: ... or when its items take this many bytes.
        checkpoint_memory_quota: bucket-wide checkpoint memory above which the cursors of
            the slowest streams are dropped so their checkpoints can be freed.
        checkpoint_retain_seconds: keep a closed checkpoint no cursor needs this long
            after it closed (memory pressure frees it sooner), so ranges planned a moment
            ago are still served from memory at their boundaries (0 = free at once).
        history_seconds: keep superseded versions on disk this long (0 = off).
        history_bytes: keep at most this many bytes of superseded versions, split evenly
            between vbuckets as Magma does (0 = no byte limit).
        tombstone_purge_age: compaction removes tombstones older than this.
        map_size: initial LMDB map size (virtual; the file grows with use).
        max_failover_entries: failover log capacity (Couchbase: 25).
        initial_state: state of every vbucket of a new bucket.
        lmdb_sync: fsync at every commit (durability); turn off only for tests/benchmarks.
    """

    num_vbuckets: int = 1024
    max_key_size: int = 250
    max_value_size: int = 20 * MiB
    checkpoint_max_items: int = 10_000
    checkpoint_max_bytes: int = 16 * MiB
    checkpoint_memory_quota: int = 256 * MiB
    checkpoint_retain_seconds: float = 0.0
    history_seconds: float = 0.0
    history_bytes: int = 0
    tombstone_purge_age: float = 3 * 24 * 3600.0
    map_size: int = 16 * GiB
    max_failover_entries: int = 25
    initial_state: VBucketState = VBucketState.ACTIVE
    lmdb_sync: bool = True

    @property
    def history_enabled(self) -> bool:
        """True when superseded versions are retained on disk."""
        return self.history_seconds > 0 or self.history_bytes > 0

    def validate(self) -> None:
        """Raise ``ValueError`` for a configuration the engine cannot run with."""
        n = self.num_vbuckets
        if n <= 0 or n & (n - 1) or n > 0x10000:
            raise ValueError(f"num_vbuckets must be a power of two <= 65536, not {n}")
        if not 1 <= self.max_key_size <= 250:
            raise ValueError("max_key_size must be 1..250")
        if self.max_value_size < 0:
            raise ValueError("max_value_size must be >= 0")
        if self.checkpoint_max_items < 1 or self.checkpoint_max_bytes < 1:
            raise ValueError("checkpoint limits must be >= 1")
        if self.max_failover_entries < 1:
            raise ValueError("max_failover_entries must be >= 1")
        if self.checkpoint_retain_seconds < 0:
            raise ValueError("checkpoint_retain_seconds must be >= 0")
        if self.history_seconds < 0 or self.history_bytes < 0:
            raise ValueError("history window must be >= 0")
